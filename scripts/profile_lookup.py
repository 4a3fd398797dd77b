"""Instructions per store lookup, counted by callgrind (load-independent).

Each row runs this script under ``valgrind --tool=callgrind`` on a real store
on a temp dir (a few chunks put, every row warmed up), collecting only inside
one ``functools.reduce`` that calls the row ``--n`` times: its count over
``--n`` is the row's instructions per call. The peer row calls nothing: the
loop's own cost, included in every row.

Usage::

    .venv/bin/python scripts/profile_lookup.py            # ~1-2 min
    .venv/bin/python scripts/profile_lookup.py --n 200    # quicker, a little noisier
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
from collections.abc import Callable
from pathlib import Path

from benchlib.chunks import NAMESPACE, TENANT
from benchlib.stores import new_kek
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


def _instructions(row: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out",
            "--collect-atstart=no", "--toggle-collect=functools_reduce",
            sys.executable, __file__, "--child", row, "--n", str(n),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode or found is None:
            sys.exit(f"callgrind run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="lookups per row (default 1000)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n < 1:
        sys.exit("--n must be at least 1")
    if args.child is not None:
        child(args.child, args.n)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found: this script counts instructions with callgrind")
    print(f"callgrind instructions per call, {args.n} calls per row")
    print(f"{'row':<36} {'instructions/call':>18}")
    for row in ROWS:
        print(f"{row:<36} {_instructions(row, args.n) / args.n:>18,.0f}")


if __name__ == "__main__":
    main()
