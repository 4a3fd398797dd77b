"""The engine's token ids of an OpenAI request, from the model's own tokenizer.

As vLLM's OpenAI server does: ``/v1/completions`` tokenizes ``prompt`` with the
tokenizer's special tokens (``add_special_tokens`` true unless the request says
otherwise) or takes it as given when it is a list of token ids;
``/v1/chat/completions`` renders ``messages`` through the model's chat template
(``add_generation_prompt`` true unless ``continue_final_message``) and
tokenizes the text without adding special tokens (the template has them).

The tokenizer is loaded from a local directory only (``local_files_only``);
transformers is imported when one is loaded, never by the decision code.

:class:`PromptHasher` takes the tokenizing (and in processes, the hashing)
off the router's event loop: by default one thread that tokenizes the
prompts of concurrent requests in one Rust batch (:mod:`.batching`: the GIL
released, the texts over Rust's threads), or ``[model] tokenizer_processes``
processes that each load the tokenizer and also hash, so that neither holds
the loop's GIL. A prompt given as token ids is hashed on the loop at once.
A request the router cannot tokenize exactly (multimodal content parts,
``prompt_embeds``, a batch of prompts) gets ``None``: it is routed on load
alone, never credited with cache.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Mapping
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, NamedTuple

from .batching import BatchEncoder
from .hashing import BlockHasher
from .tokencache import SegmentCache

__all__ = [
    "Prompt",
    "PromptHasher",
    "Tokenizer",
    "cache_scope",
    "known_tokens",
    "request_text",
    "request_tokens",
]

#: The request fields that decide its prompt tokens (what goes to a tokenizer process).
_PROMPT_FIELDS = (
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


class Tokenizer:
    """A model's tokenizer: transformers' for the chat template, its Rust core for the ids.

    A fast (``tokenizers``-backed) tokenizer is called on a private copy of its
    Rust tokenizer, as transformers itself calls it (no truncation, no
    padding, its ``split_special_tokens``), skipping the Python layer around
    it: the same ids at about half the CPU. ``encode_batch`` releases the GIL.

    Where the tokenizer's configuration makes it exact, the ids of the
    segments between its added tokens are cached
    (:class:`~kvoffload.router.tokencache.SegmentCache`, up to about ``cache_bytes``
    bytes; 0: none) for the texts given a ``scope``; else
    :attr:`cache_refused` says why not.
    """

    def __init__(self, hf: Any, *, cache_bytes: int = 64 << 20) -> None:
        self._hf = hf
        self._fast: Any = None
        self.cache: SegmentCache | None = None
        self.cache_refused: str | None = "not a fast (tokenizers) tokenizer"
        backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
        if backend is not None:
            from tokenizers import Tokenizer as RustTokenizer

            fast = RustTokenizer.from_str(backend.to_str())
            fast.no_truncation()
            fast.no_padding()
            fast.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
            self._fast = fast
            got = SegmentCache.for_tokenizer(fast, max_bytes=cache_bytes)
            if isinstance(got, str):
                self.cache_refused = got
            else:
                self.cache, self.cache_refused = got, None

    @classmethod
    def load(cls, path: Path, *, cache_bytes: int = 64 << 20) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from exc
        return cls(hf, cache_bytes=cache_bytes)

    @property
    def batches(self) -> bool:
        """Whether :meth:`encode_batch` runs in Rust (with the GIL released): a fast tokenizer."""
        return self._fast is not None

    def encode_batch(
        self,
        texts: list[str],
        *,
        add_special_tokens: bool = True,
        scopes: list[str] | None = None,
    ) -> list[list[int]]:
        """The ids of each text, as :meth:`encode_prompt` gives them.

        Rust's ``encode_batch_fast``: the ids without the offsets (which nothing
        here reads), the texts spread over Rust's threads, the GIL released.
        With ``scopes`` (one per text), through the segment cache where there is
        one: a segment's ids are reused only within its scope.
        """
        if self.cache is not None and scopes is not None:
            return self.cache.encode_batch(texts, add_special_tokens, scopes)
        if self._fast is not None:
            encs = self._fast.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            return [e.ids for e in encs]
        return [self.encode_prompt(t, add_special_tokens=add_special_tokens) for t in texts]

    def encode_prompt(
        self, text: str, *, add_special_tokens: bool = True, scope: str | None = None
    ) -> list[int]:
        if self.cache is not None and scope is not None:
            return self.cache.encode_batch([text], add_special_tokens, [scope])[0]
        if self._fast is not None:
            enc = self._fast.encode_batch_fast([text], add_special_tokens=add_special_tokens)
            fast_ids: list[int] = enc[0].ids
            return fast_ids
        ids: list[int] = self._hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text of ``messages``: what the engine tokenizes, adding nothing."""
        text = self._hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **dict(chat_template_kwargs or {}),
        )
        return str(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode_prompt(text, add_special_tokens=False)


class Prompt(NamedTuple):
    """A prompt as text: what the tokenizer is given, and whether it adds its special tokens."""

    text: str
    special: bool


_INT = frozenset({int})


def _is_token_list(value: object) -> bool:
    # type(), not isinstance(): a JSON true is a bool, and bool is an int. Empty: a list.
    return isinstance(value, list) and set(map(type, value)) <= _INT


def request_text(body: Mapping[str, Any], chat: bool, tokenizer: Tokenizer) -> Prompt | None:
    """The text the engine tokenizes for a request (chat: the rendered template), or None.

    None where the prompt is not one text the router can tokenize exactly
    (token ids, a batch, content parts, ``prompt_embeds``).
    """
    if body.get("prompt_embeds") is not None:
        return None
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        return Prompt(prompt, body.get("add_special_tokens", True) is not False)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str | None):
            return None  # content parts (images, audio) change the engine's hashes
    kwargs = body.get("chat_template_kwargs")
    text = tokenizer.render_chat(
        messages,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        continue_final_message=body.get("continue_final_message", False) is True,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
    )
    return Prompt(text, False)  # the template has the special tokens


def request_tokens(
    body: Mapping[str, Any], chat: bool, tokenizer: Tokenizer | None, scope: str | None = None
) -> list[int] | None:
    """The engine's prompt token ids of an OpenAI request body, or None if not exactly known.

    ``scope``: where the tokenizer's segment cache may reuse ids (:func:`cache_scope`).
    """
    tokens = known_tokens(body, chat)
    if tokens is not None or tokenizer is None:
        return tokens
    text = request_text(body, chat, tokenizer)
    if text is None:
        return None
    return tokenizer.encode_prompt(text.text, add_special_tokens=text.special, scope=scope)


def cache_scope(salt: str | None) -> str:
    """The segment cache's scope of a request: its cache salt (one per tenant), or none.

    A segment tokenized for one salt is never reused for another, so the
    cache can never carry anything from one tenant's requests to another's.
    """
    return "-" if salt is None else "salt:" + salt


def known_tokens(body: Mapping[str, Any], chat: bool) -> list[int] | None:
    """The prompt's token ids where the request gives them (no tokenizer needed)."""
    if chat or body.get("prompt_embeds") is not None:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if _is_token_list(prompt):
        return prompt
    return None


def prompt_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """What of a request body decides its tokens (``prompt_embeds`` only as a flag)."""
    out = {k: body[k] for k in _PROMPT_FIELDS if k in body}
    if body.get("prompt_embeds") is not None:
        out["prompt_embeds"] = True
    return out


_child: tuple[Tokenizer, BlockHasher] | None = None


def _child_init(path: Path, hasher: BlockHasher) -> None:
    global _child
    _child = (Tokenizer.load(path), hasher)


def _child_ready() -> bool:
    return _child is not None


def _child_hashes(
    fields: dict[str, Any], chat: bool, salt: str | None, lora: tuple[str, str] | None
) -> tuple[list[int], int] | None:
    assert _child is not None, "a tokenizer process without its tokenizer"
    tok, hasher = _child
    tokens = request_tokens(fields, chat, tok, cache_scope(salt))
    if tokens is None:
        return None
    return hasher.external_hashes(tokens, cache_salt=salt, lora=lora), len(tokens)


class PromptHasher:
    """A request's engine block hashes and prompt length, computed off the event loop."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        hasher: BlockHasher,
        *,
        processes: int = 0,
        path: Path | None = None,
    ) -> None:
        if processes and path is None:
            raise ValueError("tokenizer processes need the tokenizer's folder")
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.processes = processes if tokenizer is not None else 0
        self.path = path
        self._pool: Executor | None = None
        batches = tokenizer is not None and tokenizer.batches and not self.processes
        self._encoder = BatchEncoder(tokenizer) if tokenizer is not None and batches else None

    async def start(self) -> None:
        """Starts the processes (each loads the tokenizer) and waits until they can work."""
        if not self.processes:
            return
        assert self.path is not None
        self._pool = ProcessPoolExecutor(
            self.processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_child_init,
            initargs=(self.path, self.hasher),
        )
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(loop.run_in_executor(self._pool, _child_ready) for _ in range(self.processes))
        )

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    async def hashes(
        self,
        body: Mapping[str, Any],
        chat: bool,
        salt: str | None,
        lora: tuple[str, str] | None,
    ) -> tuple[list[int], int] | None:
        """``(hashes, n_tokens)``, or None where the prompt's tokens are not exactly known.

        Raises what the tokenizer or its template raises (the caller routes cold).
        """
        tokens = known_tokens(body, chat)
        if tokens is None:
            if self.tokenizer is None:
                return None
            if self._pool is not None:
                return await self._in_process(prompt_fields(body), chat, salt, lora)
            if self._encoder is not None:
                # The chat template renders here (tens of µs); the tokenizing, in a batch.
                text = request_text(body, chat, self.tokenizer)
                if text is None:
                    return None
                tokens = await self._encoder.encode(text.text, text.special, cache_scope(salt))
            else:
                tokens = await asyncio.to_thread(
                    request_tokens, body, chat, self.tokenizer, cache_scope(salt)
                )
                if tokens is None:
                    return None
        return self.hasher.external_hashes(tokens, cache_salt=salt, lora=lora), len(tokens)

    async def _in_process(
        self, fields: dict[str, Any], chat: bool, salt: str | None, lora: tuple[str, str] | None
    ) -> tuple[list[int], int] | None:
        loop = asyncio.get_running_loop()
        pool = self._pool
        assert pool is not None
        try:
            return await loop.run_in_executor(pool, _child_hashes, fields, chat, salt, lora)
        except BrokenProcessPool:
            # A tokenizer process died (out of memory, killed): a fresh pool for the next
            # requests (a thread meanwhile); this one is routed cold by the caller.
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
                await self.start()
            raise
