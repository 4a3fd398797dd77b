"""Per-object keys (docs/spec/keys-v1.md §14, layout-v1.md §3.3).

An object with ``FLAG_OBJECT_KEY`` is sealed under a key of its own, derived
from the tenant's DEK of its epoch and its identity as the header states it::

    info = "kvo-objkey-v1" || u32 key_epoch || u64 created_ns || chunk_key[32]
           || namespace[32] || u16 tenant_len || tenant
    K_obj = HKDF-SHA256(ikm = DEK, salt = 32 zero bytes, info, L = 32)

(integers little-endian). The sidecar can hand ``K_obj`` to a worker that may
read that one object (protocol-v1.md §5.32): it opens no other object (every
other one has another identity, so another key, and HKDF is a PRF), and it
reveals nothing of the DEK. Destroying the DEK (a purge) still erases every
object, since no ``K_obj`` can be derived any more.

This module is stdlib only (``hmac``): a worker imports it without the keyring.
The worker's half, :func:`open_layers_into`, verifies and decrypts a mapped
object straight into the caller's per-layer destinations.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence

from ..errors import CorruptObject, ObjectMismatch
from . import v1

INFO_LABEL = b"kvo-objkey-v1"
_INFO = struct.Struct("<IQ32s32sH")
_ZERO_SALT = bytes(32)


def object_key_info(h: v1.ObjectHeader) -> bytes:
    """The HKDF ``info`` of an object: its epoch, creation time and identity."""
    t = h.tenant.encode("utf-8")
    return INFO_LABEL + _INFO.pack(h.key_epoch, h.created_ns, h.chunk_key, h.namespace, len(t)) + t


def derive_object_key(dek: bytes, h: v1.ObjectHeader) -> bytes:
    """``K_obj`` of the object ``h`` describes, from its epoch's DEK (RFC 5869, one block)."""
    if len(dek) != v1.KEY_SIZE:
        raise ValueError("a data key is 32 bytes")
    prk = hmac.digest(_ZERO_SALT, dek, hashlib.sha256)
    return hmac.digest(prk, object_key_info(h) + b"\x01", hashlib.sha256)


def open_layers_into(
    buf: memoryview,
    dests: Sequence[memoryview],
    *,
    tenant: str,
    namespace: bytes,
    chunk_key: bytes,
    object_aead: Callable[[v1.ObjectHeader], v1.Aead | None],
    header: v1.ObjectHeader | None = None,
) -> v1.ObjectHeader:
    """Verify the whole object in ``buf`` and decrypt layer ``i`` into ``dests[i]``.

    The checks of :func:`~kvoffload.layouts.v1.open_into` in its order (header,
    identity, size, padding, every tag or checksum); a sealed object must carry
    ``FLAG_OBJECT_KEY`` (an older one is opened by the sidecar only). Raises
    :class:`CorruptObject` / :class:`ObjectMismatch` / ``UnknownKeyEpoch``; the
    destinations hold garbage unless this returns. ``header``: what
    :func:`~kvoffload.layouts.v1.decode_header` returned for ``buf`` (not decoded again).
    """
    h = v1.decode_header(buf) if header is None else header
    if h.sealed and not h.flags & v1.FLAG_OBJECT_KEY:
        raise ObjectMismatch("object sealed under the tenant key: only the sidecar opens it")
    if len(dests) != len(h.layers):
        raise ObjectMismatch(f"object has {len(h.layers)} layers, {len(dests)} expected")
    for i, (le, d) in enumerate(zip(h.layers, dests, strict=True)):
        if d.nbytes != le.length:
            raise ObjectMismatch(f"layer {i} holds {le.length} bytes, {d.nbytes} expected")
    aead = v1.admit(
        h, len(buf), h.payload_size, tenant, namespace, chunk_key, lambda _e: None, object_aead
    )
    hl = v1.header_length(len(h.layers))
    if not v1.is_zero(buf[hl : h.data_offset]):
        raise CorruptObject("non-zero padding after header")
    for i, d in enumerate(dests):
        lo, hi = v1.layer_slot(h, i)
        v1.open_layer(h, i, buf[lo:hi], d, aead)
    return h


__all__ = ["INFO_LABEL", "derive_object_key", "object_key_info", "open_layers_into"]
