"""docs/spec/contract-v1.md §5: the written example is what the code computes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvoffload.contract import CompatContract

SPEC = Path(__file__).resolve().parent.parent / "docs" / "spec" / "contract-v1.md"


def _blocks() -> list[str]:
    text = SPEC.read_text(encoding="utf-8").split("## 5. Example", 1)[1]
    return re.findall(r"```(?:json)?\n(.*?)```", text, re.S)


def test_the_spec_example_matches_the_code() -> None:
    given, canonical, fingerprint = _blocks()
    c = CompatContract.from_dict(json.loads(given))
    assert c.canonical_bytes().decode() == "".join(canonical.split("\n"))
    assert c.fingerprint().hex() == fingerprint.strip()


def test_every_encoded_field_is_in_the_spec_table() -> None:
    given = json.loads(_blocks()[0])
    table = SPEC.read_text(encoding="utf-8").split("## 2. Fields", 1)[1].split("## 3.", 1)[0]
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", table))
    d = CompatContract.from_dict(given).to_dict()
    for key, value in d.items():
        assert key in named, key
        if isinstance(value, dict) and key != "rope_config":
            for sub in value:
                assert f"{key}.{sub}" in named, f"{key}.{sub}"
