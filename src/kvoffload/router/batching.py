"""Tokenizing the prompts of concurrent requests together, off the event loop.

One thread takes every prompt waiting when it is free and tokenizes them in
one Rust ``encode_batch_fast`` call per ``add_special_tokens`` value: the GIL
is released for the whole batch, the texts are spread over Rust's threads
(every core of the router's host), and the loop pays one wake-up per batch
instead of a thread hand-off per request. A batch is whatever queued while
the previous one was tokenized, so a lone request waits for nobody.

A batch's ids are the ids each text gets alone (``tests/router/test_batching.py``
holds that on a real byte-level BPE): a tokenizer works text by text.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Protocol

__all__ = ["BatchEncoder", "Encodes"]


class Encodes(Protocol):
    def encode_batch(
        self,
        texts: list[str],
        *,
        add_special_tokens: bool = True,
        scopes: list[str] | None = None,
    ) -> list[list[int]]: ...


#: A text, whether its special tokens are added, its cache scope, and its answer.
_Item = tuple[str, bool, str | None, "asyncio.Future[list[int]]"]


class BatchEncoder:
    """A thread tokenizing, in batches, the texts submitted from event loops."""

    def __init__(
        self, tokenizer: Encodes, *, max_batch: int = 64, max_chars: int = 1 << 20
    ) -> None:
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        #: A batch is answered when its last text is: short prompts are not kept
        #: behind more than about this much text (a long one alone goes as it is).
        self.max_chars = max_chars
        self.batches = 0
        self._cv = threading.Condition()
        self._queue: list[_Item] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def encode(
        self, text: str, add_special_tokens: bool, scope: str | None = None
    ) -> asyncio.Future[list[int]]:
        """A future of ``text``'s ids, settled on the calling loop.

        ``scope``: where the tokenizer may reuse cached ids (none: not cached).
        """
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the tokenizer thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvoffload-tokenize", daemon=True
                )
                self._thread.start()
            self._queue.append((text, add_special_tokens, scope, fut))
            if len(self._queue) == 1:
                self._cv.notify()
        return fut

    def close(self) -> None:
        """Stops the thread after the texts already queued."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                take, chars = 0, 0
                for text, _, _, _ in self._queue:  # up to max_batch texts, max_chars characters
                    if take == self.max_batch or (take and chars + len(text) > self.max_chars):
                        break
                    take += 1
                    chars += len(text)
                batch = self._queue[:take]
                del self._queue[:take]
            self.batches += 1
            for special in (True, False):
                items = [it for it in batch if it[1] is special]
                if items:
                    self._encode(items, special)

    def _encode(self, items: list[_Item], special: bool) -> None:
        try:
            scopes = [it[2] for it in items if it[2] is not None]
            ids = self.tokenizer.encode_batch(
                [it[0] for it in items],
                add_special_tokens=special,
                scopes=scopes if len(scopes) == len(items) else None,
            )
            failed: BaseException | None = None
        except Exception as exc:  # the requests are routed cold; the thread goes on
            ids, failed = [], exc
        by_loop: dict[asyncio.AbstractEventLoop, list[int]] = {}
        for i, it in enumerate(items):
            by_loop.setdefault(it[3].get_loop(), []).append(i)
        for loop, idx in by_loop.items():
            futs = [items[i][3] for i in idx]
            got = [ids[i] for i in idx] if failed is None else None
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these
                loop.call_soon_threadsafe(_settle, futs, got, failed)


def _settle(
    futs: list[asyncio.Future[list[int]]], ids: list[list[int]] | None, failed: BaseException | None
) -> None:
    for i, fut in enumerate(futs):
        if fut.done():  # cancelled: the client went away
            continue
        if ids is not None:
            fut.set_result(ids[i])
        else:
            fut.set_exception(failed or RuntimeError("tokenizing failed"))
