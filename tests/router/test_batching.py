"""Concurrent prompts tokenized in one Rust batch: each gets the ids it gets alone.

A real byte-level BPE trained here (GPT-2's kind: regex pre-tokenizer, BOS
added) through transformers, and the router's own Rust path beside it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from kvoffload.router.batching import BatchEncoder
from kvoffload.router.tokenize import Tokenizer

from .tokenizer_dir import make_bpe

pytest.importorskip("transformers")

TEXTS = [
    "def f(x):\n    return x  # ünïcode ✓\n",
    "\t\t  trailing  ",
    "",
    "<s> a special token in the text",
    "import os\n\n\nclass A:\n    pass\n" * 40,
    " leading space, then\r\nCRLF",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(make_bpe(tmp_path_factory.mktemp("bpe")))


def test_a_batch_gives_each_text_transformers_ids(tok: Tokenizer) -> None:
    hf: Any = tok._hf
    for special in (True, False):
        want = [hf(t, add_special_tokens=special)["input_ids"] for t in TEXTS]
        assert tok.encode_batch(TEXTS, add_special_tokens=special) == want
        assert [tok.encode_prompt(t, add_special_tokens=special) for t in TEXTS] == want


class Counting:
    """The real tokenizer, recording each batch it is given (and failing when told)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sizes: list[int] = []
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def encode_batch(
        self, texts: list[str], *, add_special_tokens: bool = True, scopes: list[str] | None = None
    ) -> list[list[int]]:
        self.entered.set()
        self.gate.wait()
        self.sizes.append(len(texts))
        if self.fail:
            raise ValueError("tokenizer failed")
        return self.tok.encode_batch(texts, add_special_tokens=add_special_tokens, scopes=scopes)


def test_requests_waiting_together_are_one_batch_and_each_gets_its_own_ids(
    tok: Tokenizer,
) -> None:
    counting = Counting(tok)
    enc = BatchEncoder(counting)
    texts = [f"{t} #{i}" for i in range(8) for t in TEXTS]
    flags = [i % 3 != 0 for i in range(len(texts))]

    async def run() -> list[list[int]]:
        counting.gate.clear()  # the first request holds the thread while the rest queue
        first = enc.encode("warm", True)
        await asyncio.to_thread(counting.entered.wait)
        rest = [enc.encode(t, s) for t, s in zip(texts, flags, strict=True)]
        counting.gate.set()
        await first
        return list(await asyncio.gather(*rest))

    try:
        got = asyncio.run(run())
    finally:
        enc.close()
    want = [tok.encode_prompt(t, add_special_tokens=s) for t, s in zip(texts, flags, strict=True)]
    assert got == want
    # One batch for the first, then one per add_special_tokens value for the 48 queued.
    assert counting.sizes[0] == 1 and sorted(counting.sizes[1:]) == [16, 32]


def test_a_batch_stops_at_its_character_budget(tok: Tokenizer) -> None:
    counting = Counting(tok)
    enc = BatchEncoder(counting, max_chars=100)
    texts = ["a" * 60, "b" * 30, "c" * 20, "d" * 500, "e"]

    async def run() -> list[list[int]]:
        counting.gate.clear()
        first = enc.encode("warm", True)
        await asyncio.to_thread(counting.entered.wait)
        rest = [enc.encode(t, True) for t in texts]
        counting.gate.set()
        await first
        return list(await asyncio.gather(*rest))

    try:
        got = asyncio.run(run())
    finally:
        enc.close()
    assert got == [tok.encode_prompt(t) for t in texts]
    assert counting.sizes == [1, 2, 1, 1, 1]  # 60+30; 20 (+500 is over); 500 alone; 1


def test_a_failing_batch_fails_its_requests_and_the_thread_goes_on(tok: Tokenizer) -> None:
    counting = Counting(tok)
    enc = BatchEncoder(counting)

    async def run() -> list[int]:
        counting.fail = True
        with pytest.raises(ValueError, match="tokenizer failed"):
            await enc.encode("x", True)
        counting.fail = False
        return await enc.encode("x", True)

    try:
        assert asyncio.run(run()) == tok.encode_prompt("x")
    finally:
        enc.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(_submit(enc))


async def _submit(enc: BatchEncoder) -> list[int]:
    return await enc.encode("x", True)


def test_a_cancelled_request_leaves_the_others_theirs(tok: Tokenizer) -> None:
    counting = Counting(tok)
    enc = BatchEncoder(counting)

    async def run() -> list[int]:
        counting.gate.clear()
        gone = enc.encode("gone", True)
        kept = enc.encode("kept", True)
        gone.cancel()
        counting.gate.set()
        return await kept

    try:
        assert asyncio.run(run()) == tok.encode_prompt("kept")
    finally:
        enc.close()


def test_a_slow_tokenizer_without_rust_is_not_batched(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    slow = Tokenizer(AutoTokenizer.from_pretrained(str(make_bpe(tmp_path)), use_fast=True))
    slow._fast = None  # as a tokenizer with no Rust backend loads
    assert not slow.batches
    assert slow.encode_batch(["a b", "c"]) == [slow.encode_prompt("a b"), slow.encode_prompt("c")]
