"""The engine's token ids of an OpenAI request, from the model's own tokenizer.

As vLLM's OpenAI server does: ``/v1/completions`` tokenizes ``prompt`` with the
tokenizer's special tokens (``add_special_tokens`` true unless the request says
otherwise) or takes it as given when it is a list of token ids;
``/v1/chat/completions`` renders ``messages`` through the model's chat template
(``add_generation_prompt`` true unless ``continue_final_message``) and
tokenizes the text without adding special tokens (the template has them).

The tokenizer is loaded from a local directory only (``local_files_only``);
transformers is imported when one is loaded, never by the decision code.
A request the router cannot tokenize exactly (multimodal content parts,
``prompt_embeds``, a batch of prompts) gets ``None``: it is routed on load
alone, never credited with cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "request_tokens"]


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self._hf = hf

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from exc
        return cls(hf)

    def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self._hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **dict(chat_template_kwargs or {}),
        )
        return self.encode_prompt(str(text), add_special_tokens=False)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def request_tokens(
    body: Mapping[str, Any], chat: bool, tokenizer: Tokenizer | None
) -> list[int] | None:
    """The engine's prompt token ids of an OpenAI request body, or None if not exactly known."""
    if body.get("prompt_embeds") is not None:
        return None
    if not chat:
        prompt = body.get("prompt")
        if _is_token_list(prompt):
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
            if _is_token_list(prompt):
                return list(prompt)
        if not isinstance(prompt, str) or tokenizer is None:
            return None
        return tokenizer.encode_prompt(
            prompt, add_special_tokens=body.get("add_special_tokens", True) is not False
        )
    messages = body.get("messages")
    if tokenizer is None or not isinstance(messages, list):
        return None
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str | None):
            return None  # content parts (images, audio) change the engine's hashes
    kwargs = body.get("chat_template_kwargs")
    return tokenizer.encode_chat(
        messages,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        continue_final_message=body.get("continue_final_message", False) is True,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
    )
