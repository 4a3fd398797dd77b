"""Which vLLM versions the vLLM connector (:mod:`kvoffload.integrations.vllm`) is tested with.

vLLM's connector interface changes between minor versions (constructor,
cache views, scheduler-output fields), so the connector refuses a vLLM
outside :data:`TESTED` with one line naming the range, instead of failing
later in a way that reads like a kvoffload bug. ``KVOFFLOAD_VLLM_UNTESTED=1``
lets an operator try a newer vLLM anyway (the refusal becomes a warning).
Standard library only, outside the vllm package (whose import imports vLLM).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from kvoffload.errors import KVOffloadConfigError

__all__ = ["TESTED", "TESTED_RANGE", "check_vllm_version"]

log = logging.getLogger("kvoffload.integrations.vllm")

#: [lowest, first untested) (major, minor) of vLLM.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((0, 33), (0, 34))
TESTED_RANGE = ">=0.33,<0.34"


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm_version(version: str, env: Mapping[str, str] | None = None) -> bool:
    """True if ``version`` is in the tested range; else refuse (or warn, when allowed)."""
    mm = _major_minor(version)
    lo, hi = TESTED
    if mm is not None and lo <= mm < hi:
        return True
    env = os.environ if env is None else env
    msg = (
        f"vLLM {version} is not a version kvoffload's connector is tested with "
        f"(vllm{TESTED_RANGE}): install kvoffload[vllm] next to a tested vLLM"
    )
    if env.get("KVOFFLOAD_VLLM_UNTESTED") == "1":
        log.warning("kvoffload: %s; starting anyway (KVOFFLOAD_VLLM_UNTESTED=1)", msg)
        return False
    raise KVOffloadConfigError(f"{msg}, or set KVOFFLOAD_VLLM_UNTESTED=1 to try it anyway")
