"""kvoffload's L2 plugin inside LMCache's real MP server, against a real sidecar.

The engine side is LMCache's own bench worker (CPU KV caches over POSIX shared
memory); every hit after ``clear_l1`` comes from L2, i.e. through the plugin
and the sidecar, since the server runs with ``--l2-store-policy skip_l1``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvoffload.testing import cli_argv

from ..sidecar_proc import DevSidecar, wait_until
from .mp_server import TOKENS, MPServer, Worker, plugin_spec

CHUNKS = TOKENS // 256


def _chunks(sc: DevSidecar, tenant: str) -> int:
    return int((sc.stats().get("tenant_usage", {}).get(tenant) or {}).get("chunks", 0))


def _stored(w: Worker, sc: DevSidecar, seq: int, salt: str, tenant: str) -> dict[str, object]:
    before = _chunks(sc, tenant)
    ref = w.fill(seq, 1000 + seq)
    assert w.store(seq, salt)
    wait_until(lambda: _chunks(sc, tenant) >= before + CHUNKS, f"{tenant}'s chunks in the sidecar")
    w.clear_l1()
    w.zero(seq)
    return ref


def test_lmcache_stores_and_retrieves_through_the_sidecar(
    worker: Worker, sidecar: DevSidecar, mp_server: MPServer
) -> None:
    """A store through LMCache lands in the sidecar as sealed chunks of the salt's
    tenant; after LMCache forgets it (L1 cleared), a lookup hits from L2 and the
    retrieve puts the very bytes back into the engine's KV cache."""
    assert worker.lookup(1, "alice") == 0  # a cold request misses
    ref = _stored(worker, sidecar, 1, "alice", "alice")
    assert len(sidecar.objects("alice")) == CHUNKS
    for obj in sidecar.objects("alice"):  # sealed per tenant: no plaintext KV on disk
        raw = obj.read_bytes()
        assert not any(bytes(t.numpy().tobytes()[:4096]) in raw for t in ref.values())  # type: ignore[attr-defined]
    assert not worker.equal(1, ref)
    hit, ok = worker.fetch(1, "alice")
    assert (hit, ok) == (CHUNKS, True)
    assert worker.equal(1, ref)


def test_another_tenants_salt_never_hits(worker: Worker, sidecar: DevSidecar) -> None:
    """The same tokens under bob's salt, no salt or an unmapped salt: all misses
    (other tenants' keys, or not cached at all); alice still hits."""
    _stored(worker, sidecar, 2, "alice", "alice")
    assert worker.lookup(2, "bob") == 0
    assert worker.lookup(2, "") == 0
    assert worker.lookup(2, "mallory") == 0
    assert worker.fetch(2, "alice") == (CHUNKS, True)
    # An unmapped salt is never stored either: no tenant of that name in the sidecar
    # (what LMCache keeps in its own L1 is LMCache's).
    worker.fill(3, 3)
    assert worker.store(3, "mallory")
    worker.clear_l1()
    assert worker.fetch(4, "alice")[0] == 0  # a round trip after the store's L2 task
    assert "mallory" not in sidecar.stats().get("tenant_usage", {})
    assert not sidecar.objects("mallory")


def test_a_purge_is_seen_by_lmcache_as_misses(worker: Worker, sidecar: DevSidecar) -> None:
    """`kvoffload purge --tenant alice` while LMCache runs: its next lookups of alice's
    chunks miss, bob's chunks still hit."""
    _stored(worker, sidecar, 4, "alice", "alice")
    _stored(worker, sidecar, 5, "bob", "bob")
    r = subprocess.run(
        cli_argv("--dev", "purge", "--tenant", "alice", "--yes"),
        cwd=sidecar.workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert worker.lookup(4, "alice") == 0
    assert worker.lookup(1, "alice") == 0
    assert worker.fetch(5, "bob") == (CHUNKS, True)


def test_lmcaches_own_eviction_removes_chunks_from_the_sidecar(
    sidecar: DevSidecar, tmp_path: Path
) -> None:
    """LMCache's L2 eviction controller, over the bounded pool the plugin reports,
    discards objects with the adapter's ``delete``: the sidecar really drops them
    (its chunk count and bytes for the tenant go down), not just LMCache's tally."""
    cap = 6 * CHUNKS * (4 << 20) // 4  # room for 1.5 sequences of 4 MiB objects
    spec = json.loads(
        plugin_spec(
            socket=str(sidecar.socket_path),
            tenants={"carol": "carol"},
            default_tenant=None,
            max_capacity_bytes=cap,
            usage_refresh_s=0.05,
        )
    )
    spec["eviction"] = {"eviction_policy": "LRU", "trigger_watermark": 0.5, "eviction_ratio": 0.5}
    srv = MPServer(tmp_path, [json.dumps(spec)]).start()
    w = Worker(srv.url, instance_base=3000)
    try:
        for seq in (20, 21):
            w.fill(seq, seq)
            assert w.store(seq, "carol")
        seen = [0]

        def dropped() -> bool:
            n = _chunks(sidecar, "carol")
            seen[0] = max(seen[0], n)
            return "triggering eviction" in srv.log() and n < seen[0]

        # Over half the reported capacity: LMCache evicts, and the sidecar drops them.
        wait_until(dropped, "LMCache's L2 eviction to remove chunks from the sidecar", 90)
        assert sidecar.stats()["tenant_usage"]["carol"]["bytes"] < seen[0] * (4 << 20)
    finally:
        w.close()
        srv.stop()
