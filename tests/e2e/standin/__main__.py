"""``python -m tests.e2e.standin JOB.json``: one engine as its own process."""

from __future__ import annotations

import sys

from .engine import engine_main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.e2e.standin JOB.json")
    sys.exit(engine_main(sys.argv[1]))
