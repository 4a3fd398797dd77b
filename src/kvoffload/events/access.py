"""Who may read what on a kvoffload feed (docs/spec/events-v1.md §7.1).

A publisher given a :class:`FeedAccess` identifies every peer at the ZMQ
handshake through a ZAP handler (RFC 27, ``inproc://zeromq.zap.01`` of the
publisher's own context). On an ``ipc://`` endpoint libzmq reports the
peer's ``SO_PEERCRED`` credentials as its address (``…:uid:gid:pid``); the
handler adds the supplementary groups from ``/proc/<pid>/status`` and hands
the result back as the connection's ZAP user id, which libzmq attaches to
every message the peer sends (its subscriptions, its replay and snapshot
requests). Each of those is then checked against the access in force *at
that moment*: the full feed only for a reader, a tenant's channel only for a
peer that may see that tenant. A peer that may see nothing is refused at the
handshake. A peer on a TCP endpoint has no credentials: it is identified as
``TCP_PEER``, and what it may see is the access's decision (the sidecar: the
full feed, as anyone who reaches the port, CURVE-protected when configured).

Tenant channels: topic ``kvoffload-tenant/<tenant>/<feed topic>``
(:func:`tenant_topic`). A tenant id never holds ``/``, so no channel's topic
is a prefix of another's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Final, Protocol

from kvoffload.contract import TENANT_RE

__all__ = [
    "NOTHING",
    "TCP_PEER",
    "TENANT_TOPIC_PREFIX",
    "FeedAccess",
    "FeedPeer",
    "Visibility",
    "check_feed_topic",
    "peer_from_ipc_address",
    "request_frames",
    "tenant_of_topic",
    "tenant_topic",
]

#: Every tenant channel's topic starts with it; a subscription that does not
#: start with it is one to the full feed.
TENANT_TOPIC_PREFIX: Final = b"kvoffload-tenant/"


@dataclass(frozen=True, slots=True)
class FeedPeer:
    """A subscriber, as identified at its handshake; ``uid`` None: no credentials (TCP)."""

    uid: int | None
    gids: tuple[int, ...] = ()
    pid: int | None = None

    def user_id(self) -> bytes:
        """The ZAP user id that carries it to every message of the connection."""
        if self.uid is None:
            return b"tcp"
        gids = ",".join(str(g) for g in self.gids)
        return f"{self.uid};{self.pid or 0};{gids}".encode("ascii")

    @classmethod
    def from_user_id(cls, raw: str | bytes | None) -> FeedPeer | None:
        """What :meth:`user_id` wrote; None for anything else."""
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        if text is None:
            return None
        if text == "tcp":
            return TCP_PEER
        try:
            uid, pid, gids = text.split(";")
            return cls(int(uid), tuple(int(g) for g in gids.split(",") if g), int(pid) or None)
        except ValueError:
            return None


TCP_PEER: Final = FeedPeer(None)


@dataclass(frozen=True, slots=True)
class Visibility:
    """What one peer may read now: the full feed, and which tenant channels."""

    full: bool = False
    tenants: frozenset[str] = frozenset()
    #: Every tenant's channel (a ``["*"]`` grant); ``tenants`` is then unused.
    every_tenant: bool = False

    def sees(self, tenant: str) -> bool:
        return self.every_tenant or tenant in self.tenants

    @property
    def anything(self) -> bool:
        return self.full or self.every_tenant or bool(self.tenants)


NOTHING: Final = Visibility()


class FeedAccess(Protocol):
    """The publisher asks it for every subscription and every request."""

    def visibility(self, peer: FeedPeer) -> Visibility: ...


def _proc_groups(pid: int) -> list[int]:
    path = f"/proc/{pid}/status"
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith("Groups:"):
                return [int(g) for g in line.split()[1:]]
    return []


def peer_from_ipc_address(address: bytes) -> FeedPeer | None:
    """The peer of an ipc connection from libzmq's ZAP address ``host:uid:gid:pid``."""
    parts = address.decode("ascii", "replace").rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    gids = tuple(dict.fromkeys([gid, *_proc_groups(pid)]))
    return FeedPeer(uid, gids, pid)


def tenant_topic(tenant: str, feed_topic: bytes | str = b"") -> bytes:
    """The topic of ``tenant``'s channel of the feed whose topic is ``feed_topic``."""
    if not TENANT_RE.fullmatch(tenant):
        raise ValueError(f"invalid tenant id {tenant!r}")
    base = feed_topic.encode() if isinstance(feed_topic, str) else feed_topic
    return TENANT_TOPIC_PREFIX + tenant.encode("ascii") + b"/" + base


def tenant_of_topic(topic: bytes) -> str | None:
    """The tenant whose channel ``topic`` names (it may stop after ``<tenant>/``)."""
    if not topic.startswith(TENANT_TOPIC_PREFIX):
        return None
    name, sep, _ = topic[len(TENANT_TOPIC_PREFIX) :].partition(b"/")
    if not sep:
        return None
    tenant = name.decode("ascii", "replace")
    return tenant if TENANT_RE.fullmatch(tenant) else None


def request_frames(body: bytes, topic: str | bytes) -> list[bytes]:
    """A replay or snapshot request: ``["", body]``, and the topic when it names a
    tenant's channel (a vLLM engine's ROUTER takes exactly two frames)."""
    t = topic.encode() if isinstance(topic, str) else topic
    return [b"", body, t] if t.startswith(TENANT_TOPIC_PREFIX) else [b"", body]


def check_feed_topic(topic: bytes) -> None:
    """A full feed's topic must not overlap the tenant channels' (by prefix)."""
    if topic.startswith(TENANT_TOPIC_PREFIX) or TENANT_TOPIC_PREFIX.startswith(topic):
        raise ValueError(
            f"feed topic {topic!r}: it must not be a prefix of, or start with, "
            f"{TENANT_TOPIC_PREFIX.decode()!r} (the tenant channels' topics)"
        )
