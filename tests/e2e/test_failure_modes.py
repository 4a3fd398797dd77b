"""Every failure of the store or the sidecar ends in a correct recompute.

Real processes throughout: ``kvoffload --dev serve`` sidecars (AES-GCM objects
on disk, an LMDB index), engine processes running vLLM 0.33's scheduler with
kvoffload's connector loaded by module path over the CPU stand-in runner and
a batch-invariant transformers Llama (``standin.py``, ``variants.py``).

One module-scoped scenario, in this order:

1. Engine A saves five 170-token prompts (five 32-token chunks each, one
   tenant per failure) on sidecar S1. Concurrently, engine A' starts saving
   another prompt on sidecar S2 (``idle_reservation_timeout = 1s``) and hangs
   in the middle of it: its third chunk's ``prepare_store`` has reserved
   space and the process never gets to ``complete_store``.
2. Behind the sidecar's back: chunk 1's object of prompt 1 is deleted;
   one byte inside layer 2's data of chunk 3's object of prompt 2 is
   flipped; chunk 2's object of prompt 3 is deleted and a read lets S1 drop
   it from its index (what an eviction leaves: chunks 0, 1, 3, 4 present).
3. S1 is SIGKILLed and started again on the same store.
4. A' is left hanging until S2's handle TTL has released its reservation,
   then SIGKILLed.
5. Engine B (one process, one variant per failure, each with a fresh vLLM
   scheduler, connectors and caches) runs each prompt; one variant points at
   a socket no sidecar listens on, one cannot copy any loaded chunk into its
   cache (a regression test: see the last test).

Each test then checks what B loaded, what it recomputed, that its tokens,
logits and prompt KV equal B's own full recompute bit for bit, and what the
store holds afterwards. Waits are bounded waits for conditions; nothing is
timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.layouts import v1

from ..sidecar_proc import DevSidecar, dev_sidecar, wait_until
from .standin import TinyLlamaSpec, iter_layers, requires_transformers, requires_vllm
from .standin import write_model_dir as _write_model_dir
from .variants import request, start_engine, variant

pytestmark = [pytest.mark.vllm, pytest.mark.slow, requires_transformers, requires_vllm]

SPEC = TinyLlamaSpec()
CHUNK = 32
PROMPT_LEN = 170  # five full chunks and a partial one
SHARED = 5 * CHUNK
NEW_TOKENS = 8
DELETED = 1  # the chunk whose object is deleted behind the index's back
CORRUPTED = 3  # the chunk with a flipped byte in one layer
CORRUPTED_LAYER = 2
MISSING = 2  # the chunk the store no longer has at all ("delete the 3rd of 5")
PAUSE_AT_COPY = 3  # A' hangs copying its third chunk: chunks 0 and 1 are stored
#: One chunk of SPEC in the staging buffer: 4 layers × 32 tokens × 2 KV heads ×
#: (K + V) × 32 dims × 4 bytes. A' saves one chunk per prepare/complete round.
ONE_CHUNK_STAGING = 4 * CHUNK * 2 * 2 * 32 * 4
ENGINE_WAIT_S = 600.0

CASES = ("deleted", "corrupt", "partial", "restart", "down", "cancel", "unusable")
ON_S1 = ("deleted", "corrupt", "partial", "restart", "unusable")


def tokens(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(4000 + seed)
    return torch.randint(0, SPEC.vocab_size, (PROMPT_LEN,), generator=gen).tolist()


PROMPTS = {case: tokens(i) for i, case in enumerate(CASES)}


@dataclasses.dataclass
class Scenario:
    s1: DevSidecar
    s2: DevSidecar
    tenants: dict[str, str]
    a: dict[str, dict[str, Any]]
    b: dict[str, dict[str, Any]]
    keys: dict[str, list[bytes]]
    seen: dict[str, Any]  # observations made between the steps


def extra(sidecar: DevSidecar | Path, tenant: str, **over: Any) -> dict[str, Any]:
    socket_path = sidecar if isinstance(sidecar, Path) else sidecar.socket_path
    base: dict[str, Any] = {
        "tenant": tenant,
        "socket_path": str(socket_path),
        "chunk_tokens": CHUNK,
        "staging_bytes": 1 << 20,
        "model_revision": SPEC.model_revision,
        "attention_backend": "STANDIN_CPU_EAGER",
        "tokenizer_hash": "tiny-vocab-512",
        "timeout_s": 30.0,
    }
    base.update(over)
    return base


def eventually(cond: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``cond`` came true within ``timeout_s`` (a bounded wait, not a timing test)."""
    try:
        wait_until(cond, "condition", timeout_s=timeout_s)
    except AssertionError:
        return False
    return True


def flip_byte_in_layer(path: Path, layer: int) -> int:
    """Flip one byte in the middle of ``layer``'s data region; its file offset."""
    data = path.read_bytes()
    header = v1.decode_header(data)
    entry = header.layers[layer]
    at = entry.offset + entry.length // 2
    with path.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x5A]))
    return at


@contextlib.contextmanager
def dead_socket() -> Iterator[Path]:
    """A socket file nobody listens on: what a crashed sidecar leaves (ECONNREFUSED)."""
    folder = Path(tempfile.mkdtemp(prefix="kvo-e2e-", dir="/tmp"))  # AF_UNIX: short paths
    try:
        path = folder / "dead.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.close()
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    pytest.importorskip("kvoffload.integrations.vllm", reason="the vLLM connector is absent")
    workdir = tmp_path_factory.mktemp("engines")
    model_dir = _write_model_dir(SPEC, tmp_path_factory.mktemp("model"))
    tenants = {case: f"t-{uuid.uuid4().hex[:12]}" for case in CASES}
    seen: dict[str, Any] = {}
    ttl = {"KVOFFLOAD_SERVER_IDLE_RESERVATION_TIMEOUT": "1s"}
    with dev_sidecar() as s1, dev_sidecar(ttl) as s2, dead_socket() as nowhere:

        def v(name: str, case: str, sidecar: DevSidecar | Path, **kw: Any) -> dict[str, Any]:
            over = kw.pop("extra", {})
            n = kw.pop("new_tokens", NEW_TOKENS)
            return variant(
                name,
                spec=SPEC,
                model_dir=model_dir,
                extra_config=extra(sidecar, tenants[case], **over),
                requests=[request("a" if name.startswith("a_") else "b", PROMPTS[case], n)],
                **kw,
            )

        # 1. A' (hangs mid-save on S2) and A (saves four prompts on S1), concurrently.
        marker = workdir / "a_cancel.paused"
        a_cancel = start_engine(
            "engine-a-cancel",
            [
                v("a_cancel", "cancel", s2, new_tokens=4, recompute=False,
                  extra={"save_mode": "sync", "staging_bytes": ONE_CHUNK_STAGING},
                  pause_save_at_copy=PAUSE_AT_COPY, pause_marker=marker),
            ],
            workdir,
        )  # fmt: skip
        try:
            a_variants = [v(f"a_{case}", case, s1, new_tokens=4, recompute=False) for case in ON_S1]
            a = start_engine("engine-a", a_variants, workdir).wait(ENGINE_WAIT_S)
            for name, r in a.items():
                assert r["error"] is None, f"{name}:\n{r['error']}"
            keys = {
                case: s1.keys(a[f"a_{case}"]["contracts"]["a"][0], PROMPTS[case]) for case in ON_S1
            }
            seen["stored_by_a"] = {
                case: s1.lookup(tenants[case], k) for case, k in sorted(keys.items())
            }

            # 2. Behind S1's back.
            t = tenants
            s1.object_path(t["deleted"], keys["deleted"][DELETED]).unlink()
            seen["deleted_lookup_before_b"] = s1.lookup(t["deleted"], keys["deleted"])
            corrupt_path = s1.object_path(t["corrupt"], keys["corrupt"][CORRUPTED])
            flip_byte_in_layer(corrupt_path, CORRUPTED_LAYER)
            seen["corrupted_bytes"] = corrupt_path.read_bytes()
            s1.object_path(t["partial"], keys["partial"][MISSING]).unlink()
            # A read of the vanished object is a miss that drops its index entry.
            seen["partial_read"] = s1.load_ok(t["partial"], [keys["partial"][MISSING]])

            # 3. SIGKILL S1 and start it again on the same store.
            old_pid = s1.proc.pid
            s1.proc.kill()
            assert s1.proc.proc is not None
            seen["s1_killed_rc"] = s1.proc.proc.returncode
            s1.proc.start().wait_ready()
            seen["s1_pids"] = (old_pid, s1.proc.pid)
            seen["lookups_after_restart"] = {
                case: s1.lookup(t[case], k) for case, k in sorted(keys.items())
            }

            # 4. A' hangs mid-save: a reservation is held until the handle TTL.
            # Outcomes are recorded, not asserted, so that only the tests about
            # the cancelled save fail when it goes wrong.
            eventually(lambda: marker.exists() or not a_cancel.alive(), ENGINE_WAIT_S)
            seen["paused"] = json.loads(marker.read_text()) if marker.exists() else None
            seen["objects_while_paused"] = len(s2.objects(t["cancel"]))
            seen["ttl_released"] = seen["paused"] is not None and eventually(
                lambda: s2.stats()["reserved_bytes"] == 0, 30.0
            )
            seen["a_cancel_alive_after_ttl"] = a_cancel.alive()
            seen["a_cancel_log"] = a_cancel.log_tail()
            seen["a_cancel_rc"] = a_cancel.kill()
            seen["closed_after_kill"] = eventually(
                lambda: s2.stats()["server"]["connections"] == 1, 30.0
            )
            seen["reserved_after_kill"] = s2.stats()["reserved_bytes"]
            seen["tmp_after_kill"] = [str(p) for p in s2.tmp_files()]
            seen["objects_after_kill"] = s2.objects(t["cancel"])
            seen["s2_log"] = s2.proc.log_text()
        finally:
            a_cancel.kill()

        # 5. B: every failure, one process.
        b = start_engine(
            "engine-b",
            [
                # Load-only (kv_consumer): what the index holds afterwards is
                # what the failed load left, not what B saved again.
                v("b_deleted", "deleted", s1, kv_role="kv_consumer"),
                v("b_corrupt", "corrupt", s1, extra={"load_mode": "sync"}),
                v("b_partial", "partial", s1),
                v("b_restart", "restart", s1),
                v("b_down", "down", nowhere, extra={"timeout_s": 1.0}),
                v("b_cancel", "cancel", s2),
                v("b_unusable", "unusable", s1, unusable_loads=True),
            ],
            workdir,
        ).wait(ENGINE_WAIT_S)
        keys["cancel"] = [
            bytes.fromhex(p.name.removesuffix(v1.OBJECT_SUFFIX)) for p in seen["objects_after_kill"]
        ]
        yield Scenario(s1, s2, tenants, a, b, keys, seen)


def ok(sc: Scenario, name: str) -> dict[str, Any]:
    r = sc.b[name]
    assert r["error"] is None, f"{name} raised:\n{r['error']}"
    return r


def assert_correct(b: dict[str, Any], *, computed_from: int) -> dict[str, Any]:
    """B computed prompt positions from ``computed_from`` on (what came before was
    loaded), and its tokens, logits and prompt KV equal its full recompute."""
    run: dict[str, Any] = b["runs"]["b"]
    recompute = b["recompute"]["b"]
    assert run["num_local_cached_tokens"] == 0
    assert run["prefill_start"] == computed_from
    assert run["prefill_logits"].shape[0] == PROMPT_LEN - computed_from
    assert torch.isfinite(run["sampled_logits"]).all()
    assert run["tokens"] == recompute["tokens"]
    assert torch.equal(run["sampled_logits"], recompute["sampled_logits"])
    assert torch.equal(run["prefill_logits"], recompute["prefill_logits"][computed_from:])
    pairs = zip(iter_layers(run["prompt_kv"]), iter_layers(recompute["prompt_kv"]), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    return run


def test_a_saved_every_prompt(scenario: Scenario) -> None:
    assert scenario.seen["stored_by_a"] == dict.fromkeys(sorted(ON_S1), 5)


def test_deleted_object_is_recomputed_from_that_chunk(scenario: Scenario) -> None:
    sc = scenario
    # The index still listed the deleted chunk: the lookup promised all five.
    assert sc.seen["deleted_lookup_before_b"] == 5
    b = ok(sc, "b_deleted")
    assert [o[2] for o in b["offered"]] == [SHARED]
    # The load stopped at the missing object; vLLM recomputed from its first block.
    assert_correct(b, computed_from=DELETED * CHUNK)
    # The sidecar dropped the entry on the failed read: a later lookup stops there.
    tenant, keys = sc.tenants["deleted"], sc.keys["deleted"]
    assert sc.s1.lookup(tenant, keys) == DELETED
    assert sc.s1.load_ok(tenant, keys[:DELETED]) == [True] * DELETED
    # The chunks after the hole are still there (a prefix cache just cannot use them).
    assert sc.s1.load_ok(tenant, keys[DELETED + 1 :]) == [True] * (5 - DELETED - 1)


def test_corrupted_layer_is_recomputed_from_that_chunk(scenario: Scenario) -> None:
    sc = scenario
    b = ok(sc, "b_corrupt")
    # A sync load: the step's forward ran over the bad blocks, then vLLM rewound.
    assert [o[2] for o in b["offered"]] == [SHARED]
    assert_correct(b, computed_from=CORRUPTED * CHUNK)
    # The sidecar caught it (AES-GCM tag of the layer) and threw the object away;
    # B, a kv_both engine, saved its recomputed chunk in its place.
    assert sc.s1.stats()["corrupt"] == 1  # counters restarted with S1: this object only
    tenant, keys = sc.tenants["corrupt"], sc.keys["corrupt"]
    path = sc.s1.object_path(tenant, keys[CORRUPTED])
    assert path.read_bytes() != sc.seen["corrupted_bytes"]
    assert sc.s1.load_ok(tenant, keys) == [True] * 5


def test_partial_store_loads_leading_chunks_only(scenario: Scenario) -> None:
    sc = scenario
    # The read before the restart dropped chunk 2; the index kept that.
    assert sc.seen["partial_read"] == [False]
    assert sc.seen["lookups_after_restart"]["partial"] == MISSING
    b = ok(sc, "b_partial")
    assert b["lookups"] == [(5, MISSING)]
    assert [o[2] for o in b["offered"]] == [MISSING * CHUNK]
    run = assert_correct(b, computed_from=MISSING * CHUNK)
    # vLLM's own accounting: two chunks came from the connector.
    assert run["num_external_cached_tokens"] == MISSING * CHUNK


def test_sidecar_killed_and_restarted_between_save_and_load(scenario: Scenario) -> None:
    sc = scenario
    old, new = sc.seen["s1_pids"]
    assert old != new and sc.seen["s1_killed_rc"] == -signal.SIGKILL
    # The restarted sidecar reopened the index: everything A saved is found.
    assert sc.seen["lookups_after_restart"]["restart"] == 5
    b = ok(sc, "b_restart")
    assert b["lookups"] == [(5, 5)]
    run = assert_correct(b, computed_from=SHARED)
    assert run["num_external_cached_tokens"] == SHARED


def test_sidecar_down_engine_recomputes(scenario: Scenario) -> None:
    b = ok(scenario, "b_down")  # no exception anywhere in the engine
    # No salt, so no keys: the connector did not even ask, and offered nothing.
    assert b["lookups"] == []
    assert [o[2] for o in b["offered"]] == [0]
    run = assert_correct(b, computed_from=0)
    assert run["num_external_cached_tokens"] == 0


def test_client_killed_mid_save_leaves_no_orphan(scenario: Scenario) -> None:
    seen = scenario.seen
    assert seen["paused"] is not None, f"A' never paused mid-save:\n{seen['a_cancel_log']}"
    assert seen["paused"]["copy"] == PAUSE_AT_COPY
    # The kill landed mid-save: one chunk's space was reserved, two chunks stored.
    assert seen["paused"]["reserved_bytes"] > 0  # read by A' itself, right then
    assert seen["objects_while_paused"] == PAUSE_AT_COPY - 1
    # The handle TTL released the reservation while A' was still alive and connected ...
    assert seen["ttl_released"]
    assert seen["a_cancel_alive_after_ttl"]
    assert "1 handle(s) expired" in seen["s2_log"]
    # ... and its SIGKILL left nothing behind.
    assert seen["a_cancel_rc"] == -signal.SIGKILL
    assert seen["closed_after_kill"]
    assert seen["reserved_after_kill"] == 0
    assert seen["tmp_after_kill"] == []
    # What was fully saved is valid: exactly the prompt's first two chunks (keys
    # derived outside the connector, under B's equal contract), verified on load.
    sc = scenario
    tenant, on_disk = sc.tenants["cancel"], sc.keys["cancel"]
    (contract,) = ok(sc, "b_cancel")["contracts"]["b"]
    leading = sc.s2.keys(contract, PROMPTS["cancel"])[: PAUSE_AT_COPY - 1]
    assert sorted(on_disk) == sorted(leading)
    assert sc.s2.load_ok(tenant, leading) == [True] * len(leading)


def test_engine_after_cancelled_save_reuses_what_was_saved(scenario: Scenario) -> None:
    sc = scenario
    b = ok(sc, "b_cancel")
    saved = PAUSE_AT_COPY - 1
    assert b["lookups"] == [(5, saved)]
    run = assert_correct(b, computed_from=saved * CHUNK)
    assert run["num_external_cached_tokens"] == saved * CHUNK
    # B saved the chunks A' never finished: the prompt is whole in the store again.
    tenant = sc.tenants["cancel"]
    assert len(sc.s2.objects(tenant)) == 5
    assert sc.s2.tmp_files() == []
    assert sc.s2.stats()["reserved_bytes"] == 0


def test_chunk_the_worker_cannot_use_is_recomputed_not_retried(scenario: Scenario) -> None:
    """Regression: an async load failing at chunk 0 for a reason the sidecar does not
    see (every copy into the cache fails; the store still lists the chunks) rewinds
    the request to token 0, and vLLM asks the connector again. It must not offer
    the same chunks again (it did, and the request retried the load forever)."""
    sc = scenario
    b = ok(sc, "b_unusable")
    assert [o[2] for o in b["offered"]] == [SHARED, 0]
    assert_correct(b, computed_from=0)
    # The store was fine all along: the chunks are still there.
    assert sc.s1.lookup(sc.tenants["unusable"], sc.keys["unusable"]) == 5
