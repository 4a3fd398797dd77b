"""Regenerate the golden files of layout v1 under tests/data/v1/.

Run only when the format changes on purpose (and bump the layout version):
the golden files exist to make an accidental change fail the tests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.layouts import v1

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "v1"

DEK = bytes(range(32))
TENANT = "golden-tenant"
NAMESPACE = hashlib.blake2b(b"golden-namespace", digest_size=32).digest()
CHUNK_KEY = hashlib.blake2b(b"golden-chunk", digest_size=32).digest()
CREATED_NS = 1_790_000_000_000_000_000
LAYER_SIZES = (100, 4096, 5000)


def layers() -> list[bytes]:
    return [bytes((i * 31 + j * 7) & 0xFF for j in range(n)) for i, n in enumerate(LAYER_SIZES)]


def counter_nonces() -> object:
    state = {"n": 0}

    def nonce(size: int) -> bytes:
        state["n"] += 1
        return state["n"].to_bytes(size, "little")

    return nonce


def build(sealed: bool) -> bytes:
    size = v1.object_size(LAYER_SIZES, sealed)
    buf = bytearray(size)
    v1.seal_into(
        memoryview(buf),
        tenant=TENANT,
        namespace=NAMESPACE,
        chunk_key=CHUNK_KEY,
        layers=layers(),
        aead=AESGCM(DEK) if sealed else None,
        key_epoch=7 if sealed else 0,
        created_ns=CREATED_NS,
        nonce_source=counter_nonces(),  # type: ignore[arg-type]
    )
    return bytes(buf)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sealed.kvo").write_bytes(build(True))
    (OUT / "plain.kvo").write_bytes(build(False))
    layout = {
        "created": "2026-11-30T00:00:00+00:00",
        "layout_version": 1,
        "params": v1.default_params(),
        "store_id": "00000000-0000-4000-8000-000000000001",
    }
    (OUT / "layout.json").write_text(json.dumps(layout, indent=2, sort_keys=True) + "\n")
    # A root made before params.fanout was read (two levels): still readable.
    old = {**layout, "params": {**layout["params"], "fanout": list(v1.FANOUT_TWO_LEVELS)}}
    (OUT / "layout-fanout-2-2.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    print(f"wrote golden files to {OUT}")


if __name__ == "__main__":
    main()
