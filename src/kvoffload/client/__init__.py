"""The worker's client of the sidecar: lookup, save and load chunks through staging memory.

A cache must never take its user down with it. Every connection problem —
sidecar absent, restarting, hung, or speaking garbage — turns into the
answer for an empty cache: ``lookup`` 0, ``save`` all False, ``load`` all
misses, ``stats`` ``{}``; it is logged at warning level (rate-limited) and the
client reconnects on a later call, with exponential backoff so that a dead
sidecar costs one failed ``connect`` per backoff period, not one per call.
Only programming errors raise: bad arguments, a chunk that can never fit the
staging buffer, use after ``close()``, or an exception from the caller's own
``into`` callback.

Calls are serialized by a lock: each call starts with the whole staging
buffer free, which is what lets ``save`` and ``load`` size their batches.

With ``direct=True``, a tenant the sidecar offers the direct path for
(``hello``'s ``direct``: policy ``encryption = "none"``, ``direct = true``)
is saved and loaded without the staging buffer: the worker writes and reads
sidecar-leased layout-v1 files itself (:mod:`kvoffload.client.direct`, GDS from and
to GPU memory where the node has it). Results and failure handling are the
same as on the staging path; any other tenant, or a sidecar that does not
offer it, quietly uses staging.

With ``sealed_direct=True`` (and a sidecar that announces ``sealed_load``,
protocol revision 16), loads of any tenant are sealed direct reads
(:mod:`.sealed`): the sidecar hands each object's descriptor and the key of
that object alone, and this process verifies and decrypts it from the page
cache straight into the destination. Objects it cannot hand out that way
(sealed before per-object keys) load through staging, as do saves.

The package: :mod:`.session` (one connection, replies, ``fetch_stats``),
:mod:`.paths` (the save/load strategy interface), :mod:`.staged` (the staging
path), :mod:`.leased` (the lease/direct path), :mod:`.sealed` (sealed direct
reads), :mod:`.buffers` (layer views and argument checks); this module is the
never-raising facade.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ChunkTooLarge

from ..contract import validate_tenant
from ..protocol import (
    ALIGNMENT,
    KEY_SIZE,
    MAX_LAYERS,
    MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_REVISION,
    Ack,
    EngineBlocks,
    ErrorCode,
    ErrorReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    ProtocolError,
    RegisterStaging,
    Stats,
    StatsReply,
    Touch,
    region_size,
    request_message,
)
from ..staging import StagingBuffer
from ..transport import DEFAULT_TIMEOUT_S, Transport, UnixTransport
from . import direct as direct_io
from . import inplace, removal
from .buffers import (
    BufferLike,
    DestCallback,
    LayerCallback,
    LoadCallback,
    LoadedChunk,
    check_keys,
    copy_in,
)
from .direct import as_byte_view
from .leased import DIRECT_BATCH, LeasedPath
from .paths import TransferPath
from .sealed import SealedPath
from .session import (
    CONNECTION_ERRORS,
    RateLimitedLog,
    Session,
    _Unavailable,
    call_tenantless,
    expect,
    fetch_stats,
    log,
    read_reply,
)
from .staged import StagedPath

if TYPE_CHECKING:
    from ..contract import CompatContract

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "DEFAULT_STAGING_BYTES",
    "DIRECT_BATCH",
    "BufferLike",
    "ChunkTooLarge",
    "DestCallback",
    "LayerCallback",
    "LoadCallback",
    "LoadedChunk",
    "SidecarClient",
    "as_byte_view",
    "call_tenantless",
    "fetch_stats",
]

DEFAULT_SOCKET_PATH = "/run/kvoffload/kvoffload.sock"
#: Four chunks of 32 layers × 1 MiB.
DEFAULT_STAGING_BYTES = 128 << 20


class SidecarClient:
    """Client of one tenant's cache on the node's sidecar.

    ``connect`` replaces the Unix-socket connection (tests pass an in-memory
    transport); ``clock`` drives backoff and log rate limits.
    """

    #: Packs a chunk into staging; the staging path calls it through here, so
    #: a test may replace it on the class.
    _copy_in = staticmethod(copy_in)

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        tenant: str,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str | None = None,
        connect: Callable[[], Transport] | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        log_interval_s: float = 60.0,
        direct: bool = False,
        sealed_direct: bool = False,
    ) -> None:
        self._tenant = validate_tenant(tenant)
        if staging_bytes < ALIGNMENT:
            raise ValueError(f"staging_bytes must be at least {ALIGNMENT}")
        self._socket_path = os.fspath(socket_path)
        self._staging_bytes = -(-staging_bytes // ALIGNMENT) * ALIGNMENT
        self._timeout_s = timeout_s
        self._name = (name or f"kvoffload-client pid={os.getpid()}")[:128]
        self._connect = connect or self._connect_unix
        self._clock = clock
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._backoff_s = backoff_initial_s
        self._retry_at = float("-inf")
        self._warn = RateLimitedLog(log_interval_s, clock)
        self._rng = random.Random()
        self._lock = threading.RLock()
        self._session: Session | None = None
        #: How the current session moves bytes; chosen once per session.
        self._path: TransferPath | None = None
        self._staging: StagingBuffer | None = None
        self._closed = False
        self._salt: bytes | None = None
        self._direct = direct
        #: Loads as sealed direct reads where the sidecar offers them (§5.33).
        self._sealed_direct = sealed_direct
        #: Contracts of the namespaces this client derived keys for (§5.19).
        self._contracts: dict[bytes, dict[str, Any]] = {}
        #: Region files for in-place transfers (§5.34).
        self._regions = inplace.RegionTable()

    # -- public API ----------------------------------------------------------

    @property
    def tenant(self) -> str:
        return self._tenant

    @property
    def staging_bytes(self) -> int:
        """Capacity of the staging buffer: no chunk may pack to more than this."""
        return self._staging_bytes

    @property
    def staging(self) -> StagingBuffer | None:
        """The shared-memory staging buffer, once the first connection made it (it
        outlives reconnects); a worker may register it with its GPU driver."""
        return self._staging

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def salt(self) -> bytes | None:
        """The tenant's salt for ``chunk_keys``; connects if needed. None: sidecar unavailable.

        It can change after a reconnect to a different store; keys computed
        with an old salt then simply miss.
        """
        with self._lock:
            s = self._ensure_session()
            return s.salt if s is not None else None

    def chunk_keys(
        self,
        contract: CompatContract,
        tokens: Sequence[int] | Any,
        extra_keys: Sequence[Iterable[bytes]] | None = None,
    ) -> list[bytes]:
        """:func:`kvoffload.chunk_keys` under this tenant's salt; ``[]`` without a sidecar.

        The documented pattern (``keys = client.chunk_keys(...)``, then
        ``lookup``/``save``/``load`` of ``keys``) is therefore safe when the
        sidecar is down, restarting or refuses this peer: no keys is a miss
        for ``lookup`` and ``load`` and nothing for ``save``; the next call
        reconnects (with backoff) and gets keys again.
        """
        self.register_contract(contract)
        salt = self.salt
        if salt is None:
            return []
        from ..keys import chunk_keys

        return chunk_keys(contract, salt, tokens, extra_keys)

    def register_contract(self, contract: CompatContract) -> bytes:
        """Let the sidecar record ``contract``'s fields for its namespace (protocol-v1
        §5.19), so that ``kvoffload invalidate`` can find the namespace by model
        revision, tokenizer or chat template. Sent with the first save of the
        namespace on each connection; ``chunk_keys`` calls this. Returns the
        namespace (the contract's fingerprint)."""
        ns = contract.fingerprint()
        with self._lock:
            if ns not in self._contracts:
                self._contracts[ns] = contract.to_dict()
        return ns

    @property
    def server_info(self) -> HelloReply | None:
        s = self._session
        return s.hello if s is not None else None

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the sidecar holds (advisory: a load may still miss)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return 0
            total = 0
            try:
                for i in range(0, len(keys), s.hello.max_batch):
                    batch = keys[i : i + s.hello.max_batch]
                    reply = s.call(Lookup(self._tenant, tuple(batch)))
                    if isinstance(reply, ErrorReply):
                        s.on_error_reply(reply)
                        break
                    found = expect(reply, LookupReply).found
                    if found > len(batch):
                        raise ProtocolError(ErrorCode.BAD_REQUEST, "lookup found > keys asked")
                    total += found
                    if found < len(batch):
                        break
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
            return total

    def lookup_load(
        self, keys: Sequence[bytes], into: LoadCallback | None = None
    ) -> tuple[int, list[LoadedChunk]]:
        """What :meth:`lookup` and then :meth:`load` of ``keys`` give, in one round
        trip per batch where the sidecar serves ``lookup_load`` (protocol
        revision 15, §5.32) and saves take the staging path; else the two calls.

        The count is advisory as :meth:`lookup`'s (counted up to the first batch
        not wholly loaded); the ``ok`` chunks form a prefix of ``keys``.
        """
        keys = check_keys(keys)
        results = [LoadedChunk(k, False) for k in keys]
        if not keys:
            return 0, results
        with self._lock:
            s, path = self._ensure_path()
            if s is None or path is None:
                return 0, results
            if isinstance(path, StagedPath) and s.hello.lookup_load:
                try:
                    return path.lookup_load(s, keys, results, into), results
                except CONNECTION_ERRORS as exc:
                    s.lose(exc)
                    return sum(r.ok for r in results), results
        found = self.lookup(keys)
        return found, self.load(keys[:found], into) + results[found:]

    def uses_direct(self) -> bool:
        """Whether saves and loads take the direct path now (connects if needed)."""
        with self._lock:
            s = self._ensure_session()
            return s is not None and isinstance(self._path, LeasedPath)

    def uses_sealed_direct(self) -> bool:
        """Whether loads are sealed direct reads now (connects if needed): asked for,
        and the sidecar announces ``sealed_load`` (protocol-v1.md §5.33)."""
        with self._lock:
            s, path = self._ensure_path()
            return s is not None and isinstance(path, SealedPath)

    def save(
        self,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, Sequence[BufferLike]]],
        *,
        ttl_s: float | None = None,
        blocks: Sequence[EngineBlocks | None] | None = None,
    ) -> list[bool]:
        """Store chunks; True for each stored (or already present), False otherwise.

        ``blocks``, one per chunk (or None), are the engine's block hashes of
        each chunk (protocol-v1 §5.4): the sidecar keeps them and publishes
        the chunk on its KV-event feed. Never token ids.

        Layers are host buffers (or CPU tensors); with ``direct=True`` they may
        also be GPU tensors, which the staging path copies to the host first.
        Raises :class:`ChunkTooLarge` for a chunk that packs to more than
        :attr:`staging_bytes`, before anything is sent (not with ``direct``,
        which needs no staging; such a chunk is not saved if the direct path
        turns out to be unavailable).
        """
        if not isinstance(namespace, bytes) or len(namespace) != KEY_SIZE:
            raise ValueError(f"namespace must be a {KEY_SIZE}-byte fingerprint")
        keys = check_keys([k for k, _ in chunks])
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key in one save")
        if blocks is not None and len(blocks) != len(keys):
            raise ValueError("blocks: one entry (or None) per chunk expected")
        srcs: list[list[Any]] = []
        for i, (_, layers) in enumerate(chunks):
            if not 1 <= len(layers) <= MAX_LAYERS:
                raise ValueError(f"chunk {i}: 1..{MAX_LAYERS} layers expected, got {len(layers)}")
            lv = [b if direct_io.is_device(b) else as_byte_view(b) for b in layers]
            sizes = [direct_io.nbytes(v) for v in lv]
            if any(n == 0 for n in sizes):
                raise ValueError(f"chunk {i}: empty layer")
            packed = region_size(sizes)
            if packed > self._staging_bytes and not self._direct:
                raise ChunkTooLarge(
                    f"chunk {i} needs {packed} bytes of staging, the buffer holds "
                    f"{self._staging_bytes}: raise staging_bytes"
                )
            srcs.append(lv)
        results = [False] * len(keys)
        if not keys:
            return results
        with self._lock:
            s, path = self._ensure_path()
            if s is None or path is None:
                return results
            try:
                path.save(
                    s, namespace, keys, srcs, ttl_s, results, list(blocks) if blocks else None
                )
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
            return results

    def register_region(self, fd: int, size: int) -> int:
        """Keep a file of this process (a duplicate of ``fd``: a regular file, owned
        by this uid, open read-write, at least ``size`` bytes, ``size`` a multiple of
        4096) for in-place transfers (protocol-v1 §5.34); its id for
        :meth:`save_in_place` and :meth:`load_in_place`. Registered with the
        sidecar on each connection's first use; never mapped by the sidecar."""
        with self._lock:
            return self._regions.add(fd, size)

    def save_in_place(
        self,
        namespace: bytes,
        chunks: Sequence[tuple[bytes, inplace.Span]],
        *,
        ttl_s: float | None = None,
        blocks: Sequence[EngineBlocks | None] | None = None,
    ) -> list[bool] | None:
        """Store chunks whose packed layers lie in a registered region, at
        ``(region, offset, layer sizes)``: the sidecar reads them from the file
        itself. True per stored chunk; None where the sidecar cannot (older than
        revision 17, region refused): then :meth:`save` them through staging."""
        keys = check_keys([k for k, _ in chunks])
        if blocks is not None and len(blocks) != len(keys):
            raise ValueError("blocks: one entry (or None) per chunk expected")
        return self._in_place(
            keys,
            lambda s, ids: inplace.save(
                s, ids, namespace, keys, [c[1] for c in chunks], ttl_s, blocks
            ),
        )

    def load_in_place(
        self, keys: Sequence[bytes], spans: Sequence[inplace.Span]
    ) -> list[bool] | None:
        """Load chunks straight into registered regions, each verified by the sidecar
        before any byte of it is written; True per loaded key (a prefix). None where
        the sidecar cannot (then :meth:`load_to` them through staging)."""
        keys = check_keys(keys)
        if len(spans) != len(keys):
            raise ValueError("one span per key expected")
        return self._in_place(keys, lambda s, ids: inplace.load(s, ids, keys, spans))

    def _in_place(
        self, keys: list[bytes], run: Callable[[Session, dict[int, int]], list[bool] | None]
    ) -> list[bool] | None:
        if not keys:
            return []
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return [False] * len(keys)
            try:
                ids = self._regions.server_ids(s)
                return None if ids is None else run(s, ids)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
                return [False] * len(keys)

    def load(self, keys: Sequence[bytes], into: LoadCallback | None = None) -> list[LoadedChunk]:
        """Load chunks; the ``ok`` ones form a prefix of ``keys``.

        Without ``into``, each loaded chunk's layers are copied out of staging
        into fresh memory. With ``into``, ``into(index, key, layers)`` is
        called for each loaded chunk with read-only views of the staging
        buffer, valid only during the call (they are released afterwards), and
        the returned chunks carry no layers. An exception from ``into``
        propagates after the server was told the loads are complete.
        """
        return self._load(check_keys(keys), into, None)

    def load_layerwise(self, keys: Sequence[bytes], on_layer: LayerCallback) -> list[LoadedChunk]:
        """Load chunks layer by layer; the ``ok`` ones form a prefix of ``keys``.

        ``on_layer(layer, first, views)`` is called as layers are verified:
        ``views[j]`` is layer ``layer`` of chunk ``first + j``, a read-only view
        of staging valid only during the call. Within one batch of chunks the
        layers come in order, every byte checked before its call; where the
        chunks have different layer counts, layer ``layer`` comes in one call
        per run of consecutive chunks that have it. A chunk is ``ok`` only once
        every one of its layers was handed out; a chunk whose later layer
        fails is not ``ok`` even though its earlier layers were handed out
        (the caller must not use them as a loaded chunk). A
        sidecar without layer-wise loads (revision 9), or the direct path,
        hands out each chunk's layers after the whole chunk verified.
        """
        keys = check_keys(keys)
        results = [LoadedChunk(k, False) for k in keys]
        if not keys:
            return results

        def into(idx: int, _key: bytes, layers: Sequence[memoryview]) -> None:
            for layer, view in enumerate(layers):
                on_layer(layer, idx, [view])

        with self._lock:
            s, path = self._ensure_path()
            if s is None or path is None:
                return results
            try:
                if isinstance(path, StagedPath) and s.hello.layerwise:
                    path.load_layerwise(s, keys, results, on_layer)
                else:
                    path.load(s, keys, results, into, None)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
            return results

    def load_to(self, keys: Sequence[bytes], dest_for: DestCallback) -> list[bool]:
        """Load chunks straight into destinations the caller names; True per loaded key.

        ``dest_for(index, key, layer_sizes)`` returns one writable buffer (or
        GPU tensor) per layer. On the direct path the layers are read into
        them (GDS for GPU tensors where the node has it); on the staging path
        they are copied from staging. The True entries form a prefix of
        ``keys``; a destination of a key that is not loaded may hold garbage.
        """
        return [r.ok for r in self._load(check_keys(keys), None, dest_for)]

    def _load(
        self, keys: list[bytes], into: LoadCallback | None, dest_for: DestCallback | None
    ) -> list[LoadedChunk]:
        results = [LoadedChunk(k, False) for k in keys]
        if not keys:
            return results
        with self._lock:
            s, path = self._ensure_path()
            if s is None or path is None:
                return results
            try:
                path.load(s, keys, results, into, dest_for)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
            return results

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark chunks recently used. Best effort: failures are only logged."""
        keys = check_keys(keys)
        if not keys:
            return
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return
            try:
                for i in range(0, len(keys), s.hello.max_batch):
                    reply = s.call(Touch(self._tenant, tuple(keys[i : i + s.hello.max_batch])))
                    if isinstance(reply, ErrorReply):
                        s.on_error_reply(reply)
                        return
                    expect(reply, Ack)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)

    def delete(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Remove chunks of the tenant (protocol-v1 §5.35): per key, whether the sidecar
        held it; None where it cannot (older than revision 18, unavailable, refused)."""
        keys = check_keys(keys)
        with self._lock:
            s = self._ensure_session() if keys else None
            if s is None:
                return None if keys else []
            try:
                return removal.delete(s, self._tenant, keys)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
                return None

    def stats(self) -> dict[str, Any]:
        """The sidecar's statistics, or ``{}`` when it is unavailable."""
        with self._lock:
            s = self._ensure_session()
            if s is None:
                return {}
            try:
                reply = s.call(Stats())
                if isinstance(reply, ErrorReply):
                    s.on_error_reply(reply)
                    return {}
                return dict(expect(reply, StatsReply).stats)
            except CONNECTION_ERRORS as exc:
                s.lose(exc)
                return {}

    def close(self) -> None:
        """Say bye, disconnect and unmap the staging buffer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            s, self._session, self._path = self._session, None, None
            if s is not None:
                s.close()
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            self._regions.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connection ----------------------------------------------------------

    def _connect_unix(self) -> Transport:
        return UnixTransport.connect(self._socket_path, timeout_s=self._timeout_s)

    def _ensure_path(self) -> tuple[Session | None, TransferPath | None]:
        s = self._ensure_session()
        return s, self._path if s is not None else None

    def _ensure_session(self) -> Session | None:
        if self._closed:
            raise RuntimeError("SidecarClient is closed")
        if self._session is not None:
            return self._session
        if self._clock() < self._retry_at:
            return None
        transport: Transport | None = None
        try:
            transport = self._connect()
            session = self._handshake(transport)
        except CONNECTION_ERRORS as exc:
            if transport is not None:
                transport.close()
            self._failed(f"kvoffload sidecar at {self._socket_path} unavailable: {exc}")
            return None
        if self._salt is not None and session.salt != self._salt:
            log.info(
                "tenant %s: salt changed (different store?); cached keys will miss", self._tenant
            )
        self._salt = session.salt
        self._session = session
        self._path = self._choose_path(session)
        self._backoff_s = self._backoff_initial_s
        log.info(
            "connected to kvoffload sidecar %s (store %s, protocol %d)",
            session.hello.server_id,
            session.hello.store_id,
            session.hello.version,
        )
        return session

    def _choose_path(self, s: Session) -> TransferPath:
        """The direct path if asked for and offered for the tenant, else staging."""
        if self._direct and bool(s.hello.direct.get(self._tenant, False)):
            return LeasedPath()
        staging = self._staging
        assert staging is not None  # a session implies a registered buffer
        # Late-bound, so that replacing SidecarClient._copy_in takes effect.
        copy = lambda st, off, layers: self._copy_in(st, off, layers)  # noqa: E731
        if self._sealed_direct and s.hello.sealed_load:
            return SealedPath(staging, copy)
        return StagedPath(staging, copy)

    def _handshake(self, transport: Transport) -> Session:
        hello_req = Hello(
            MIN_PROTOCOL_VERSION,
            MAX_PROTOCOL_VERSION,
            self._name,
            (self._tenant,),
            revision=PROTOCOL_REVISION,
        )
        transport.send(request_message(1, hello_req))
        _, reply = read_reply(transport, 1, hello_req)
        if isinstance(reply, ErrorReply):
            raise _Unavailable(f"hello refused: {reply.code.name}: {reply.message}")
        hello = expect(reply, HelloReply)
        if not MIN_PROTOCOL_VERSION <= hello.version <= MAX_PROTOCOL_VERSION:
            raise _Unavailable(f"server chose protocol version {hello.version}, not offered")
        salt = hello.salts.get(self._tenant)
        if salt is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "hello reply lacks the tenant's salt")
        if self._staging is None:
            size = min(self._staging_bytes, hello.max_staging // ALIGNMENT * ALIGNMENT)
            self._staging = StagingBuffer(size, name=f"kvoffload-staging-{self._tenant}")
        elif self._staging.size > hello.max_staging:
            raise _Unavailable(
                f"staging buffer of {self._staging.size} bytes exceeds the server's "
                f"limit of {hello.max_staging}"
            )
        self._staging_bytes = self._staging.size
        session = Session(
            transport,
            hello,
            salt,
            self._tenant,
            self._warn,
            self._on_lost,
            next_id=2,
            contracts=self._contracts,
        )
        reply = session.call(RegisterStaging(self._staging.size), fds=[self._staging.fd])
        if isinstance(reply, ErrorReply):
            raise _Unavailable(f"staging registration refused: {reply.code.name}: {reply.message}")
        expect(reply, Ack)
        return session

    def _failed(self, msg: str) -> None:
        # Jitter spreads the reconnects of every worker on a node after a
        # sidecar restart.
        self._retry_at = self._clock() + self._backoff_s * self._rng.uniform(0.5, 1.0)
        self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
        self._warn(logging.WARNING, "connection", msg)

    def _on_lost(self, session: Session, exc: BaseException) -> None:
        """``Session.lose``'s callback: forget the session and back off."""
        if self._session is session:
            self._session = None
            self._path = None
        self._failed(f"lost the kvoffload sidecar connection: {exc}")
