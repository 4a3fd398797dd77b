"""Record the golden protocol frames: tests/data/frames/frames.json.

Run it only when the wire is meant to change (a new optional key, a new verb),
then review the diff of frames.json: every changed frame is a wire change.

    .venv/bin/python scripts/record_frames.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.protocol.test_protocol_frames import FRAMES_FILE, encode_catalogue  # noqa: E402


def main() -> int:
    doc = {
        "about": "protocol v1 frames (u32 LE length + msgpack body), hex; "
        "see tests/protocol/test_protocol_frames.py",
        "frames": dict(sorted(encode_catalogue().items())),
    }
    FRAMES_FILE.parent.mkdir(parents=True, exist_ok=True)
    FRAMES_FILE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['frames'])} frames written to {FRAMES_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
