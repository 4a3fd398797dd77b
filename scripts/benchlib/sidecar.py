"""A real sidecar process for a benchmark: its config, start, stop, RAM tier and files.

``run_sidecar`` starts ``python -m kvoffload.cli --config <toml> serve`` on a
fresh store under a work directory, with a policy that grants this uid every
tenant, makes tenant ``plain`` plaintext, tenant ``direct`` plaintext with
``direct = true``, every other tenant AES-256-GCM; it stops the sidecar
(SIGTERM) on exit, and the sidecar dies with the benchmark even on SIGKILL.
``socket_echo`` is the ceiling of a request's round trip over a Unix socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib.chunks import NAMESPACE, TENANT, MiB
from benchlib.cpu import reap
from benchlib.method import write_all
from benchlib.stores import wait_ram_tier_filled
from kvoffload import testing
from kvoffload.client import SidecarClient
from kvoffload.layouts import v1

SEALED_TENANT = TENANT  # default tenant policy: AES-256-GCM
PLAIN_TENANT = "plain"  # [tenants.plain] encryption = "none"
DIRECT_TENANT = "direct"  # [tenants.direct] encryption = "none", direct = true
TENANTS = {"sealed": SEALED_TENANT, "plain": PLAIN_TENANT, "direct": DIRECT_TENANT}


# In the child before exec: get SIGTERM when the benchmark dies, even by SIGKILL.
_die_with_parent = testing.die_with_parent
testing.prepare_die_with_parent()


# Runs the CLI with one cProfile profiler per thread (pool threads included) and
# dumps their merged stats on exit. argv: <out.prof> <kvoffload cli args...>.
_PROFILE_BOOTSTRAP = """
import cProfile, pstats, sys, threading
out = sys.argv[1]
profs = []
def _start(*_a):
    p = cProfile.Profile()
    profs.append(p)
    p.enable()
threading.setprofile(_start)
sys.argv = ["kvoffload", *sys.argv[2:]]
from kvoffload.cli import main
main_prof = cProfile.Profile()
main_prof.enable()
try:
    main()
except SystemExit:
    pass
finally:
    main_prof.disable()
    threading.setprofile(None)
    st = pstats.Stats(main_prof)
    for p in profs:
        try:
            st.add(p)
        except TypeError:
            pass
    st.dump_stats(out)
"""


def _write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        write_all(fd, memoryview(data))
    finally:
        os.close(fd)


def short_socket_dir(work: Path, stack: contextlib.ExitStack) -> Path:
    """``work``, or a short temp dir when a socket path under ``work`` would be too long."""
    if len(os.fsencode(work / "kvoffload.sock")) < 100:
        return work
    d = Path(tempfile.mkdtemp(prefix="kvb-"))
    stack.callback(shutil.rmtree, d, True)
    return d


@dataclass
class Sidecar:
    work: Path
    socket: Path
    store_root: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    command: list[str]
    stats: dict[str, Any] = field(default_factory=dict)  # fetch_stats() once it is up

    def describe(self) -> str:
        """What the sidecar says it runs: durability and I/O backend (if it reports one)."""
        parts = [f"durability={self.stats.get('durability', '?')}"]
        io = self.stats.get("io")
        if isinstance(io, dict):
            parts.append(
                "io=" + ", ".join(f"{k}={v}" for k, v in io.items() if not isinstance(v, dict))
            )
        elif io is not None:
            parts.append(f"io={io}")
        tier = self.stats.get("ram_tier")
        if isinstance(tier, dict):
            parts.append(
                f"ram_tier={tier['capacity_bytes'] / MiB:.0f} MiB for objects >= "
                f"{tier['min_object_bytes'] / MiB:.0f} MiB"
            )
        else:
            parts.append("ram_tier=off")
        return "; ".join(parts)

    def ram_and_store_hits(self) -> tuple[int, int] | None:
        """(RAM tier hits, store hits) so far; None where the sidecar has no RAM tier."""
        from kvoffload.client.session import fetch_stats

        st = fetch_stats(self.socket)
        tier = st.get("ram_tier")
        return None if not isinstance(tier, dict) else (int(tier["hits"]), int(st["hits"]))

    def fill_ram_tier(self, client: SidecarClient, chunks: Sequence[tuple[bytes, Any]]) -> None:
        """Save ``chunks`` (untimed) and wait until the RAM tier has mapped its
        memory: it does so once per sidecar process, at the first large object,
        and the rows measure the running state, not that start-up cost."""
        from kvoffload.client.session import fetch_stats

        if not isinstance(self.stats.get("ram_tier"), dict):
            return
        client.save(NAMESPACE, list(chunks))
        try:
            wait_ram_tier_filled(lambda: fetch_stats(self.socket), "the sidecar's")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self.log_tail()}") from None

    def drop_ram_tier(self) -> None:
        """Empty the sidecar's RAM tier (``drop_cache``, protocol-v1 §5.31): a cold row
        must read files, as the page cache is dropped for it."""
        from kvoffload.cli.admin import SidecarTarget

        SidecarTarget(self.socket).drop_cache()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]
        except OSError:
            return ""

    def object_path(self, tenant: str, key: bytes) -> Path:
        return self.store_root / v1.object_relpath(tenant, key)

    def object_files(self) -> list[Path]:
        objects = self.store_root / "objects"
        return [p for p in objects.rglob("*") if p.is_file()] if objects.is_dir() else []


def config_files(work: Path, sock: Path) -> Path:
    """KEK, policy and config of a store under ``work``; returns the config path."""
    _write_private(work / "kek", os.urandom(32))
    policy = work / "policy.toml"
    policy.write_text(
        "version = 1\n\n"
        "[defaults]\n"
        'encryption = "aes-256-gcm"\n'
        'ttl = "none"\n'
        'quota = "none"\n\n'
        f"[tenants.{PLAIN_TENANT}]\n"
        'encryption = "none"\n\n'
        f"[tenants.{DIRECT_TENANT}]\n"
        'encryption = "none"\n'
        "direct = true\n\n"
        "[[grants]]\n"
        f"uid = {os.getuid()}\n"
        'tenants = ["*"]\n'
        "admin = true\n",
        encoding="utf-8",
    )
    os.chmod(policy, 0o600)
    config = work / "config.toml"
    config.write_text(
        "[store]\n"
        f"root = {json.dumps(str(work / 'store'))}\n"
        f"index_dir = {json.dumps(str(work / 'index'))}\n"
        'capacity = "none"\n\n'
        "[server]\n"
        f"socket = {json.dumps(str(sock))}\n\n"
        "[security]\n"
        f"kek_file = {json.dumps(str(work / 'kek'))}\n"
        f"policy = {json.dumps(str(policy))}\n",
        encoding="utf-8",
    )
    return config


@contextlib.contextmanager
def run_sidecar(
    work: Path,
    durability: str,
    profile: Path | None,
    io_mode: str | None = None,
    ready_timeout_s: float = 60.0,
    streams: int = 0,
    ram_cache: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Sidecar]:
    """Start a sidecar serving a fresh store under ``work``; stop it (SIGTERM) on exit.
    ``env``: more of the sidecar's environment (a PYTHONPATH, say)."""
    with contextlib.ExitStack() as stack:
        work.mkdir(parents=True)
        sock = short_socket_dir(work, stack) / "kvoffload.sock"
        config = config_files(work, sock)
        env = {**(env or {}), "KVOFFLOAD_STORE_DURABILITY": durability}
        if io_mode is not None:
            env["KVOFFLOAD_IO"] = io_mode
        if streams:
            env["KVOFFLOAD_STORE_IO_STREAMS"] = str(streams)
        if ram_cache is not None:
            env["KVOFFLOAD_STORE_RAM_CACHE"] = ram_cache
        cli = ["--config", str(config), "serve"]
        if profile is None:
            cmd = testing.cli_argv(*cli)
        else:
            out = profile / f"sidecar-{durability}.prof"
            cmd = [sys.executable, "-c", _PROFILE_BOOTSTRAP, str(out), *cli]
        log_path = work / "sidecar.log"
        process = testing.SidecarProcess(
            work, sock, cmd, env=env, log_path=log_path, tie_to_parent=True
        )
        stack.callback(process.stop)
        process.start()
        assert process.proc is not None
        sc = Sidecar(work, sock, work / "store", process.proc, log_path, cmd)
        try:
            sc.stats = process.wait_ready(ready_timeout_s)
        except testing.SidecarStartError as exc:
            raise RuntimeError(str(exc)) from None
        yield sc


# --------------------------------------------------------------------------- socket echo


_ECHO = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
n, reply = int(sys.argv[2]), b"r" * int(sys.argv[3])
while True:
    got = 0
    while got < n:
        d = s.recv(n - got)
        if not d:
            sys.exit(0)
        got += len(d)
    s.sendall(reply)
"""


@contextlib.contextmanager
def socket_echo(request_bytes: int, reply_bytes: int) -> Iterator[Callable[[int], None]]:
    """A child Python process that answers each ``request_bytes`` with ``reply_bytes``."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(b.fileno()), str(request_bytes), str(reply_bytes)],
        pass_fds=[b.fileno()],
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    b.close()
    req = os.urandom(request_bytes)
    buf = bytearray(reply_bytes)
    view = memoryview(buf)

    def op(_i: int) -> None:
        a.sendall(req)
        got = 0
        while got < reply_bytes:
            n = a.recv_into(view[got:])
            if n == 0:
                raise OSError("echo process closed the socket")
            got += n

    try:
        yield op
    finally:
        a.close()
        reap(proc, 10)
