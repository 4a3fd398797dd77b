"""A canonical hash of a tokenizer, for the contract's ``tokenizer_hash``.

Two engines may reuse each other's KV only if they tokenize alike. A path or
hub id does not say that (the same files under two paths, or two revisions
under one name), so this hashes what decides tokenization: the vocabulary,
merges and model files, the special tokens and the tokenizer's settings.

Canonical: JSON files are parsed and re-encoded with sorted keys and no
whitespace, so key order and formatting do not change the hash; files that
do not decide tokenization (``chat_template.jinja``: the contract's
``chat_template_version`` covers templates; README, weights) are not read.
Standard library only (a worker calls it at start).

    kvoffload tokenizer-hash /models/llama-3.1-8b-instruct
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "tokenizer_hash"]

#: Files that decide tokenization (Hugging Face layouts: fast and slow tokenizers).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
#: tokenizer_config.json keys that name the chat template, not the tokenization.
_TEMPLATE_KEYS = ("chat_template",)
_PREFIX = "tok-b2-"


def _canonical(name: str, data: bytes) -> bytes:
    if not name.endswith(".json"):
        return data
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return data  # hashed as it is: still deterministic
    if name == "tokenizer_config.json" and isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in _TEMPLATE_KEYS}
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tokenizer_hash(path: str | os.PathLike[str]) -> str:
    """``tok-b2-<32 hex>`` of the tokenizer in directory ``path`` (or of one of its
    files, by one of the names in :data:`TOKENIZER_FILES`).

    Raises FileNotFoundError when there is nothing to hash: no such path, a
    directory without tokenizer files, or a file that is not one (``/etc/passwd``
    would otherwise hash to a "tokenizer" like any other bytes).
    """
    p = Path(path)
    if p.is_file():
        if p.name not in TOKENIZER_FILES:
            raise FileNotFoundError(
                f"{p} is not a tokenizer file (one of {', '.join(TOKENIZER_FILES)}); "
                "or give the tokenizer's directory"
            )
        files = [p]
    elif p.is_dir():
        files = [p / n for n in TOKENIZER_FILES if (p / n).is_file()]
    else:
        raise FileNotFoundError(f"{p}: no such file or directory")
    if not files:
        raise FileNotFoundError(f"{p}: none of {', '.join(TOKENIZER_FILES)}")
    h = hashlib.blake2b(digest_size=16, person=b"kvo-tokenizer")
    for f in sorted(files, key=lambda f: f.name):
        body = _canonical(f.name, f.read_bytes())
        name = f.name.encode()
        h.update(len(name).to_bytes(4, "little") + name)
        h.update(len(body).to_bytes(8, "little") + body)
    return _PREFIX + h.hexdigest()
