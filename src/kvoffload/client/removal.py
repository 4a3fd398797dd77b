"""A tenant's own chunks removed (protocol-v1.md §5.35, revision 18).

``delete`` names keys of the connection's tenant; the sidecar removes each one
it holds as an eviction would (file, index entry with its ``BlockRemoved``
event, accounting, a shared root's journal) and says, per key, whether it
held it. An older
server answers ``UNSUPPORTED``: :func:`delete` then answers None and the
connection stays up (the caller falls back to what it did before: leaving
the bytes to the sidecar's own eviction).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol import Delete, DeleteReply, ErrorCode, ErrorReply, ProtocolError
from .session import Session, expect


def delete(s: Session, tenant: str, keys: Sequence[bytes]) -> list[bool] | None:
    """``delete`` of ``keys`` in batches; per key, whether it was held and is
    removed. None where the server does not serve the verb (or refused it: the
    reply's error is handled as any other)."""
    removed: list[bool] = []
    step = s.hello.max_batch
    for at in range(0, len(keys), step):
        reply = s.call(Delete(tenant, tuple(keys[at : at + step])))
        if isinstance(reply, ErrorReply):
            if reply.code is not ErrorCode.UNSUPPORTED:
                s.on_error_reply(reply)
            return None
        got = expect(reply, DeleteReply).removed
        if len(got) != min(step, len(keys) - at):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "delete reply has wrong length")
        removed.extend(got)
    return removed


__all__ = ["delete"]
