"""A connection's peer: its credentials (``SO_PEERCRED``, ``SO_PEERGROUPS``), read at accept."""

from __future__ import annotations

import array
import socket
import struct
from dataclasses import dataclass

#: Linux SO_PEERGROUPS (4.13+); Python's socket module has no name for it.
_SO_PEERGROUPS = 59
_UCRED = struct.Struct("iII")


@dataclass(frozen=True)
class Peer:
    """The credentials of a connection's peer (``SO_PEERCRED``), read at accept time."""

    pid: int
    uid: int
    gids: tuple[int, ...]


def _supplementary_groups(sock: socket.socket, pid: int) -> list[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        return list(array.array("I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass
    # Older kernels: racy (the pid may be gone or reused) but better than nothing.
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def peer_credentials(sock: socket.socket) -> Peer:
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    gids = dict.fromkeys([gid, *_supplementary_groups(sock, pid)])
    return Peer(pid, uid, tuple(gids))


__all__ = ["Peer", "peer_credentials"]
