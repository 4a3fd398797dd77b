"""The evictor lease of a shared store root (shared-root-v1.md §4).

One node at a time evicts for the whole root. The lease is a sequence of
files ``journal/evictor/epoch-<E>.json``; the highest epoch is in force. A
node takes epoch ``E+1`` by ``link(2)`` (exactly one racer wins on any POSIX
filesystem) once epoch ``E`` is released or *expired as observed on its own
monotonic clock*, so no two nodes' clocks are ever compared. The holder
renews every ``ttl/3`` and, before each removal, checks :meth:`EvictorLease.fence`:
enough of its own deadline left and no higher epoch on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import JournalError
from ...posix import atomic_create

__all__ = ["LEASE_VERSION", "EvictorLease", "LeaseState"]

LEASE_VERSION = 1
_EPOCH_RE = re.compile(r"^epoch-(\d{20})\.json$")

Clock = Callable[[], float]


@dataclass(frozen=True)
class LeaseState:
    """What one lease file says."""

    epoch: int
    holder: str
    incarnation: str
    renewal: int
    ttl_s: float
    released: bool
    #: Cumulative bytes each node may write in this epoch (shared-root-v1.md §4.1).
    grants: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "lease_version": LEASE_VERSION,
            "epoch": self.epoch,
            "holder": self.holder,
            "incarnation": self.incarnation,
            "renewal": self.renewal,
            "ttl_s": self.ttl_s,
            "released": self.released,
            "grants": dict(sorted(self.grants.items())),
        }
        return (json.dumps(doc, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def parse(cls, data: bytes, epoch: int) -> LeaseState:
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise JournalError(f"lease epoch {epoch}: not JSON") from exc
        if not isinstance(doc, dict):
            raise JournalError(f"lease epoch {epoch}: not a JSON object")
        if doc.get("lease_version") != LEASE_VERSION:
            raise JournalError(
                f"lease epoch {epoch}: lease_version {doc.get('lease_version')!r} "
                f"is not supported (this kvoffload reads {LEASE_VERSION})"
            )
        try:
            state = cls(
                epoch=int(doc["epoch"]),
                holder=str(doc["holder"]),
                incarnation=str(doc["incarnation"]),
                renewal=int(doc["renewal"]),
                ttl_s=float(doc["ttl_s"]),
                released=bool(doc["released"]),
                grants=_grants(doc.get("grants", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalError(f"lease epoch {epoch}: field {exc} missing or invalid") from exc
        if state.epoch != epoch or not state.ttl_s > 0:
            raise JournalError(f"lease epoch {epoch}: content names epoch {state.epoch}")
        return state


def _grants(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise ValueError("grants is not an object")
    out: dict[str, int] = {}
    for node, n in raw.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"grant of {node!r} is not a byte count")
        out[str(node)] = n
    return out


def _name(epoch: int) -> str:
    return f"epoch-{epoch:020d}.json"


class EvictorLease:
    """One node's view of, and claim on, the root's evictor role.

    Call :meth:`tick` periodically (every ``ttl/3`` or more often): it renews
    a held lease when ``ttl/3`` has passed since its last renewal, or tries to
    take a free or expired one; it returns whether this node holds the role.
    Before each removal call :meth:`fence`.
    """

    def __init__(
        self,
        root: Path,
        node_id: str,
        incarnation: str,
        *,
        ttl_s: float = 15.0,
        margin_s: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError("the lease ttl must be positive")
        self.dir = Path(root) / "journal" / "evictor"
        self.node_id = node_id
        self.incarnation = incarnation
        self.ttl_s = ttl_s
        self.margin_s = ttl_s / 3 if margin_s is None else margin_s
        self._clock = clock
        self._held: LeaseState | None = None
        self._deadline = 0.0
        # Observation of the lease in force: (epoch, renewal) and when first seen.
        self._seen: tuple[int, int] | None = None
        self._seen_at = 0.0
        self.takeovers = 0
        #: Rewrites of the held lease file (renewals, grants published, releases).
        self.renewals = 0
        self.errors: list[str] = []
        #: What the holder writes into its lease file at the next renewal.
        self.grants: dict[str, int] = {}
        #: The lease in force as last read by :meth:`tick` (None: none yet, or held).
        self.last_seen: LeaseState | None = None
        #: When this node took the role: the lease it replaced (its grants may
        #: still be in use by nodes that have not seen the new epoch).
        self.previous: LeaseState | None = None
        #: When (this node's monotonic clock) :meth:`tick` last read the lease file.
        self.read_at = 0.0
        # tick, publish and release may run on different threads (the follower's
        # loop; a writer whose grant ran out): one renewal at a time.
        self._lock = threading.RLock()

    # -- reading -------------------------------------------------------------

    def _epochs(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _EPOCH_RE.match(n)))

    def current(self) -> LeaseState | None:
        """The lease in force (highest epoch), or None when there is none yet."""
        for epoch in reversed(self._epochs()):
            try:
                data = (self.dir / _name(epoch)).read_bytes()
            except FileNotFoundError:
                continue
            try:
                return LeaseState.parse(data, epoch)
            except JournalError as exc:
                # A damaged lease file is treated as released, so the role is
                # never stuck; the next epoch replaces it.
                self._error(str(exc))
                return LeaseState(epoch, "", "", 0, self.ttl_s, True)
        return None

    def _error(self, msg: str) -> None:
        if len(self.errors) < 100:
            self.errors.append(msg)

    @property
    def held(self) -> LeaseState | None:
        return self._held

    # -- acting --------------------------------------------------------------

    def tick(self) -> bool:
        with self._lock:
            return self._tick()

    def _tick(self) -> bool:
        now = self._clock()
        if self._held is not None:
            if now < self._deadline and self._keep(now):
                return True
            self._held = None
        cur = self.current()
        self.last_seen = cur
        self.previous = cur
        self.read_at = now
        if cur is None:
            return self._take(1, now)
        # Our own lease that we stopped renewing in time (a pause, a failed
        # renewal) is waited out like anyone else's: only a fresh epoch counts.
        obs = (cur.epoch, cur.renewal)
        if obs != self._seen:
            self._seen, self._seen_at = obs, now
        expired = now - self._seen_at >= cur.ttl_s
        if cur.released or expired:
            return self._take(cur.epoch + 1, now)
        return False

    def _take(self, epoch: int, now: float) -> bool:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.grants = {}
        state = LeaseState(epoch, self.node_id, self.incarnation, 0, self.ttl_s, False)
        try:
            atomic_create(self.dir / _name(epoch), state.to_json(), mode=0o600)
        except FileExistsError:
            return False
        except OSError as exc:
            self._error(f"cannot take the evictor lease (epoch {epoch}): {exc}")
            return False
        self._held, self._deadline = state, now + self.ttl_s
        self.takeovers += 1
        for old in self._epochs():
            if old < epoch - 1:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.dir / _name(old))
        return True

    def _keep(self, now: float) -> bool:
        """The holder's tick: renew once ``ttl_s / 3`` has passed since the last
        renewal began (its deadline less two thirds of the ttl), else only check
        that no higher epoch exists. A tick runs at every journal poll, many
        times per renewal period; each renewal is an fsync and a rename on the
        shared filesystem, so it is written only when due (shared-root-v1.md §4)."""
        assert self._held is not None
        if now >= self._deadline - self.ttl_s * 2 / 3:
            return self._renew(now)
        return not self._higher_epoch_exists(self._held.epoch)

    def _renew(self, now: float) -> bool:
        assert self._held is not None
        if self._higher_epoch_exists(self._held.epoch):
            return False
        state = LeaseState(
            self._held.epoch,
            self.node_id,
            self.incarnation,
            self._held.renewal + 1,
            self.ttl_s,
            False,
            dict(self.grants),
        )
        try:
            atomic_create(self.dir / _name(state.epoch), state.to_json(), mode=0o600, replace=True)
        except OSError as exc:
            self._error(f"cannot renew the evictor lease (epoch {state.epoch}): {exc}")
            return now < self._deadline
        self._held, self._deadline = state, now + self.ttl_s
        self.renewals += 1
        return True

    def publish(self) -> bool:
        """Write :attr:`grants` into the held lease now (a renewal), so that a grant
        is on file before its node uses it; whether this node still holds the role."""
        with self._lock:
            now = self._clock()
            held = self._held
            if held is None or now >= self._deadline:
                return False
            # True only when the file now says what grants says (a failed write
            # keeps the role until the deadline, but publishes nothing).
            return self._renew(now) and self._held is not held

    def valid_until(self) -> float:
        """Until when (this node's monotonic clock) the lease state it knows of may
        bound its writes (shared-root-v1.md §4.1): the holder's own deadline, or
        ``ttl_s`` after an observer last read the lease file. A node paused past
        it writes nothing until its next :meth:`tick`."""
        if self._held is not None:
            return self._deadline
        return self.read_at + self.ttl_s

    def now(self) -> float:
        return self._clock()

    def _higher_epoch_exists(self, epoch: int) -> bool:
        return any(e > epoch for e in self._epochs())

    def fence(self) -> bool:
        """True when this node may remove an object now (check before every removal)."""
        return self.fenced_epoch() is not None

    def fenced_epoch(self) -> int | None:
        """:meth:`fence`, and the epoch it allowed the removal under (the one its
        journal record names, even if the lease lapses before that record is
        written); None when it may not remove."""
        held = self._held
        if held is None or self._clock() > self._deadline - self.margin_s:
            return None
        return None if self._higher_epoch_exists(held.epoch) else held.epoch

    def release(self) -> None:
        """Give the role up (clean shutdown): others may take it at once."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._held is None:
            return
        state = LeaseState(
            self._held.epoch,
            self.node_id,
            self.incarnation,
            self._held.renewal + 1,
            self.ttl_s,
            True,
            dict(self.grants),
        )
        held, self._held = self._held, None
        if self._higher_epoch_exists(held.epoch):
            return
        with contextlib.suppress(OSError):
            atomic_create(self.dir / _name(state.epoch), state.to_json(), mode=0o600, replace=True)
