"""Layout v1: the byte format of one object, its path, and sealing/opening.

``docs/spec/layout-v1.md`` is normative; this module implements it. An object is
one chunk (N tokens × all layers of one shard). All integers little-endian::

    0    8  magic "KVOFFOBJ"
    8    2  layout version (1)
    10   2  flags (bit 0: SEALED = AES-256-GCM; bit 1: OBJECT_KEY, objkey.py; others 0)
    12   4  header_length (bytes, including the trailing checksum)
    16   4  data_offset (first layer; multiple of 4096)
    20   4  num_layers (1..65535)
    24   4  key_epoch (0 when not sealed)
    28   2  tenant_len (1..64)
    30   2  reserved (0)
    32   8  created (unix ns)
    40  32  chunk key
    72  32  namespace fingerprint
    104 64  tenant id (UTF-8, zero padded)
    168  8  reserved (0)
    176 48×num_layers  layer table: u64 offset, u64 length, 12 nonce, 16 check, 4 reserved
    ... 16  header checksum: XXH3-128 of bytes [0, header_length-16)

Layer ``i`` starts at ``offset[i]`` (4096-aligned, packed in order) and holds
``length[i]`` bytes of ciphertext followed by the 16-byte GCM tag when SEALED
(``check`` repeats the tag), or the plaintext when not (``check`` is
XXH3-128 of it). Every byte between regions and up to the file end (a
multiple of 4096) is zero, and readers check it, so no byte of an object can
change unnoticed.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from ..errors import CorruptObject, ObjectMismatch, UnknownKeyEpoch, UnknownLayoutVersion

VERSION = 1
MAGIC = b"KVOFFOBJ"
ALIGN = 4096
FLAG_SEALED = 0x1
#: Sealed under the object's own key (layout-v1.md §3.3, :mod:`.objkey`), not the DEK.
FLAG_OBJECT_KEY = 0x2
KNOWN_FLAGS = FLAG_SEALED | FLAG_OBJECT_KEY
TAG_SIZE = 16
NONCE_SIZE = 12
KEY_SIZE = 32
MAX_LAYERS = 0xFFFF
MAX_TENANT = 64
OBJECT_SUFFIX = ".kvo"
TMP_PREFIX = ".tmp-"
#: ``objects/.purged-<tenant>-<16 hex>``: a purged tenant's tree, moved aside in
#: one rename and being removed (layout-v1.md §2); never read as objects.
PURGED_PREFIX = ".purged-"

_FIXED = struct.Struct("<8sHHIIIIHHQ32s32s64s8x")
_LAYER = struct.Struct("<QQ12s16s4x")
# The same records read with their reserved bytes, which readers check are zero.
_FIXED_READ = struct.Struct("<8sHHIIIIHHQ32s32s64s8s")
_LAYER_READ = struct.Struct("<QQ12s16s4s")
_ZERO4, _ZERO8, _ZERO_NONCE = bytes(4), bytes(8), bytes(12)
_CHECK_SIZE = 16
_AAD = struct.Struct("<8sHHIIIQ32s32sH")
assert _FIXED.size == 176 and _LAYER.size == 48


class Aead(Protocol):
    """What sealing needs of an AEAD (``cryptography``'s AESGCM fits)."""

    def encrypt_into(
        self, nonce: bytes, data: Any, associated_data: bytes | None, buf: Any
    ) -> int: ...

    def decrypt_into(
        self, nonce: bytes, data: Any, associated_data: bytes | None, buf: Any
    ) -> int: ...


#: The AEAD of an object sealed under its own key (FLAG_OBJECT_KEY), or None (purged).
ObjectAead = Callable[["ObjectHeader"], Aead | None]


#: Fan-out of ``objects/<tenant>/``: hex digits of the chunk key per directory
#: level (layout-v1.md §2, ``params.fanout``). Stores created before the
#: parameter was read have ``[2, 2]`` (65,536 leaves per tenant); new stores get
#: ``[2]`` (256 leaves): a fresh leaf costs a mkdir and, at durability object,
#: an fsync of its parent, more than a small object's own write.
FANOUT_TWO_LEVELS: tuple[int, ...] = (2, 2)
FANOUT_ONE_LEVEL: tuple[int, ...] = (2,)
DEFAULT_FANOUT = FANOUT_ONE_LEVEL
#: The values this build reads; any other is refused at open.
FANOUTS = frozenset({FANOUT_TWO_LEVELS, FANOUT_ONE_LEVEL})


def parse_fanout(value: Any) -> tuple[int, ...]:
    """``params.fanout`` of a ``layout.json`` (absent: the two-level fan-out of the
    first stores). ValueError for a value this build does not know."""
    if value is None:
        return FANOUT_TWO_LEVELS
    if isinstance(value, list) and all(type(x) is int for x in value):
        fanout = tuple(value)
        if fanout in FANOUTS:
            return fanout
    known = " or ".join(str(list(f)) for f in sorted(FANOUTS))
    raise ValueError(f"fanout {value!r} is not one this build reads ({known})")


def default_params() -> dict[str, Any]:
    return {
        "fanout": list(DEFAULT_FANOUT),
        "alignment": ALIGN,
        "object_suffix": OBJECT_SUFFIX,
        "chunk_key": "blake2b-256 keyed by tenant salt",
        "aead": "AES-256-GCM",
        "checksum": "xxh3-128",
    }


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def header_length(num_layers: int) -> int:
    return _FIXED.size + _LAYER.size * num_layers + _CHECK_SIZE


def object_relpath(tenant: str, chunk_key: bytes, fanout: tuple[int, ...] = DEFAULT_FANOUT) -> str:
    """Path of an object below the store root: a pure function of (tenant, key)
    and the store's ``fanout``."""
    h = chunk_key.hex()
    if fanout == FANOUT_ONE_LEVEL:
        return f"objects/{tenant}/{h[0:2]}/{h}{OBJECT_SUFFIX}"
    if fanout == FANOUT_TWO_LEVELS:
        return f"objects/{tenant}/{h[0:2]}/{h[2:4]}/{h}{OBJECT_SUFFIX}"
    raise ValueError(f"unknown fanout {fanout!r}")


def tmp_name() -> str:
    """A temp-file name unique per writer (random + pid); create it with O_EXCL."""
    return f"{TMP_PREFIX}{os.urandom(8).hex()}-{os.getpid()}"


@dataclass(frozen=True)
class LayerEntry:
    offset: int
    length: int
    nonce: bytes
    check: bytes


@dataclass(frozen=True)
class ObjectHeader:
    version: int
    flags: int
    key_epoch: int
    created_ns: int
    chunk_key: bytes
    namespace: bytes
    tenant: str
    data_offset: int
    layers: tuple[LayerEntry, ...]

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    # Computed once per header (a frozen dataclass's cached_property writes to
    # the instance dict, not through __setattr__): every read asks for both.
    @functools.cached_property
    def payload_size(self) -> int:
        """Plaintext bytes: the sum of the layer lengths."""
        return sum(le.length for le in self.layers)

    @functools.cached_property
    def total_size(self) -> int:
        return total_size(self.data_offset, [le.length for le in self.layers], self.sealed)


def plan_offsets(num_layers: int, lengths: Sequence[int], sealed: bool) -> tuple[int, list[int]]:
    """(data_offset, per-layer offsets): the only valid placement of the layers."""
    data_offset = align_up(header_length(num_layers))
    offsets = []
    pos = data_offset
    for n in lengths:
        offsets.append(pos)
        pos = align_up(pos + n + (TAG_SIZE if sealed else 0))
    return data_offset, offsets


def total_size(data_offset: int, lengths: Sequence[int], sealed: bool) -> int:
    pos = data_offset
    for n in lengths:
        pos = align_up(pos + n + (TAG_SIZE if sealed else 0))
    return pos


def object_size(lengths: Sequence[int], sealed: bool) -> int:
    """File size of an object with these layer lengths."""
    return total_size(align_up(header_length(len(lengths))), lengths, sealed)


#: Section 3.2: an object may exceed its payload by at most the payload plus this.
MAX_OVERHEAD_BYTES = 1 << 20


def shape_ok(lengths: Sequence[int], sealed: bool) -> bool:
    """Whether a chunk of these layer lengths may be stored (section 3.2): its
    object is at most ``2 × payload + MAX_OVERHEAD_BYTES`` bytes, which bounds
    what header and 4 KiB padding can add (65,535 one-byte layers would put
    256 MiB on disk for 64 KiB)."""
    if not 1 <= len(lengths) <= MAX_LAYERS:
        return False
    return object_size(lengths, sealed) <= 2 * sum(lengths) + MAX_OVERHEAD_BYTES


def _tenant_bytes(tenant: str) -> bytes:
    b = tenant.encode("utf-8")
    if not 1 <= len(b) <= MAX_TENANT:
        raise ValueError(f"tenant id must be 1..{MAX_TENANT} bytes")
    return b


def encode_header(h: ObjectHeader) -> bytes:
    t = _tenant_bytes(h.tenant)
    n = len(h.layers)
    hl = header_length(n)
    parts = [
        _FIXED.pack(
            MAGIC,
            h.version,
            h.flags,
            hl,
            h.data_offset,
            n,
            h.key_epoch,
            len(t),
            0,
            h.created_ns,
            h.chunk_key,
            h.namespace,
            t,
        )
    ]
    for le in h.layers:
        parts.append(_LAYER.pack(le.offset, le.length, le.nonce, le.check))
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


def peek_version(buf: bytes | memoryview) -> int:
    if len(buf) < 10 or bytes(buf[0:8]) != MAGIC:
        raise CorruptObject("not a kvoffload object (bad magic)")
    return int(struct.unpack_from("<H", buf, 8)[0])


#: Largest header_length any version may declare (v1's with 65,535 layers).
MAX_HEADER_LENGTH = _FIXED.size + _LAYER.size * MAX_LAYERS + _CHECK_SIZE


def check_header_checksum(buf: bytes | memoryview) -> None:
    """The version-independent header check (section 5): ``header_length`` (u32 at
    offset 12) is sane and the header's last 16 bytes are the XXH3-128 of the
    bytes before them. Every layout version keeps magic, version, header_length
    and this trailing checksum where v1 has them."""
    mv = memoryview(buf)
    if len(mv) < 16:
        raise CorruptObject("truncated header")
    (hl,) = struct.unpack_from("<I", mv, 12)
    if not _FIXED.size + _CHECK_SIZE <= hl <= MAX_HEADER_LENGTH:
        raise CorruptObject(f"header length {hl} out of range")
    if len(mv) < hl:
        raise CorruptObject("truncated header")
    if xxhash.xxh3_128_digest(mv[: hl - _CHECK_SIZE]) != bytes(mv[hl - _CHECK_SIZE : hl]):
        raise CorruptObject("header checksum mismatch")


def decode_header(buf: bytes | memoryview) -> ObjectHeader:
    """Parse and check a header; refuses unknown versions and any inconsistency."""
    mv = memoryview(buf)
    # Section 5's reading order: magic, then the header checksum, and only then
    # the version. A flipped bit in the version field is corruption, never a
    # "newer" object that this reader would have to leave in place.
    version = peek_version(mv)
    check_header_checksum(mv)  # the one XXH3 of the header: nothing below rereads it
    if version != VERSION:
        raise UnknownLayoutVersion(version, (VERSION, VERSION), "object header")
    if len(mv) < _FIXED.size:
        raise CorruptObject("truncated header")
    (
        _magic,
        _ver,
        flags,
        hl,
        data_offset,
        n,
        epoch,
        tlen,
        reserved,
        created,
        key,
        ns,
        tenant_raw,
        reserved_tail,
    ) = _FIXED_READ.unpack_from(mv, 0)
    if not 1 <= n <= MAX_LAYERS or hl != header_length(n):
        raise CorruptObject("bad layer count or header length")
    if flags & ~KNOWN_FLAGS or reserved or reserved_tail != _ZERO8:
        raise CorruptObject("unknown flags or non-zero reserved field")
    if not 1 <= tlen <= MAX_TENANT or tenant_raw[tlen:] != bytes(MAX_TENANT - tlen):
        raise CorruptObject("bad tenant field")
    sealed = bool(flags & FLAG_SEALED)
    if not sealed and (epoch != 0 or flags & FLAG_OBJECT_KEY):
        raise CorruptObject("plaintext object with a key epoch or an object key")
    layers = []
    for off, length, nonce, check, rsv in _LAYER_READ.iter_unpack(
        mv[_FIXED.size : hl - _CHECK_SIZE]
    ):
        if rsv != _ZERO4:
            raise CorruptObject("non-zero reserved field in layer table")
        if not sealed and nonce != _ZERO_NONCE:
            raise CorruptObject("plaintext layer with a nonce")
        layers.append(LayerEntry(off, length, nonce, check))
    expect_do, expect_offs = plan_offsets(n, [le.length for le in layers], sealed)
    if data_offset != expect_do or [le.offset for le in layers] != expect_offs:
        raise CorruptObject("layer offsets do not follow the v1 placement rule")
    try:
        tenant = tenant_raw[:tlen].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptObject("tenant id is not UTF-8") from exc
    return ObjectHeader(
        version=version,
        flags=flags,
        key_epoch=epoch,
        created_ns=created,
        chunk_key=key,
        namespace=ns,
        tenant=tenant,
        data_offset=data_offset,
        layers=tuple(layers),
    )


def layer_aad(h: ObjectHeader, index: int) -> bytes:
    """Associated data of layer ``index``: binds it to its object, place and owner."""
    t = _tenant_bytes(h.tenant)
    return (
        _AAD.pack(
            b"KVOFFAAD",
            h.version,
            h.flags,
            h.key_epoch,
            len(h.layers),
            index,
            h.layers[index].length,
            h.chunk_key,
            h.namespace,
            len(t),
        )
        + t
    )


def _zero(mv: memoryview, start: int, end: int) -> None:
    if end > start:
        mv[start:end] = bytes(end - start)


def seal_into(
    out: memoryview,
    *,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    layers: Sequence[memoryview | bytes | bytearray],
    aead: Aead | None,
    key_epoch: int = 0,
    created_ns: int = 0,
    nonce_source: Callable[[int], bytes] = os.urandom,
    object_aead: ObjectAead | None = None,
) -> int:
    """Build a complete object in ``out``; returns its size. ``aead=None``: plaintext.

    ``out`` must hold :func:`object_size` bytes. Ciphertext is written straight
    into ``out`` (``encrypt_into``), so sealing costs no extra copy. ``object_aead``
    (``aead`` not None): sealed under the object's own key (FLAG_OBJECT_KEY, §3.3).
    """
    if len(chunk_key) != KEY_SIZE or len(namespace) != KEY_SIZE:
        raise ValueError("chunk key and namespace fingerprint must be 32 bytes")
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"an object holds 1..{MAX_LAYERS} layers")
    sealed = aead is not None
    if not sealed and key_epoch:
        raise ValueError("a plaintext object has no key epoch")
    lengths = [len(memoryview(x).cast("B")) for x in layers]
    data_offset, offsets = plan_offsets(len(layers), lengths, sealed)
    size = total_size(data_offset, lengths, sealed)
    if len(out) < size:
        raise ValueError(f"output buffer too small: {len(out)} < {size}")
    flags = (FLAG_SEALED | (FLAG_OBJECT_KEY if object_aead is not None else 0)) if sealed else 0
    entries: list[LayerEntry] = []
    proto = ObjectHeader(
        VERSION,
        flags,
        key_epoch,
        created_ns,
        chunk_key,
        namespace,
        tenant,
        data_offset,
        tuple(LayerEntry(o, n, b"", b"") for o, n in zip(offsets, lengths, strict=True)),
    )
    if sealed and object_aead is not None:
        aead = object_aead(proto)
    for i, (src, off, n) in enumerate(zip(layers, offsets, lengths, strict=True)):
        data = memoryview(src).cast("B")
        if sealed:
            assert aead is not None
            nonce = nonce_source(NONCE_SIZE)
            aead.encrypt_into(nonce, data, layer_aad(proto, i), out[off : off + n + TAG_SIZE])
            check = bytes(out[off + n : off + n + TAG_SIZE])
            end = off + n + TAG_SIZE
        else:
            nonce = bytes(NONCE_SIZE)
            out[off : off + n] = data
            check = xxhash.xxh3_128_digest(data)
            end = off + n
        nxt = offsets[i + 1] if i + 1 < len(offsets) else size
        _zero(out, end, nxt)
        entries.append(LayerEntry(off, n, nonce, check))
    header = encode_header(
        ObjectHeader(
            VERSION,
            flags,
            key_epoch,
            created_ns,
            chunk_key,
            namespace,
            tenant,
            data_offset,
            tuple(entries),
        )
    )
    out[: len(header)] = header
    _zero(out, len(header), data_offset)
    return size


def plain_header_block(
    *,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    lengths: Sequence[int],
    checks: Sequence[bytes],
    created_ns: int = 0,
) -> bytes:
    """The first ``data_offset`` bytes of a plaintext object: header, then zeros.

    For writers that place the layers themselves (the direct path, section 4.1
    of the spec): they write this block at offset 0, each layer ``i`` at
    ``plan_offsets(...)[1][i]``, and leave every other byte zero. ``checks``
    are the layers' XXH3-128 digests (:func:`layer_check`).
    """
    if len(chunk_key) != KEY_SIZE or len(namespace) != KEY_SIZE:
        raise ValueError("chunk key and namespace fingerprint must be 32 bytes")
    if not 1 <= len(lengths) <= MAX_LAYERS or len(checks) != len(lengths):
        raise ValueError(f"an object holds 1..{MAX_LAYERS} layers, one check each")
    if any(n < 0 for n in lengths) or any(len(c) != _CHECK_SIZE for c in checks):
        raise ValueError("layer lengths must be >= 0 and checks 16 bytes")
    data_offset, offsets = plan_offsets(len(lengths), lengths, False)
    entries = tuple(
        LayerEntry(o, n, bytes(NONCE_SIZE), bytes(c))
        for o, n, c in zip(offsets, lengths, checks, strict=True)
    )
    header = encode_header(
        ObjectHeader(VERSION, 0, 0, created_ns, chunk_key, namespace, tenant, data_offset, entries)
    )
    return header + bytes(data_offset - len(header))


def layer_check(data: memoryview | bytes | bytearray) -> bytes:
    """The ``check`` of a plaintext layer: XXH3-128 of its bytes."""
    return xxhash.xxh3_128_digest(data)


#: Zeros to compare padding with: every pad of a valid object is shorter.
_ZEROS = bytes(ALIGN)


def is_zero(mv: memoryview) -> bool:
    # A memcmp against _ZEROS with no copy (bytes.startswith takes any buffer);
    # memoryview == bytes compares item by item (50x slower).
    if len(mv) <= ALIGN:
        return _ZEROS.startswith(mv)
    return bytes(mv) == bytes(len(mv))


def verify_plain(
    buf: memoryview, *, tenant: str, namespace: bytes, chunk_key: bytes
) -> ObjectHeader:
    """Check a whole plaintext object in ``buf`` without copying its layers out.

    What the sidecar runs on an object a direct-path writer produced before it
    gives the object its name: every check :func:`open_into` makes, and the
    object must be plaintext (a writer outside the sidecar has no data key).
    """
    h = decode_header(buf)
    if h.sealed:
        raise CorruptObject("a direct-path object must be plaintext (SEALED flag set)")
    _check_whole(h, buf, tenant, namespace, chunk_key)
    return h


def _check_whole(
    h: ObjectHeader, buf: memoryview, tenant: str, namespace: bytes, chunk_key: bytes
) -> None:
    """Identity, size and (for plaintext) every pad and checksum of ``buf``."""
    if h.chunk_key != chunk_key or h.tenant != tenant or h.namespace != namespace:
        raise ObjectMismatch("object belongs to another chunk key, tenant or namespace")
    size = h.total_size
    if len(buf) != size:
        raise CorruptObject(f"object is {len(buf)} bytes, header says {size}")
    if h.sealed:
        return
    hl = header_length(len(h.layers))
    if not is_zero(buf[hl : h.data_offset]):
        raise CorruptObject("non-zero padding after header")
    for i, le in enumerate(h.layers):
        end = le.offset + le.length
        nxt = h.layers[i + 1].offset if i + 1 < len(h.layers) else size
        if not is_zero(buf[end:nxt]):
            raise CorruptObject(f"non-zero padding after layer {i}")
        if xxhash.xxh3_128_digest(buf[le.offset : end]) != le.check:
            raise CorruptObject(f"layer {i}: checksum mismatch")


def admit(
    h: ObjectHeader,
    size: int,
    room: int,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    aead_for_epoch: Callable[[int], Aead | None],
    object_aead: ObjectAead | None = None,
) -> Aead | None:
    """The whole-object checks of :func:`open_into` and :func:`open_read_into`
    before any layer is read: the object is this chunk's, ``size`` bytes as its
    header says, fits ``out``, and (sealed) has its key; that key, or None."""
    if h.chunk_key != chunk_key or h.tenant != tenant or h.namespace != namespace:
        raise ObjectMismatch("object belongs to another chunk key, tenant or namespace")
    if size != h.total_size:
        raise CorruptObject(f"object is {size} bytes, header says {h.total_size}")
    if room < h.payload_size:
        # The caller sized ``out`` from what it expected of this chunk: the
        # object is another one (relabelled, or from a store of other shapes).
        raise ObjectMismatch(f"object holds {h.payload_size} bytes, {room} expected")
    if not h.sealed:
        return None
    if h.flags & FLAG_OBJECT_KEY:
        aead = object_aead(h) if object_aead is not None else None
    else:
        aead = aead_for_epoch(h.key_epoch)
    if aead is None:
        raise UnknownKeyEpoch(f"no key for epoch {h.key_epoch} (purged, unknown or newer)")
    return aead


def open_into(
    buf: memoryview,
    out: memoryview,
    *,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    aead_for_epoch: Callable[[int], Aead | None],
    before_layer: Callable[[int], None] | None = None,
    object_aead: ObjectAead | None = None,
) -> ObjectHeader:
    """Verify the whole object in ``buf`` and write its layers, packed, into ``out``.

    Raises :class:`CorruptObject` (or :class:`ObjectMismatch`) unless every
    structural check, every zero pad and every tag/checksum passed; callers
    must treat the bytes in ``out`` as garbage unless this returns.
    ``before_layer(i)`` runs before layer ``i``'s bytes are written to ``out``;
    whatever it raises stops the copy there (a cancelled load).
    """
    h = decode_header(buf)
    aead = admit(h, len(buf), len(out), tenant, namespace, chunk_key, aead_for_epoch, object_aead)
    hl = header_length(len(h.layers))
    if not is_zero(buf[hl : h.data_offset]):
        raise CorruptObject("non-zero padding after header")
    pos = 0
    for i, le in enumerate(h.layers):
        if before_layer is not None:
            before_layer(i)
        lo, hi = layer_slot(h, i)
        open_layer(h, i, buf[lo:hi], out[pos : pos + le.length], aead)
        pos += le.length
    return h


#: ``read_at(buf, offset)``: fill ``buf`` from byte ``offset`` of an object;
#: the count read (short only at the end of the file).
ReadAt = Callable[[memoryview, int], int]


def _read_exact(read_at: ReadAt, buf: memoryview, offset: int) -> memoryview:
    if read_at(buf, offset) != len(buf):
        raise CorruptObject(f"object ends before byte {offset + len(buf)}")
    return buf


def open_read_into(
    read_at: ReadAt,
    size: int,
    alloc: Callable[[int], memoryview],
    out: memoryview,
    *,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    aead_for_epoch: Callable[[int], Aead | None],
    before_layer: Callable[[int], None] | None = None,
    object_aead: ObjectAead | None = None,
) -> ObjectHeader:
    """:func:`open_into` of an object of ``size`` bytes read piece by piece
    through ``read_at``: its header, then one layer slot (:func:`layer_slot`:
    data, tag, padding) at a time into ``alloc(n)`` (a buffer of at least ``n``
    bytes, reused), which is verified and decrypted into ``out`` while it is
    still in the CPU cache. The same checks in the same order, the same
    exceptions, and ``out`` is garbage unless this returns."""
    head = _read_exact(read_at, alloc(min(size, ALIGN))[: min(size, ALIGN)], 0)
    if len(head) >= 16:
        (hl,) = struct.unpack_from("<I", head, 12)
        if len(head) < hl <= min(size, MAX_HEADER_LENGTH):
            head = _read_exact(read_at, alloc(hl)[:hl], 0)
    h = decode_header(head)
    aead = admit(h, size, len(out), tenant, namespace, chunk_key, aead_for_epoch, object_aead)
    hl = header_length(len(h.layers))
    if len(head) >= h.data_offset:
        pad = head[hl : h.data_offset]
    else:
        n = h.data_offset - hl
        pad = _read_exact(read_at, alloc(n)[:n], hl)
    if not is_zero(pad):
        raise CorruptObject("non-zero padding after header")
    pos = 0
    for i, le in enumerate(h.layers):
        if before_layer is not None:
            before_layer(i)
        lo, hi = layer_slot(h, i)
        slot = _read_exact(read_at, alloc(hi - lo)[: hi - lo], lo)
        open_layer(h, i, slot, out[pos : pos + le.length], aead)
        pos += le.length
    return h


def layer_slot(h: ObjectHeader, i: int) -> tuple[int, int]:
    """The byte range of layer ``i`` in the object: its data, its tag (sealed) and
    the zero padding up to the next layer (or the end): what :func:`open_layer` reads."""
    nxt = h.layers[i + 1].offset if i + 1 < len(h.layers) else h.total_size
    return h.layers[i].offset, nxt


def open_layer(
    h: ObjectHeader, i: int, slot: memoryview, dst: memoryview, aead: Aead | None
) -> None:
    """Verify layer ``i`` from its slot (:func:`layer_slot`) and write its plaintext to ``dst``.

    The per-layer half of :func:`open_into`, which a layer-wise load (protocol
    §5.26) runs layer by layer over several objects once their headers passed
    the whole-object checks. Raises :class:`CorruptObject` unless the padding
    is zero and the tag (or checksum) passed; ``dst`` is garbage then.
    """
    le = h.layers[i]
    stored = le.length + (TAG_SIZE if h.sealed else 0)
    if len(slot) < stored or not is_zero(slot[stored:]):
        raise CorruptObject(f"non-zero padding after layer {i}")
    if h.sealed:
        if aead is None:
            raise UnknownKeyEpoch(f"no key for epoch {h.key_epoch} (purged, unknown or newer)")
        if bytes(slot[le.length : stored]) != le.check:
            raise CorruptObject(f"layer {i}: tag differs from the header's copy")
        try:
            aead.decrypt_into(le.nonce, slot[:stored], layer_aad(h, i), dst[: le.length])
        except Exception as exc:  # cryptography's InvalidTag
            raise CorruptObject(f"layer {i}: authentication failed") from exc
    else:
        src = slot[:stored]
        if xxhash.xxh3_128_digest(src) != le.check:
            raise CorruptObject(f"layer {i}: checksum mismatch")
        dst[: le.length] = src
