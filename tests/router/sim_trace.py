"""A small trace in the Mooncake FAST'25 format for the simulator's tests (a helper module)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_trace(path: Path, n: int = 120) -> Path:
    """Multi-turn sessions in the Mooncake FAST'25 format: later turns extend earlier ones."""
    rng = random.Random(3)
    lines = []
    next_id = 0
    sessions: list[list[int]] = []
    t = 0
    for _ in range(n):
        t += rng.randrange(50, 400)
        if sessions and rng.random() < 0.6:
            s = rng.choice(sessions)
        else:
            s = []
            sessions.append(s)
        for _ in range(rng.randrange(1, 6)):
            s.append(next_id)
            next_id += 1
        tokens = len(s) * 512 - rng.randrange(0, 400)
        lines.append(
            json.dumps(
                {"timestamp": t, "input_length": tokens, "output_length": 20, "hash_ids": list(s)}
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
