"""A store client process for the crash tests: run as a script, it does one
operation on a store and prints ``ACK <tenant> <i>`` after each chunk the store
acknowledged (flushed, so a line is printed only once the call returned).

    python -m tests.faults.driver OP DIR DURABILITY

Chunk keys and contents are pure functions of (tenant, i), so the test process
knows what every acknowledged chunk must read back as.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

from kvoffload.layouts import v1
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = hashlib.sha256(b"faults/ns").digest()
SEALED = ("aaa", "bbb")
PLAIN = "ppp"


def key(tenant: str, i: int) -> bytes:
    return hashlib.sha256(f"faults/{i}".encode()).digest()  # equal across tenants


def layers(tenant: str, i: int) -> list[bytes]:
    r = random.Random(f"{tenant}/{i}")
    return [r.randbytes(r.randrange(100, 9000)) for _ in range(1 + i % 3)]


def kek(d: Path, name: str = "kek") -> Kek:
    return Kek(hashlib.sha256(f"faults/{name}".encode()).digest())


def config(d: Path, durability: str = "object", capacity: int | None = None) -> StoreConfig:
    return StoreConfig(
        root=d / "store",
        index_dir=d / "index",
        durability=durability,  # type: ignore[arg-type]
        capacity_bytes=capacity,
        batch_interval_s=0.05,
    )


def ack(tenant: str, i: int) -> None:
    print(f"ACK {tenant} {i}", flush=True)


def prefill(d: Path, n: int = 4) -> None:
    with Store(config(d), kek(d), create=True) as s:
        for t in SEALED:
            for i in range(n):
                s.put(t, NS, key(t, i), layers(t, i))
        for i in range(n):
            s.put(PLAIN, NS, key(PLAIN, i), layers(PLAIN, i), encrypt=False)


def main(op: str, d: Path, durability: str) -> None:
    if op == "save":
        with Store(config(d, durability), kek(d), create=True) as s:
            for i in range(4):
                if s.put("aaa", NS, key("aaa", i), layers("aaa", i), ttl_s=3600 if i % 2 else None):
                    ack("aaa", i)
                if s.put(PLAIN, NS, key(PLAIN, i), layers(PLAIN, i), encrypt=False):
                    ack(PLAIN, i)
            batch = [(key("bbb", i), layers("bbb", i)) for i in range(4, 8)]
            for i, ok in zip(range(4, 8), s.put_many("bbb", NS, batch), strict=True):
                if ok:
                    ack("bbb", i)
    elif op == "lease":
        with Store(config(d, durability), kek(d), create=True) as s:
            for i in range(4):
                ls = layers(PLAIN, i)
                lengths = [len(x) for x in ls]
                lease = s.lease_store(PLAIN, NS, key(PLAIN, i), lengths)
                assert lease is not None
                _, offsets = v1.plan_offsets(len(ls), lengths, False)
                with open(lease.tmp, "r+b") as f:
                    f.write(
                        v1.plain_header_block(
                            tenant=PLAIN,
                            namespace=NS,
                            chunk_key=key(PLAIN, i),
                            lengths=lengths,
                            checks=[v1.layer_check(x) for x in ls],
                        )
                    )
                    for off, x in zip(offsets, ls, strict=True):
                        f.seek(off)
                        f.write(x)
                if s.publish_lease(lease):
                    ack(PLAIN, i)
    elif op == "tenant":
        with Store(config(d, durability), kek(d), create=True) as s:
            for t in ("aaa", "bbb"):
                s.tenant_salt(t)  # creates the key file (and its audit record)
                s.put(t, NS, key(t, 0), layers(t, 0))
                ack(t, 0)
    elif op == "purge":
        with Store(config(d, durability), kek(d)) as s:
            s.purge_tenant("aaa", wait=True)
            print("DONE", flush=True)
    elif op == "rotate":
        with Store(config(d, durability), kek(d)) as s:
            s.rotate_kek(kek(d, "new"))
            print("DONE", flush=True)
    elif op == "evict":
        with Store(config(d, durability, capacity=96 << 10), kek(d), create=True) as s:
            for i in range(12):
                if s.put("aaa", NS, key("aaa", i), layers("aaa", i)):
                    ack("aaa", i)
    else:
        raise SystemExit(f"unknown op {op}")


def check_json(d: Path) -> dict[str, object]:
    """Open the store and read every prefilled chunk: what a restarted sidecar
    would serve. Run in a child process where a damaged index could crash it."""
    out: dict[str, object] = {"opened": False, "error": "", "wrong": [], "missing": []}
    try:
        s = Store(config(d), kek(d))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["opened"] = True
    wrong: list[str] = []
    missing: list[str] = []
    with s:
        for t in (*SEALED, PLAIN):
            for i in range(4):
                got = s.get(t, key(t, i))
                if got is None:
                    missing.append(f"{t}/{i}")
                elif got != layers(t, i):
                    wrong.append(f"{t}/{i}")
        s.fsck(repair=True)
    out["wrong"], out["missing"] = wrong, missing
    return out


if __name__ == "__main__" and sys.argv[1] == "check":
    import json

    print(json.dumps(check_json(Path(sys.argv[2]))))
    raise SystemExit(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
