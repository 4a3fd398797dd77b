"""The sidecar's KV-event feed, end to end: a real ``kvoffload serve`` process, the
real client saving chunks with engine block hashes, real ipc:// ZMQ sockets.

The store's truth is read back through the protocol (``lookup`` per chunk);
the consumer's view must equal it after saves, evictions, purges and a
SIGKILL of the sidecar.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from kvoffload import protocol as p  # noqa: E402
from kvoffload.client import SidecarClient  # noqa: E402
from kvoffload.events.consumer import EventConsumer  # noqa: E402
from kvoffload.events.sources import Health, Recovery, SourceSpec  # noqa: E402
from kvoffload.events.wire import split_seq  # noqa: E402
from kvoffload.testing import cli_argv  # noqa: E402
from kvoffload.transport import UnixTransport  # noqa: E402
from tests.sidecar_proc import DevSidecar, clean_env, dev_sidecar, wait_until  # noqa: E402

NS = bytes(range(32))
TENANT = "acme"
LAYER = 64 << 10


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\x5a" * 28


def _blocks(i: int, n: int = 4) -> p.EngineBlocks:
    hashes = tuple(i.to_bytes(4, "big") + bytes([j]) * 28 for j in range(n))
    return p.EngineBlocks(hashes, 16, parent=None, extra_keys=(None,) * n, group_idx=0)


def _layers(i: int) -> list[bytes]:
    return [bytes([i % 251]) * LAYER, bytes([(i + 1) % 251]) * LAYER]


def _endpoints(sc: DevSidecar) -> tuple[str, str]:
    base = sc.socket_path.parent
    return f"ipc://{base / 'kvevents.pub'}", f"ipc://{base / 'kvevents.replay'}"


@pytest.fixture
def sidecar() -> Iterator[DevSidecar]:
    env = {"KVOFFLOAD_EVENTS_ENABLED": "1", "KVOFFLOAD_STORE_CAPACITY": "2MiB"}
    with dev_sidecar(env) as sc:
        yield sc


def _truth(c: SidecarClient, saved: dict[int, p.EngineBlocks]) -> dict[object, dict[object, int]]:
    held: dict[object, int] = {}
    for i, b in saved.items():
        if c.lookup([_key(i)]) == 1:
            for h in b.hashes:
                held[h] = held.get(h, 0) + 1
    return {("STORAGE", "LOCAL"): held} if held else {}


def _converge(consumer: EventConsumer, want: dict[object, dict[object, int]]) -> None:
    def done() -> bool:
        consumer.poll(0.02)
        consumer.sync("node")
        with consumer.lock:
            return consumer.view("node").snapshot() == want

    wait_until(done, "the consumer's view equals the store")


def _purge(sc: DevSidecar, tenant: str) -> None:
    t = UnixTransport.connect(sc.socket_path, timeout_s=20)
    try:
        for rid, req in enumerate((p.Hello(1, 1, "events-test", (tenant,)), p.Purge(tenant)), 1):
            t.send(p.request_message(rid, req))
            got, reply = p.parse_reply(t.recv().msg)
            assert got == rid and not isinstance(reply, p.ErrorReply), reply
    finally:
        t.close()


def test_saves_evictions_purge_and_a_killed_sidecar(sidecar: DevSidecar) -> None:
    pub_ep, rep_ep = _endpoints(sidecar)
    for ep in (pub_ep, rep_ep):
        mode = stat.S_IMODE(os.stat(ep.removeprefix("ipc://")).st_mode)
        assert mode == 0o660, oct(mode)
    spec = SourceSpec("node", pub_ep, rep_ep, snapshots=True)
    saved: dict[int, p.EngineBlocks] = {}
    with (
        EventConsumer([spec], request_timeout_s=5, idle_check_s=0) as consumer,
        SidecarClient(sidecar.socket_path, TENANT, staging_bytes=4 << 20, timeout_s=30) as c,
    ):
        assert consumer.status("node").health is Health.LIVE
        # A chunk saved without hashes is not announced.
        assert c.save(NS, [(_key(1000), _layers(1000))]) == [True]
        for i in range(40):  # 40 x 128 KiB into 2 MiB: most are evicted again
            saved[i] = _blocks(i)
            assert c.save(NS, [(_key(i), _layers(i))], blocks=[saved[i]]) == [True]
        _converge(consumer, _truth(c, saved))
        held = _truth(c, saved)
        assert 0 < len(held[("STORAGE", "LOCAL")]) < 40 * 4  # evictions were published
        # Saving a present chunk again changes nothing.
        last = max(saved)
        assert c.save(NS, [(_key(last), _layers(last))], blocks=[saved[last]]) == [True]
        _converge(consumer, _truth(c, saved))

        _purge(sidecar, TENANT)
        _converge(consumer, {})
        st = consumer.status("node")
        assert st.malformed == 0 and st.gaps == 0

    # The sidecar dies between publishes; the consumer (new) and the old seqs.
    with SidecarClient(sidecar.socket_path, TENANT, staging_bytes=4 << 20, timeout_s=30) as c:
        for i in range(100, 106):
            saved[i] = _blocks(i)
            assert c.save(NS, [(_key(i), _layers(i))], blocks=[saved[i]]) == [True]
    consumer = EventConsumer([spec], request_timeout_s=2, idle_check_s=0)
    try:
        before = consumer.status("node").last_seq
        assert before is not None
        os.kill(sidecar.proc.pid, signal.SIGKILL)
        sidecar.proc.wait()
        sidecar.proc.start().wait_ready()
        with SidecarClient(sidecar.socket_path, TENANT, staging_bytes=4 << 20, timeout_s=30) as c:
            saved[200] = _blocks(200)
            assert c.save(NS, [(_key(200), _layers(200))], blocks=[saved[200]]) == [True]
            _converge(consumer, _truth(c, saved))
        st = consumer.status("node")
        assert st.last_seq is not None and split_seq(st.last_seq)[0] > split_seq(before)[0]
        assert st.recoveries[Recovery.SNAPSHOT] >= 2
    finally:
        consumer.close()


def test_a_tenant_with_events_off_is_never_published(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    uid = os.getuid()
    policy.write_text(
        "version = 1\n"
        "[tenants.quiet]\nevents = false\n"
        f'[[grants]]\nuid = {uid}\ntenants = ["*"]\nadmin = true\n'
    )
    env = {"KVOFFLOAD_EVENTS_ENABLED": "1", "KVOFFLOAD_POLICY": str(policy)}
    with dev_sidecar(env) as sc:
        pub_ep, rep_ep = _endpoints(sc)
        spec = SourceSpec("node", pub_ep, rep_ep, snapshots=True)
        with (
            EventConsumer([spec], request_timeout_s=5, idle_check_s=0) as consumer,
            SidecarClient(sc.socket_path, "quiet", staging_bytes=4 << 20, timeout_s=30) as q,
            SidecarClient(sc.socket_path, TENANT, staging_bytes=4 << 20, timeout_s=30) as c,
        ):
            assert q.save(NS, [(_key(1), _layers(1))], blocks=[_blocks(1)]) == [True]
            assert c.save(NS, [(_key(2), _layers(2))], blocks=[_blocks(2)]) == [True]
            _converge(consumer, _truth(c, {2: _blocks(2)}))
            consumer.remove_source("node")
            consumer.add_source(spec)  # a fresh snapshot: still only acme's
            with consumer.lock:
                assert consumer.view("node").snapshot() == _truth(c, {2: _blocks(2)})


def _tail(sc: DevSidecar, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env({"KVOFFLOAD_SERVER_SOCKET": str(sc.socket_path)})
    return subprocess.run(
        cli_argv("--dev", "events", "tail", *args),
        cwd=sc.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_events_tail_prints_the_feed_from_the_durable_buffer(sidecar: DevSidecar) -> None:
    with SidecarClient(sidecar.socket_path, TENANT, staging_bytes=4 << 20, timeout_s=30) as c:
        for i in range(3):
            assert c.save(NS, [(_key(i), _layers(i))], blocks=[_blocks(i)]) == [True]
    res = _tail(sidecar, "--json", "--from", "0", "--count", "3", "--timeout", "30")
    assert res.returncode == 0, res.stderr
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["type"] for r in recs] == ["BlockStored"] * 3
    assert [r["block_hashes"] for r in recs] == [
        [h.hex() for h in _blocks(i).hashes] for i in range(3)
    ]
    assert all(r["medium"] == "STORAGE" and r["locality"] == "LOCAL" for r in recs)
    assert len({r["incarnation"] for r in recs}) == 1
    human = _tail(sidecar, "--from", "0", "--count", "1", "--timeout", "30")
    assert human.returncode == 0 and "BlockStored STORAGE LOCAL [4]" in human.stdout


def test_events_tail_without_a_feed_is_one_line(tmp_path: Path) -> None:
    res = subprocess.run(
        cli_argv("--dev", "events", "tail", "--count", "1"),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 7, res
    assert "no KV-event socket" in res.stderr and "Traceback" not in res.stderr
    bad = subprocess.run(
        cli_argv("--dev", "events", "tail", "--count", "0"),
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
