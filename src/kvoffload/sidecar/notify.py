"""systemd readiness, watchdog and socket activation, without libsystemd.

The protocols are small and stable, and the daemon must also run where no
libsystemd (or its Python binding) is installed, so they are spoken directly:

* ``sd_notify``: one datagram of newline-separated ``KEY=value`` assignments to
  the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or an abstract name
  written with a leading ``@``). Outside systemd the variable is unset and
  every call is a no-op that returns False, so callers never need to check.
* Watchdog: with ``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC`` (and
  ``$WATCHDOG_PID``); the daemon must send ``WATCHDOG=1`` more often than that,
  conventionally every half interval, from the loop whose liveness it proves.
* Socket activation (``sd_listen_fds``): a socket unit passes its listening
  sockets as fds 3, 4, … with ``$LISTEN_FDS`` (their count), ``$LISTEN_PID``
  (the process they are meant for) and ``$LISTEN_FDNAMES``.

Failures to notify are reported as False and never raised: a daemon must not
die because its supervisor's socket went away.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import Final

SD_LISTEN_FDS_START: Final = 3
_LISTEN_VARS: Final = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def _address(value: str) -> bytes | None:
    if value.startswith("@"):
        # Abstract namespace: the kernel's name starts with a NUL byte.
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    # "vsock:" (systemd 253+, for VMs) and anything newer are not spoken here.
    return None


def notify(state: str) -> bool:
    """Send ``state`` (``KEY=value`` lines) to systemd; True if it was sent."""
    address = _address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode("utf-8"), address)
    except OSError:
        return False
    return True


def ready() -> bool:
    """Startup finished: the socket is served (``Type=notify``)."""
    return notify("READY=1")


def reloading() -> bool:
    """A configuration reload started; send `ready` when it is done."""
    # MONOTONIC_USEC lets systemd (253+, Type=notify-reload) tell this reload
    # from an earlier one; older versions ignore the extra assignment.
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def stopping() -> bool:
    """Shutdown started: systemd stops waiting for readiness or watchdog pings."""
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Keep-alive ping for ``WatchdogSec=``."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """A one-line status shown by ``systemctl status``."""
    # A newline would start a new assignment; one line is all systemctl shows.
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog_interval_s() -> float | None:
    """The watchdog timeout in seconds if systemd expects pings from this process.

    None when no watchdog is set, the value is invalid, or ``$WATCHDOG_PID``
    names another process (a child that inherited the environment must not
    believe it is being watched). Ping at half this interval.
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    return usec / 1_000_000


def listen_fds_with_names() -> list[tuple[int, str]]:
    """Sockets passed by socket activation, with their ``FileDescriptorName=``.

    As ``sd_listen_fds(1)``: the variables are removed from the environment
    whether or not they were meant for this process, so that children do not
    inherit them, and the fds are made close-on-exec.
    """
    env = {name: os.environ.pop(name, None) for name in _LISTEN_VARS}
    try:
        if env["LISTEN_PID"] is None or int(env["LISTEN_PID"]) != os.getpid():
            return []
        count = int(env["LISTEN_FDS"] or "")
    except ValueError:
        return []
    if count <= 0:
        return []
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    try:
        for fd in fds:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
    except OSError:
        # An fd that is not open means the variables lie; trust none of them.
        return []
    names = env["LISTEN_FDNAMES"].split(":") if env["LISTEN_FDNAMES"] else []
    if len(names) != count:
        names = ["unknown"] * count  # what systemd calls an unnamed fd
    return list(zip(fds, names, strict=True))


def listen_fds() -> list[int]:
    """File descriptors passed by socket activation (empty when there are none)."""
    return [fd for fd, _ in listen_fds_with_names()]
