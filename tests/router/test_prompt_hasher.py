"""Tokenizing and hashing off the event loop: the same ids and hashes as the plain path.

Real tokenizers built locally (a word-level one with a chat template, and a
byte-level BPE trained here like GPT-2's), real ``spawn`` processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvoffload.router.hashing import BlockHasher
from kvoffload.router.tokenize import PromptHasher, Tokenizer, request_tokens

from .tokenizer_dir import make_bpe, make_tokenizer

pytest.importorskip("transformers")

TEXTS = [
    "hello world w1 w2",
    "w3   w4\n\nw5 <|user|> w6",
    "",
    " ".join(f"w{i % 400}" for i in range(900)),
]


@pytest.mark.parametrize("kind", ["wordlevel", "bpe"])
def test_the_rust_path_gives_transformers_ids(tmp_path: Path, kind: str) -> None:
    folder = make_tokenizer(tmp_path) if kind == "wordlevel" else make_bpe(tmp_path)
    tok = Tokenizer.load(folder)
    hf: Any = tok._hf
    texts = [*TEXTS, "def f(x):\n    return x  # ünïcode ✓\n", "\t\t  trailing  "]
    for text in texts:
        for special in (True, False):
            want = hf(text, add_special_tokens=special)["input_ids"]
            assert tok.encode_prompt(text, add_special_tokens=special) == want


def bodies() -> list[tuple[dict[str, Any], bool]]:
    out: list[tuple[dict[str, Any], bool]] = [({"prompt": t}, False) for t in TEXTS]
    out.append(({"prompt": TEXTS[3], "add_special_tokens": False}, False))
    out.append(({"prompt": list(range(100))}, False))
    out.append(({"prompt": "x", "prompt_embeds": "AAAA"}, False))
    out.append(({"messages": [{"role": "user", "content": TEXTS[3]}]}, True))
    out.append(({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, True))
    return out


def test_processes_and_the_thread_hash_as_the_plain_path(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path)
    tok = Tokenizer.load(folder)
    hasher = BlockHasher(16)
    salt, lora = "tenant-salt", ("adapter", "/loras/a")

    def plain(body: dict[str, Any], chat: bool) -> tuple[list[int], int] | None:
        tokens = request_tokens(body, chat, tok)
        if tokens is None:
            return None
        return hasher.external_hashes(tokens, cache_salt=salt, lora=lora), len(tokens)

    async def run(processes: int) -> list[tuple[list[int], int] | None]:
        ph = PromptHasher(tok, hasher, processes=processes, path=folder)
        await ph.start()
        try:
            return list(
                await asyncio.gather(*(ph.hashes(b, chat, salt, lora) for b, chat in bodies()))
            )
        finally:
            ph.close()

    want = [plain(b, chat) for b, chat in bodies()]
    assert want[3] is not None and len(want[3][0]) == 56  # 901 tokens: 56 full blocks
    assert want[-1] is None and want[-3] is None  # image parts, embeddings: not known
    assert asyncio.run(run(0)) == want
    assert asyncio.run(run(2)) == want


def test_a_killed_tokenizer_process_is_replaced(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path)
    tok = Tokenizer.load(folder)

    async def run() -> tuple[list[int], int] | None:
        ph = PromptHasher(tok, BlockHasher(16), processes=1, path=folder)
        await ph.start()
        try:
            pool: Any = ph._pool
            for p in list(pool._processes.values()):
                p.kill()
                p.join()
            with pytest.raises(Exception):  # noqa: B017 - this request is routed cold
                await ph.hashes({"prompt": TEXTS[3]}, False, None, None)
            return await ph.hashes({"prompt": TEXTS[3]}, False, None, None)
        finally:
            ph.close()

    got = asyncio.run(run())
    assert got is not None and got[1] == 901
