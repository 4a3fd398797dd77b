"""The GPU side of layer-wise loads (issue 12, lever 6), on a node without a GPU.

Pinned staging is gated behind the CUDA probe and a CUDA cache device; here
neither exists, so what is tested is the CPU fallback and the gate itself, with
``torch.cuda.cudart`` replaced by a test double where the gate is forced open
(no CUDA runtime can run here). What stays untested without a GPU is listed
in src/kvoffload/integrations/vllm/README.md ("GPU side: what is untested").
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from kvoffload import gpu_probe  # noqa: E402
from kvoffload.integrations.vllm import pinned as pinned_mod  # noqa: E402
from kvoffload.integrations.vllm.pinned import PinnedStaging  # noqa: E402
from kvoffload.integrations.vllm.worker import _StepLoad  # noqa: E402
from kvoffload.staging import StagingBuffer  # noqa: E402

pytestmark = pytest.mark.vllm


class CudartDouble:
    """Test double of ``torch.cuda.cudart()``: records calls, returns ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0


@pytest.fixture
def staging() -> Any:
    buf = StagingBuffer(1 << 16)
    yield buf
    buf.close()  # raises BufferError if a registration still exported the mapping


def forbid_cudart(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> Any:
        raise AssertionError("cudart must not be touched here")

    monkeypatch.setattr(torch.cuda, "cudart", boom)


def test_cpu_cache_never_pins(staging: StagingBuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_cudart(monkeypatch)
    p = PinnedStaging()
    assert not p.pin(staging, torch.device("cpu"))
    assert not p.active
    p.unpin()


def test_no_driver_no_pinning(staging: StagingBuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_cudart(monkeypatch)
    monkeypatch.setattr(gpu_probe, "cuda_driver_present", lambda env=None: False)
    assert not PinnedStaging().pin(staging, torch.device("cuda"))


def test_refused_registration_leaves_buffer_pageable(
    staging: StagingBuffer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rt = CudartDouble(code=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(gpu_probe, "cuda_driver_present", lambda env=None: True)
    p = PinnedStaging()
    with caplog.at_level(logging.WARNING, logger=pinned_mod.__name__):
        assert not p.pin(staging, torch.device("cuda"))
    assert "stays pageable" in caplog.text
    assert not p.pin(staging, torch.device("cuda"))  # tried once, not on every load
    assert [c[0] for c in rt.calls] == ["register"]


def test_registration_and_unregistration(
    staging: StagingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = CudartDouble(code=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(gpu_probe, "cuda_driver_present", lambda env=None: True)
    p = PinnedStaging()
    assert p.pin(staging, torch.device("cuda"))
    assert p.active
    ((op, ptr, size),) = rt.calls
    assert (op, size) == ("register", staging.size) and ptr != 0
    p.unpin()
    assert rt.calls[-1] == ("unregister", ptr, 0)
    assert not p.active


def test_driver_probe_is_dlopen_only() -> None:
    def missing(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    assert not gpu_probe.cuda_driver_present(gpu_probe.ProbeEnv(load_library=missing))

    class Lib:
        def cuDriverGetVersion(self, out: Any) -> int:
            return 1  # an error: the version is optional, the library is what counts

    assert gpu_probe.cuda_driver_present(gpu_probe.ProbeEnv(load_library=lambda _n: Lib()))


def test_step_load_releases_a_layer_when_every_chunk_settled() -> None:
    step = _StepLoad(num_layers=3, total_chunks=4, stream=None)
    step.add(0, 3)
    assert not step.ready[0].is_set()
    step.add(0, 1)
    assert step.ready[0].is_set() and not step.ready[1].is_set()
    assert step.events == [None, None, None]  # CPU: no CUDA events to wait on
    step.wait(0)  # returns at once
    waiter = threading.Thread(target=step.wait, args=(2,))
    waiter.start()
    step.release_all()  # the load ended short: nobody waits forever
    waiter.join(10)
    assert not waiter.is_alive()
    assert all(e.is_set() for e in step.ready)
