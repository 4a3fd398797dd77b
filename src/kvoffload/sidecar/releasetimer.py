"""Exact release instants for padded replies (protocol-v1 §5.28, docs/threat-model.md).

``loop.call_at(deadline)`` is late, and by an amount that depends on when it
was armed: asyncio hands the selector the time left until its next timer, and
the epoll selector rounds it *up* to whole milliseconds. A reply computed at
``t_ready`` for a deadline ``D`` therefore leaves at about
``t_ready + ceil_ms(D - t_ready)``, anywhere in ``[D, D + 1 ms)``, and where
in that millisecond depends on ``t_ready``: on how long the lookup took. With
a 2 ms floor a hit left 33-97 µs before a miss (AUC 0.42-0.46), the very
difference the floor is there to hide.

A :class:`ReleaseTimer` arms a Linux ``timerfd`` at the absolute deadline on
``CLOCK_MONOTONIC`` (the clock of ``loop.time()``) and lets the loop watch the
descriptor: the kernel's high-resolution timer makes it readable at the
deadline, whenever it was armed, and the loop wakes for it like for any other
socket. What remains between the deadline and the release (the wake-up, the
callbacks ahead in the loop's queue) does not depend on the compute time.

A callback never runs before its deadline. Where no timerfd can be made
(another OS, a sandbox without it), :meth:`ReleaseTimer.call_at` falls back to
``loop.call_at`` and the fallback is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import heapq
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("kvoffload.server")

__all__ = ["Cancellable", "ReleaseTimer", "timerfd_available"]

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_libc() -> Any:
    if os.uname().sysname != "Linux":
        return None
    # loop.time() is time.monotonic(); the timer must run on the same clock.
    if "CLOCK_MONOTONIC" not in time.get_clock_info("monotonic").implementation:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_create.restype = ctypes.c_int
        libc.timerfd_settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.POINTER(_Itimerspec),
        ]
        libc.timerfd_settime.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()
_warned = False


def timerfd_available() -> bool:
    """Whether padded replies are released on a timerfd (else on ``loop.call_at``)."""
    return _LIBC is not None


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class _Entry:
    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _timespec(when: float) -> _Timespec:
    # Rounded up: the kernel must never fire before ``when`` as loop.time() reads it.
    ns = math.ceil(when * 1e9)
    return _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)


class ReleaseTimer:
    """Runs callbacks on ``loop`` at exact ``loop.time()`` instants, never earlier.

    One timerfd, armed for the earliest pending deadline; not thread-safe
    (call it on the loop's thread, as the connection does).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, _Entry]] = []
        self._order = itertools.count()
        self._armed: float | None = None
        self._fd = -1
        if _LIBC is not None:
            fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                self._fd = fd
                loop.add_reader(fd, self._fire)
        if self._fd < 0:
            global _warned
            if not _warned:
                _warned = True
                log.warning(
                    "no timerfd: padded lookups are released on the event loop's timer, "
                    "which is up to 1 ms late by an amount that depends on the lookup's "
                    "cost (set a lookup_jitter; docs/threat-model.md)"
                )

    @property
    def precise(self) -> bool:
        return self._fd >= 0

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Cancellable:
        """Run ``callback(*args)`` on the loop once ``loop.time() >= when``."""
        if self._fd < 0:
            return self._loop.call_at(when, callback, *args)
        entry = _Entry(when, callback, args)
        heapq.heappush(self._heap, (when, next(self._order), entry))
        if self._armed is None or when < self._armed:
            self._arm(when)
        return entry

    def pending(self) -> int:
        return sum(not e.cancelled for _, _, e in self._heap)

    def _arm(self, when: float) -> None:
        assert _LIBC is not None
        spec = _Itimerspec(_Timespec(0, 0), _timespec(when))
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")
        self._armed = when

    def _fire(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            os.read(self._fd, 8)
        self._armed = None
        heap = self._heap
        now = self._loop.time()
        while heap and (heap[0][0] <= now or heap[0][2].cancelled):
            entry = heapq.heappop(heap)[2]
            if entry.cancelled:
                continue
            try:
                entry.callback(*entry.args)
            except Exception:
                log.exception("a timed release failed")
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        """Drop every pending callback (they never run) and the descriptor."""
        self._heap.clear()
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
