"""The segment cache gives exactly the ids of the whole text, or is refused.

Real tokenizers trained here (no hub), each with a chat template, of the
kinds whose configuration decides exactness: byte-level BPE (GPT-2/Llama 3:
regex pre-tokenizer, with and without ``add_prefix_space``), Metaspace with
``prepend_scheme: "first"`` (Llama/Mistral/Gemma conversions: the ``▁`` only
at the start of the text), a Llama-2-style ``Prepend`` normalizer, and the
word-level one the other router tests use. Each prompt is compared with
the tokenizer's own encode of the whole text, as misses and again as hits.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvoffload.router.tokencache import SegmentCache
from kvoffload.router.tokenize import PromptHasher, Tokenizer, cache_scope

from .tokenizer_dir import make_bpe, make_tokenizer

pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = [
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im",  # a prefix of another: leftmost-longest decides
]


def corpus() -> list[str]:
    here = Path(__file__).parent
    lines: list[str] = []
    for p in sorted(here.glob("*.py"))[:8]:
        lines += p.read_text(encoding="utf-8").splitlines()
    lines += ["ünïcode ✓ 数字 123 — naïve café", "  two  spaces\tand\ttabs  ", "▁ meta ▁▁"]
    return lines


def build(folder: Path, kind: str) -> Path:
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind.startswith("bytelevel"):
        tok = Rust(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind.endswith("prefix"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "metaspace-first":
        tok = Rust(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    elif kind == "metaspace-unigram":
        tok = Rust(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    elif kind == "prepend":  # Llama 2's fast tokenizer: ▁ before each segment, no pre-tokenizer
        tok = Rust(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        raise ValueError(kind)
    if kind == "metaspace-unigram":
        trainer: Any = trainers.UnigramTrainer(
            vocab_size=400, special_tokens=["<unk>", *SPECIALS], unk_token="<unk>"
        )
    else:
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", *SPECIALS])
    tok.train_from_iterator(corpus(), trainer)
    if kind in ("prepend", "bytelevel-prefix"):
        # Added tokens that are not special: matched on the normalized text, inside segments.
        tok.add_tokens(["hello", "ü", "x<|"])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    single = "<s> $A </s>" if kind == "metaspace-first" else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    template = LLAMA if kind in ("bytelevel", "prepend") else CHATML
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": template,
            }
        ),
        encoding="utf-8",
    )
    return folder


KINDS = ["bytelevel", "bytelevel-prefix", "metaspace-first", "metaspace-unigram", "prepend"]


@pytest.fixture(scope="module", params=KINDS)
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(build(tmp_path_factory.mktemp(request.param), request.param))


def conversations(rng: random.Random) -> list[list[dict[str, str]]]:
    """Growing chats (each turn repeats the earlier ones), with awkward contents."""
    words = corpus()
    pieces = ["", " ", "  ", "\n", "\n\n", "\t", "▁", " <|im", "<|im_end|>x", "<s>", "数字 "]
    out = []
    for _ in range(6):
        chat: list[dict[str, str]] = [{"role": "system", "content": rng.choice(words)}]
        for turn in range(5):
            content = rng.choice(pieces) + " ".join(rng.sample(words, 3)) + rng.choice(pieces)
            chat.append({"role": "user" if turn % 2 == 0 else "assistant", "content": content})
            out.append(list(chat))
    return out


def raw_texts(rng: random.Random) -> list[str]:
    """Texts mixing added tokens and text at any position, touching or not."""
    parts = [*SPECIALS, "a", " b", "  ", "\n", "▁x", "hello world", "ü", "", "<|", "im_end|>"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, 9))) for _ in range(300)]


def test_the_cache_gives_the_ids_of_the_whole_text(tok: Tokenizer) -> None:
    assert tok.cache is not None, tok.cache_refused
    rust: Any = tok._fast
    rng = random.Random(7)
    texts = [tok.render_chat(c) for c in conversations(rng)] + raw_texts(rng)
    for special in (True, False):
        want = [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=special)]
        for _ in range(2):  # misses, then hits
            got = tok.encode_batch(texts, add_special_tokens=special, scopes=["t"] * len(texts))
            assert got == want
        one = [tok.encode_prompt(t, add_special_tokens=special, scope="u") for t in texts]
        assert one == want
    assert tok.cache.hits > tok.cache.misses  # later turns reuse the earlier turns' segments


def test_the_transformers_ids_too(tok: Tokenizer) -> None:
    """What the engine gets: transformers' tokenizer on the rendered chat."""
    hf: Any = tok._hf
    for chat in conversations(random.Random(3))[:10]:
        text = tok.render_chat(chat)
        want = hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode_batch([text], add_special_tokens=False, scopes=["s"]) == [want]


def test_a_segment_is_reused_only_within_its_scope(tmp_path: Path) -> None:
    tok = Tokenizer.load(build(tmp_path / "t", "bytelevel"))
    cache = tok.cache
    assert cache is not None
    text = "<s><|start_header_id|>system<|end_header_id|>\n\nsecret prompt<|eot_id|>"
    tok.encode_batch([text], add_special_tokens=False, scopes=[cache_scope("tenant-a")])
    misses = cache.misses
    tok.encode_batch([text], add_special_tokens=False, scopes=[cache_scope("tenant-a")])
    assert cache.misses == misses  # all hits
    tok.encode_batch([text], add_special_tokens=False, scopes=[cache_scope("tenant-b")])
    assert cache.misses == 2 * misses  # nothing of tenant a's answered tenant b
    tok.encode_batch([text], add_special_tokens=False, scopes=[cache_scope(None)])
    assert cache.misses == 3 * misses


def test_the_cache_is_bounded(tmp_path: Path) -> None:
    tok = Tokenizer.load(build(tmp_path / "t", "bytelevel"), cache_bytes=2000)
    assert tok.cache is not None
    for i in range(50):
        tok.encode_batch([f"<s>turn {i} " + "x" * 30], add_special_tokens=False, scopes=["a"])
    assert 0 < tok.cache.bytes <= 2000


def _refused(folder: Path, edit: Any, *, same_ids: bool = True) -> str:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    tok = Tokenizer.load(folder)
    assert tok.cache is None
    assert tok.cache_refused is not None
    if not same_ids:  # random ids (dropout): nothing to compare
        return tok.cache_refused
    # Still the right ids, the whole text at a time.
    text = "<s>a<|im_end|> b"
    rust: Any = tok._fast
    want = rust.encode_batch_fast([text], add_special_tokens=True)[0].ids
    assert tok.encode_batch([text], scopes=["a"]) == [want]
    return tok.cache_refused


def test_refused_where_a_token_strips_its_neighbours(tmp_path: Path) -> None:
    def lstrip(data: dict[str, Any]) -> None:
        data["added_tokens"][3]["lstrip"] = True

    assert "strip" in _refused(build(tmp_path / "t", "bytelevel"), lstrip)


def test_refused_for_bpe_dropout(tmp_path: Path) -> None:
    def dropout(data: dict[str, Any]) -> None:
        data["model"]["dropout"] = 0.1

    assert "dropout" in _refused(build(tmp_path / "t", "bytelevel"), dropout, same_ids=False)


def test_refused_where_special_tokens_are_split_like_text(tmp_path: Path) -> None:
    folder = build(tmp_path / "t", "bytelevel")
    from tokenizers import Tokenizer as Rust

    rust = Rust.from_file(str(folder / "tokenizer.json"))
    rust.encode_special_tokens = True
    assert "encode_special_tokens" in str(SegmentCache.for_tokenizer(rust))


def test_refused_without_added_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Rust

    folder = build(tmp_path / "t", "bytelevel")
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["added_tokens"], data["post_processor"] = [], None
    rust = Rust.from_str(json.dumps(data))
    assert "nothing to split" in str(SegmentCache.for_tokenizer(rust))


def test_the_word_level_and_bpe_tokenizers_of_the_other_tests(tmp_path: Path) -> None:
    for folder in (make_tokenizer(tmp_path / "w"), make_bpe(tmp_path / "b")):
        tok = Tokenizer.load(folder)
        assert tok.cache is not None, tok.cache_refused
        rust: Any = tok._fast
        texts = [*raw_texts(random.Random(11)), "<|user|> hello w1 <|end|> <|assistant|> w2"]
        for special in (True, False):
            want = [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=special)]
            for _ in range(2):
                got = tok.encode_batch(texts, add_special_tokens=special, scopes=["x"] * len(texts))
                assert got == want


def test_the_prompt_hasher_caches_per_salt(tmp_path: Path) -> None:
    from kvoffload.router.hashing import BlockHasher

    tok = Tokenizer.load(build(tmp_path / "t", "bytelevel"))
    cache = tok.cache
    assert cache is not None
    body = {"messages": [{"role": "system", "content": "a long shared system prompt " * 4}]}

    async def run() -> list[tuple[tuple[list[int], int] | None, int]]:
        ph = PromptHasher(tok, BlockHasher(4))
        try:
            out = []
            for salt in ("salt-a", "salt-a", "salt-b"):
                out.append((await ph.hashes(body, True, salt, None), cache.misses))
            return out
        finally:
            ph.close()

    (a1, m1), (a2, m2), (b1, m3) = asyncio.run(run())
    assert a1 == a2 and m2 == m1  # the same salt: every segment a hit
    assert m3 > m2  # another salt: tokenized afresh
    assert a1 is not None and b1 is not None and a1[1] == b1[1] and a1[0] != b1[0]
