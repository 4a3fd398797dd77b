"""A client process for the revocation tests (test_revocation.py): one connection, kept open.

Run as ``python revoke_proc.py session JSON`` (the parent starts it through
``sidecar_proc.Child(..., script=revoke_proc.HERE)``, possibly as another
uid). It says hello for one tenant, registers a staging buffer filled with a
sentinel byte, prints ``{"ready": ...}``, then obeys one JSON order a line on
stdin and answers each with one JSON line on stdout:

``{"op": "save", "seed", "indices"}`` → ``{"stored": [...]}``;
``{"op": "lookup", ...}`` → ``{"found": n}``;
``{"op": "fill"}`` → the whole staging buffer set to the sentinel again;
``{"op": "load", ...}`` → ``{"found": [bool], "stop", "handle"}`` (completed at once);
``{"op": "check"}`` → ``{"dirty": n}``: staging bytes that are not the sentinel;
``{"op": "prepare_store", ...}`` → ``{"handle", "statuses"}``;
``{"op": "lease_store", ...}`` → ``{"handle", "statuses", "paths"}`` (files written);
``{"op": "complete", "handle"}`` → ``{"code", "stored"}``; ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SENTINEL = 0xA5

sys.path.insert(0, str(HERE.parent))

from sidecar_proc import NS, _emit, _raw_caller, chunk_key, chunk_layers  # noqa: E402


def cmd_session(a: dict[str, Any]) -> None:
    from kvoffload import protocol as p
    from kvoffload.client import direct
    from kvoffload.layouts import v1
    from kvoffload.staging import StagingBuffer

    tenant = a["tenant"]
    call = _raw_caller(a["socket"])
    hello = call(p.Hello(1, 1, "revoke-client", (tenant,)))
    assert isinstance(hello, p.HelloReply), hello
    buf = StagingBuffer(a.get("staging", 4 << 20))
    assert call(p.RegisterStaging(buf.size), [buf.fd]) == p.Ack(p.Op.REGISTER_STAGING)

    def fill() -> None:
        buf.view[:] = bytes([SENTINEL]) * buf.size

    def specs(seed: str, idx: list[int]) -> tuple[p.ChunkSpec, ...]:
        return tuple(
            p.ChunkSpec(chunk_key(seed, i), tuple(len(x) for x in chunk_layers(tenant, seed, i)))
            for i in idx
        )

    def prepare(seed: str, idx: list[int]) -> p.Reply:
        prep = call(p.PrepareStore(tenant, NS, specs(seed, idx)))
        if isinstance(prep, p.PrepareStoreReply):
            for slot, i in zip(prep.chunks, idx, strict=True):
                if slot.status is p.StoreStatus.WRITE:
                    packed = b"".join(chunk_layers(tenant, seed, i))
                    buf.view[slot.offset : slot.offset + len(packed)] = packed
        return prep

    def complete(handle: int) -> dict[str, Any]:
        reply = call(p.CompleteStore(handle))
        if isinstance(reply, p.ErrorReply):
            return {"code": reply.code.name, "stored": None}
        assert isinstance(reply, p.CompleteStoreReply), reply
        return {"code": "OK", "stored": list(reply.stored)}

    fill()
    _emit({"ready": True, "salt_is_real": hello.salts.get(tenant) is not None})
    for line in sys.stdin:
        order = json.loads(line)
        op = order["op"]
        seed, idx = order.get("seed", ""), order.get("indices", [])
        if op == "save":
            prep = prepare(seed, idx)
            if isinstance(prep, p.ErrorReply):
                _emit({"code": prep.code.name})
            elif prep.handle == 0:
                _emit({"stored": [s.status is p.StoreStatus.EXISTS for s in prep.chunks]})
            else:
                _emit(complete(prep.handle))
        elif op == "lookup":
            reply = call(p.Lookup(tenant, tuple(chunk_key(seed, i) for i in idx)))
            assert isinstance(reply, p.LookupReply), reply
            _emit({"found": reply.found})
        elif op == "fill":
            fill()
            _emit({"filled": True})
        elif op == "check":
            sentinel = bytes([SENTINEL]) * buf.size
            view = bytes(buf.view)
            _emit({"dirty": sum(1 for x, y in zip(view, sentinel, strict=True) if x != y)})
        elif op == "load":
            reply = call(p.PrepareLoad(tenant, tuple(chunk_key(seed, i) for i in idx)))
            assert isinstance(reply, p.PrepareLoadReply), reply
            if reply.handle:
                call(p.CompleteLoad(reply.handle))
            _emit(
                {
                    "handle": reply.handle,
                    "stop": reply.stop.name,
                    "found": [s.verified for s in reply.chunks],
                }
            )
        elif op == "prepare_store":
            prep = prepare(seed, idx)
            if isinstance(prep, p.ErrorReply):
                _emit({"code": prep.code.name})
            else:
                assert isinstance(prep, p.PrepareStoreReply), prep
                _emit({"handle": prep.handle, "statuses": [s.status.value for s in prep.chunks]})
        elif op == "lease_store":
            sp = specs(seed, idx)
            lease = call(p.LeaseStore(tenant, NS, sp))
            if isinstance(lease, p.ErrorReply):
                _emit({"code": lease.code.name})
                continue
            assert isinstance(lease, p.LeaseStoreReply), lease
            io = direct.PosixDirectIO()
            for slot, spec, i in zip(lease.chunks, sp, idx, strict=True):
                if slot.status is not p.StoreStatus.WRITE:
                    continue
                layers = chunk_layers(tenant, seed, i)
                header = v1.plain_header_block(
                    tenant=tenant,
                    namespace=NS,
                    chunk_key=spec.key,
                    lengths=spec.layers,
                    checks=direct.checks_of(layers),
                )
                io.write_object(slot.path, header, layers, slot.offsets)
            _emit(
                {
                    "handle": lease.handle,
                    "statuses": [s.status.value for s in lease.chunks],
                    "paths": [s.path for s in lease.chunks],
                }
            )
        elif op == "complete":
            _emit(complete(order["handle"]))
        elif op == "exit":
            break
        else:
            raise ValueError(op)


def main() -> None:
    args = json.loads(sys.argv[2])
    if "as_user" in args:
        import kvoffload.client
        import kvoffload.client.direct
        import kvoffload.layouts.v1
        import kvoffload.staging  # noqa: F401 - everything is imported before the drop

        uid, gid = args["as_user"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        assert (os.getuid(), os.geteuid()) == (uid, uid)
    {"session": cmd_session}[sys.argv[1]](args)


if __name__ == "__main__":
    main()
