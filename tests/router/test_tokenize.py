"""The engine's tokens of OpenAI requests, from a real local tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.router.tokenize import Tokenizer, request_tokens

from .tokenizer_dir import make_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.load(make_tokenizer(tmp_path_factory.mktemp("tok")))


def test_completions_tokenize_with_special_tokens_unless_told(tok: Tokenizer) -> None:
    ids = request_tokens({"prompt": "hello world"}, False, tok)
    assert ids is not None and len(ids) == 3  # <s> hello world
    bare = request_tokens({"prompt": "hello world", "add_special_tokens": False}, False, tok)
    assert bare == ids[1:]


def test_token_id_prompts_pass_as_given(tok: Tokenizer) -> None:
    assert request_tokens({"prompt": [5, 6, 7]}, False, None) == [5, 6, 7]
    assert request_tokens({"prompt": [[5, 6]]}, False, None) == [5, 6]
    assert request_tokens({"prompt": [[5], [6]]}, False, tok) is None  # a batch
    assert request_tokens({"prompt": [True, 1]}, False, tok) is None


def test_chat_renders_the_template_and_adds_no_second_bos(tok: Tokenizer) -> None:
    body = {
        "messages": [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "hello"}]
    }
    ids = request_tokens(body, True, tok)
    text = "<|system|> w1 w2 <|end|> <|user|> hello <|end|> <|assistant|> "
    assert ids == tok.encode_prompt(text, add_special_tokens=False)
    no_gen = request_tokens({**body, "add_generation_prompt": False}, True, tok)
    assert no_gen is not None and ids is not None and no_gen == ids[:-1]
    # A shared system prompt gives a shared token prefix: the router can match it.
    other = request_tokens(
        {"messages": [body["messages"][0], {"role": "user", "content": "world"}]}, True, tok
    )
    assert other is not None and other[:5] == ids[:5]


def test_what_cannot_be_tokenized_exactly_is_none(tok: Tokenizer) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert request_tokens(parts, True, tok) is None
    assert request_tokens({"prompt": "x", "prompt_embeds": "AAAA"}, False, tok) is None
    assert request_tokens({"prompt": "hello"}, False, None) is None
    assert request_tokens({"messages": "hi"}, True, tok) is None


def test_a_missing_tokenizer_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        Tokenizer.load(tmp_path / "nothing-here")
