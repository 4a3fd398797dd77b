"""Helpers shared by the tests (moved out of test_client_memory.py)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvoffload import protocol as p
from kvoffload.client import SidecarClient
from kvoffload.protocol import ErrorCode, StoreStatus
from kvoffload.staging import RegionAllocator, StagingBuffer
from kvoffload.transport import MemoryTransport, Transport, TransportError

NS = b"\x11" * 32


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeSidecar:
    """Fake sidecar for tests: protocol v1 over MemoryTransport, chunks in a dict."""

    def __init__(self, *, max_batch: int = p.MAX_BATCH, timeout_s: float = 5.0) -> None:
        self.chunks: dict[bytes, list[bytes]] = {}
        self.requests: list[p.Request] = []
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.down = False
        self.hang = False
        self.garbage = False
        self.bad_offsets = False
        self.bad_complete = False
        self.complete_in_order = True
        self.chunkwise = False  # announce §5.30 and send a chunk frame per chunk
        self.unsay = False  # then a reply that verifies none of them (a broken server)
        self.forbid_store = False
        self.refuse_version = False
        self.reject_no_space: set[bytes] = set()
        self.connects = 0
        self._conns: list[MemoryTransport] = []
        self._threads: list[threading.Thread] = []

    # The client's connect factory.
    def connect(self) -> Transport:
        self.connects += 1
        if self.down:
            raise TransportError("connection refused (fake sidecar is down)")
        client, server = MemoryTransport.pair(timeout_s=self.timeout_s)
        self._conns.append(server)
        t = threading.Thread(target=self._serve, args=(server,), daemon=True)
        t.start()
        self._threads.append(t)
        return client

    def kill_connections(self) -> None:
        for c in self._conns:
            c.close()
        self.join()

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=10)
            assert not t.is_alive()

    def of_type(self, cls: type[Any]) -> list[Any]:
        return [r for r in self.requests if isinstance(r, cls)]

    def _serve(self, t: MemoryTransport) -> None:
        staging: StagingBuffer | None = None
        alloc: RegionAllocator | None = None
        handles: dict[int, Any] = {}
        next_handle = 1
        try:
            while True:
                try:
                    frame = t.recv(timeout_s=30)
                except TransportError:
                    return
                rid, req = p.parse_request(frame.msg)
                self.requests.append(req)
                if self.hang and not isinstance(req, p.Hello | p.RegisterStaging):
                    continue
                if self.garbage and isinstance(req, p.Lookup):
                    t.send({"op": "lookup", "id": rid, "code": 0, "found": "many"})
                    continue
                reply: p.Reply
                if isinstance(req, p.Hello):
                    if self.refuse_version:
                        reply = p.ErrorReply("hello", ErrorCode.UNSUPPORTED_VERSION, "v9 only")
                    else:
                        reply = p.HelloReply(
                            1,
                            "fake-1",
                            "store-1",
                            {tn: SALT for tn in req.tenants},
                            max_batch=self.max_batch,
                            # One request after the other: in order (§5.29).
                            complete_in_order=self.complete_in_order,
                            chunkwise=self.chunkwise,
                        )
                elif isinstance(req, p.RegisterStaging):
                    assert len(frame.fds) == 1
                    staging = StagingBuffer.from_fd(frame.fds[0], req.size)
                    alloc = RegionAllocator(req.size)
                    reply = p.Ack(p.Op.REGISTER_STAGING)
                elif isinstance(req, p.Lookup):
                    n = 0
                    while n < len(req.keys) and req.keys[n] in self.chunks:
                        n += 1
                    reply = p.LookupReply(n)
                elif isinstance(req, p.Touch):
                    reply = p.Ack(p.Op.TOUCH)
                elif isinstance(req, p.Stats):
                    reply = p.StatsReply({"chunks": len(self.chunks)})
                elif isinstance(req, p.PrepareStore):
                    assert alloc is not None
                    if self.forbid_store:
                        reply = p.ErrorReply("prepare_store", ErrorCode.FORBIDDEN, "not yours")
                    else:
                        slots, held = [], []
                        for c in req.chunks:
                            size = p.packed_layout(c.layers)[1]
                            if c.key in self.chunks:
                                slots.append(p.StoreSlot(StoreStatus.EXISTS))
                            elif c.key in self.reject_no_space:
                                slots.append(
                                    p.StoreSlot(StoreStatus.REJECTED, code=ErrorCode.NO_SPACE)
                                )
                            elif (off := alloc.alloc(size)) is None:
                                slots.append(p.StoreSlot(StoreStatus.REJECTED, code=ErrorCode.BUSY))
                            else:
                                slots.append(p.StoreSlot(StoreStatus.WRITE, offset=off))
                                held.append((off, c))
                        h = 0
                        if held:
                            h, next_handle = next_handle, next_handle + 1
                            handles[h] = (req, slots, held)
                        reply = p.PrepareStoreReply(h, tuple(slots))
                elif isinstance(req, p.CompleteStore):
                    assert staging is not None and alloc is not None
                    _, slots, held = handles.pop(req.handle)
                    for off, c in held:
                        offs, _ = p.packed_layout(c.layers)
                        self.chunks[c.key] = [
                            bytes(staging.view[off + lo : off + lo + n])
                            for lo, n in zip(offs, c.layers, strict=True)
                        ]
                        alloc.free(off)
                    reply = p.CompleteStoreReply(
                        tuple(s.status is not StoreStatus.REJECTED for s in slots)
                    )
                elif isinstance(req, p.PrepareLoad):
                    assert staging is not None and alloc is not None
                    loaded: list[p.LoadSlot] = []
                    stop = ErrorCode.OK
                    for k in req.keys:
                        layers = self.chunks.get(k)
                        if layers is None:
                            stop = ErrorCode.NOT_FOUND
                            break
                        sizes = [len(x) for x in layers]
                        offs, size = p.packed_layout(sizes)
                        if size > staging.size:
                            stop = ErrorCode.TOO_LARGE
                            break
                        off = alloc.alloc(size)
                        if off is None:
                            stop = ErrorCode.BUSY
                            break
                        for lo, data in zip(offs, layers, strict=True):
                            staging.view[off + lo : off + lo + len(data)] = data
                        if self.bad_offsets:
                            off = staging.size  # points past the end of the buffer
                        loaded.append(p.LoadSlot(True, off, tuple(sizes)))
                        if self.chunkwise and req.chunkwise and len(loaded) < len(req.keys):
                            j = len(loaded) - 1
                            t.send(p.reply_message(rid, p.LoadProgress(0, j + 1, (loaded[j],), j)))
                    if self.unsay:
                        for slot in loaded:
                            alloc.free(slot.offset)
                        loaded, stop = [], ErrorCode.NOT_FOUND
                    pad = [p.LoadSlot(False)] * (len(req.keys) - len(loaded))
                    h = 0
                    if loaded:
                        h, next_handle = next_handle, next_handle + 1
                        handles[h] = loaded
                    reply = p.PrepareLoadReply(h, stop, tuple(loaded + pad))
                elif isinstance(req, p.CompleteLoad) and self.bad_complete:
                    reply = p.ErrorReply("complete_load", ErrorCode.BAD_HANDLE, "no such handle")
                elif isinstance(req, p.CompleteLoad):
                    assert alloc is not None
                    for slot in handles.pop(req.handle):
                        if slot.offset in alloc.allocations:
                            alloc.free(slot.offset)
                    reply = p.Ack(p.Op.COMPLETE_LOAD)
                elif isinstance(req, p.Abort):
                    handles.pop(req.handle)
                    reply = p.Ack(p.Op.ABORT)
                elif isinstance(req, p.Bye):
                    t.send(p.reply_message(rid, p.Ack(p.Op.BYE)))
                    return
                else:
                    reply = p.ErrorReply(req.OP.value, ErrorCode.UNSUPPORTED, "fake")
                try:
                    t.send(p.reply_message(rid, reply))
                except TransportError:
                    return  # the client left without reading it (a posted complete_load)
        finally:
            t.close()
            if staging is not None:
                staging.close()


def make_client(
    fake: FakeSidecar, clock: FakeClock, staging_bytes: int = 1 << 20, **kw: Any
) -> SidecarClient:
    return SidecarClient(
        "/nonexistent/fake.sock",
        "acme",
        staging_bytes=staging_bytes,
        connect=fake.connect,
        clock=clock,
        **kw,
    )


def layers_of(i: int, sizes: tuple[int, ...] = (5000, 1, 4096)) -> list[bytes]:
    rng = np.random.default_rng(i)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


SALT = bytes(range(32))
