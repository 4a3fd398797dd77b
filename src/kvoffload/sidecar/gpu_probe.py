"""Moved to :mod:`kvoffload.gpu_probe` (the worker's direct path runs it too).

This name is the same module object, so ``from kvoffload.sidecar.gpu_probe
import probe`` and monkeypatching ``kvoffload.sidecar.gpu_probe.probe`` keep
working, and ``python -m kvoffload.sidecar.gpu_probe`` still runs the probe.
"""

import sys

from kvoffload import gpu_probe as _gpu_probe
from kvoffload.gpu_probe import GpuReport as GpuReport
from kvoffload.gpu_probe import ProbeEnv as ProbeEnv
from kvoffload.gpu_probe import main as main
from kvoffload.gpu_probe import probe as probe
from kvoffload.gpu_probe import redecide as redecide

if __name__ == "__main__":
    sys.exit(main())
sys.modules[__name__] = _gpu_probe
