"""The client package: one transfer strategy per session, the staging copy hook."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.client import SidecarClient
from kvoffload.client.leased import LeasedPath
from kvoffload.client.staged import StagedPath
from kvoffload.staging import StagingBuffer
from tests.helpers.client_memory import NS, FakeClock, FakeSidecar, key, layers_of, make_client


@pytest.fixture
def fake() -> Iterator[FakeSidecar]:
    f = FakeSidecar()
    yield f
    f.kill_connections()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_the_path_is_chosen_once_per_session(fake: FakeSidecar, clock: FakeClock) -> None:
    c = make_client(fake, clock, direct=True)  # asked for, but the fake offers no direct path
    try:
        assert c.uses_direct() is False
        first = c._path
        assert isinstance(first, StagedPath) and first.name == "staged"
        assert c.save(NS, [(key(1), layers_of(1))]) == [True]
        assert c._path is first  # the same strategy for the whole session
        fake.kill_connections()
        assert c.lookup([key(1)]) == 0  # the session is lost ...
        assert c._path is None
        clock.t += 3600
        assert c.lookup([key(1)]) == 1  # ... and the next one chooses afresh
        assert isinstance(c._path, StagedPath) and c._path is not first
    finally:
        c.close()
    assert c._path is None


def test_a_session_offering_direct_gets_the_leased_path(
    fake: FakeSidecar, clock: FakeClock
) -> None:
    offered: Any = SimpleNamespace(hello=SimpleNamespace(direct={"acme": True}))
    refused: Any = SimpleNamespace(hello=SimpleNamespace(direct={"acme": False}))
    c = make_client(fake, clock, direct=True)
    plain = make_client(fake, clock)  # did not ask: staging whatever is offered
    try:
        assert c.salt is not None and plain.salt is not None  # staging buffers registered
        assert isinstance(c._choose_path(offered), LeasedPath)
        assert isinstance(c._choose_path(refused), StagedPath)
        assert isinstance(plain._choose_path(offered), StagedPath)
    finally:
        c.close()
        plain.close()


def test_replacing_copy_in_on_the_class_takes_effect_mid_session(
    fake: FakeSidecar, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_client(fake, clock)
    try:
        assert c.salt is not None  # the session (and its staged path) exists already
        seen: list[int] = []
        real = SidecarClient._copy_in

        def spy(staging: StagingBuffer, offset: int, layers: list[memoryview]) -> None:
            seen.append(offset)
            real(staging, offset, layers)

        monkeypatch.setattr(SidecarClient, "_copy_in", staticmethod(spy))
        assert c.save(NS, [(key(i), layers_of(i)) for i in range(3)]) == [True] * 3
        assert len(seen) == 3
        got: Any = c.load([key(2)])
        assert got[0].ok and [bytes(v) for v in got[0].layers] == layers_of(2)
    finally:
        c.close()
