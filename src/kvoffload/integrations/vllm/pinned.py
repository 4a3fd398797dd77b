"""Pinned staging for GPU workers: layer copies by DMA, overlapping the forward pass.

A layer-wise load (protocol-v1.md §5.26) copies each verified layer from the
staging buffer into the GPU's paged KV cache on the worker's load stream,
while the forward pass runs on the main stream. From pageable memory that
copy is staged by the driver through its own bounce buffer, synchronously;
registering the staging mapping with ``cudaHostRegister`` makes it a plain
``cudaMemcpyAsync`` (DMA) that the ``non_blocking`` copies queue on the load
stream.

Gated behind the CUDA probe (:func:`kvoffload.gpu_probe.cuda_driver_present`)
and a CUDA cache device; anything that fails leaves the buffer pageable, with
one warning. Not exercised on a GPU in this repository's tests (no GPU here):
see "GPU side: what is untested" in README.md next to this file.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from ... import gpu_probe
from ...staging import StagingBuffer

log = logging.getLogger(__name__)


class PinnedStaging:
    """One staging buffer registered with the CUDA driver, until :meth:`unpin`."""

    def __init__(self) -> None:
        self._buf: Any = None
        self._ptr = 0
        self._tried = False

    @property
    def active(self) -> bool:
        return self._buf is not None

    def pin(self, staging: StagingBuffer | None, device: torch.device) -> bool:
        """Register ``staging`` once; whether copies from it may be ``non_blocking``."""
        if self._buf is not None or self._tried or staging is None:
            return self._buf is not None
        self._tried = True
        if device.type != "cuda" or not gpu_probe.cuda_driver_present():
            return False
        buf: Any = None
        try:
            buf = (ctypes.c_char * staging.size).from_buffer(staging.view)
            ptr = ctypes.addressof(buf)
            err = torch.cuda.cudart().cudaHostRegister(ptr, staging.size, 0)  # type: ignore[no-untyped-call]
            code = int(getattr(err, "value", err))
            if code != 0:
                raise OSError(f"cudaHostRegister returned error {code}")
        except Exception as exc:
            del buf
            log.warning("kvoffload: staging stays pageable (copies not overlapped): %s", exc)
            return False
        self._buf, self._ptr = buf, ptr
        log.info("kvoffload: staging buffer pinned (%d bytes)", staging.size)
        return True

    def unpin(self) -> None:
        """Unregister (before the staging buffer is unmapped)."""
        if self._buf is None:
            return
        try:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)  # type: ignore[no-untyped-call]
        except Exception as exc:
            log.warning("kvoffload: cudaHostUnregister failed: %s", exc)
        self._buf = None
