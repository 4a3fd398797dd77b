"""Instructions per store lookup, counted by callgrind (load-independent).

Each row runs this script under ``valgrind --tool=callgrind`` on a real store
on a temp dir (a few chunks put, every row warmed up), collecting only inside
one ``functools.reduce`` that calls the row ``--n`` times: its count over
``--n`` is the row's instructions per call. The peer row calls nothing: the
loop's own cost, included in every row.

With ``--sidecar`` the rows are a whole lookup over the socket instead: a
real sidecar process runs under callgrind with its instrumentation switched on
(``callgrind_control``) only after start-up and a warm-up, its counts zeroed,
``--n`` lookups sent, and its counts dumped: every thread's instructions, the
event loop's included, over ``--n``. The client's row runs the client under
callgrind (the same ``functools.reduce`` toggle) against a sidecar run natively.

Usage::

    .venv/bin/python scripts/profile_lookup.py            # ~1-2 min
    .venv/bin/python scripts/profile_lookup.py --n 200    # quicker, a little noisier
    .venv/bin/python scripts/profile_lookup.py --sidecar  # ~2-4 min (--keep DIR: the dumps)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from benchlib.chunks import NAMESPACE, TENANT
from benchlib.sidecar import config_files
from benchlib.stores import new_kek
from kvoffload import testing
from kvoffload.client import SidecarClient
from kvoffload.store import Store, StoreConfig

CHUNKS = 64
WARMUP = 20


def _key(i: int) -> bytes:
    return hashlib.blake2b(f"profile/{i}".encode(), digest_size=32).digest()


KEYS = [_key(i) for i in range(CHUNKS)]
ONE, ABSENT = KEYS[:1], [_key(-1)]

#: What each row calls, once per lookup.
ROWS: dict[str, Callable[[Store], object]] = {
    "peer: the loop alone": lambda s: None,
    "lookup_cached, 1 key hit": lambda s: s.lookup_cached(TENANT, ONE),
    "lookup_cached, 64 keys hit": lambda s: s.lookup_cached(TENANT, KEYS),
    "lookup_cached, 1 key other tenant": lambda s: s.lookup_cached("other", ONE),
    "lookup, 1 key hit": lambda s: s.lookup(TENANT, ONE),
    "lookup, 1 key absent": lambda s: s.lookup(TENANT, ABSENT),
}


def child(row: str, n: int) -> None:
    """Set up a store, warm up every row, then call ``row`` ``n`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        store = Store(
            StoreConfig(root=base / "store", durability="none"), new_kek(base), create=True
        )
        try:
            for key in KEYS:
                store.put(TENANT, NAMESPACE, key, [b"x" * 256])
            for fn in ROWS.values():
                for _ in range(WARMUP):
                    fn(store)
            fn = ROWS[row]
            # The one reduce of the run: callgrind collects inside it only.
            functools.reduce(lambda _, __: fn(store), range(n), None)
        finally:
            store.close()


def _reduce_instructions(out_file: str, *child_args: str) -> int:
    """This script run as ``child_args`` under callgrind, collecting inside its one
    ``functools.reduce`` only: the instructions counted there."""
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}",
        "--collect-atstart=no", "--toggle-collect=functools_reduce",
        sys.executable, __file__, *child_args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        sys.exit(f"callgrind run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return int(found.group(1))


def _instructions(row: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        return _reduce_instructions(f"{out}/cg.out", "--child", row, "--n", str(n))


# ------------------------------------------------------------------ --sidecar

#: Keys per lookup of each sidecar row.
SIDECAR_ROWS = {"sidecar: lookup 1 key (every thread)": 1, "sidecar: lookup 64 keys": CHUNKS}


@contextmanager
def _sidecar(work: Path, valgrind: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A sidecar on a fresh store under ``work`` (run by ``valgrind`` + python, if
    given), the 64 keys saved; stopped on exit."""
    sock = work / "s.sock"
    config = config_files(work, sock)
    cmd = [*valgrind, *testing.cli_argv("--config", str(config), "serve")]
    env = {**os.environ, "PYTHONHASHSEED": "0", "KVOFFLOAD_STORE_DURABILITY": "none"}
    with open(work / "sidecar.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while testing.answers(sock) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (work / "sidecar.log").read_text()[-2000:]
                sys.exit(f"the sidecar did not start:\n{tail}")
            time.sleep(0.2)
        with SidecarClient(sock, TENANT) as client:
            if not all(client.save(NAMESPACE, [(k, [b"x" * 256]) for k in KEYS])):
                sys.exit("the sidecar did not store the keys")
        yield proc, sock
    finally:
        proc.terminate()
        proc.wait()


def _control(pid: int, flag: str) -> None:
    done = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"callgrind_control {flag} failed: {done.stdout}{done.stderr}")


def _dumped_total(out: Path, before: set[Path]) -> int:
    for _ in range(100):
        new = sorted(set(out.parent.glob(out.name + "*")) - before)
        for f in new:
            found = re.search(r"^(?:summary|totals): (\d+)", f.read_text(), re.M)
            if found is not None:
                return int(found.group(1))
        time.sleep(0.1)
    sys.exit(f"no callgrind dump under {out.parent}")


def sidecar_rows(n: int, keep: Path | None) -> dict[str, float]:
    """Instructions per lookup in the sidecar process (every thread), per row."""
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvprof-") as tmp:
        work = Path(tmp)
        out = (keep or work) / "sidecar.cg"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={out}"]  # fmt: skip
        with _sidecar(work, valgrind) as (proc, sock), SidecarClient(sock, TENANT) as client:
            _control(proc.pid, "--instr=on")
            for row, nkeys in SIDECAR_ROWS.items():
                keys = KEYS[:nkeys]
                for _ in range(WARMUP):
                    client.lookup(keys)
                _control(proc.pid, "-z")
                for _ in range(n):
                    if client.lookup(keys) != nkeys:
                        sys.exit("a lookup missed")
                before = set(out.parent.glob(out.name + "*"))
                _control(proc.pid, "-d")
                rows[row] = _dumped_total(out, before) / n
    return rows


def client_child(sock: Path, n: int) -> None:
    with SidecarClient(sock, TENANT) as client:
        for _ in range(WARMUP):
            client.lookup(ONE)
        functools.reduce(lambda _, __: client.lookup(ONE), range(n), None)


def client_row(n: int) -> float:
    """Instructions per 1-key lookup in the client (a native sidecar answers)."""
    with tempfile.TemporaryDirectory(prefix="kvprof-") as tmp, _sidecar(Path(tmp), []) as (_, s):
        got = _reduce_instructions(f"{tmp}/client.cg", "--client-child", str(s), "--n", str(n))
        return got / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="lookups per row (default 1000)")
    parser.add_argument("--sidecar", action="store_true", help="whole lookups over the socket")
    parser.add_argument("--keep", type=Path, help="with --sidecar: keep the sidecar's dumps here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--client-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n < 1:
        sys.exit("--n must be at least 1")
    if args.child is not None:
        child(args.child, args.n)
        return
    if args.client_child is not None:
        client_child(args.client_child, args.n)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind not found: this script counts instructions with callgrind")
    if args.sidecar:
        print(f"callgrind instructions per lookup, {args.n} lookups per row")
        print(f"{'row':<36} {'instructions/call':>18}")
        for row, per in sidecar_rows(args.n, args.keep).items():
            print(f"{row:<36} {per:>18,.0f}")
        print(f"{'client: lookup 1 key':<36} {client_row(args.n):>18,.0f}")
        return
    print(f"callgrind instructions per call, {args.n} calls per row")
    print(f"{'row':<36} {'instructions/call':>18}")
    for row in ROWS:
        print(f"{row:<36} {_instructions(row, args.n) / args.n:>18,.0f}")


if __name__ == "__main__":
    main()
