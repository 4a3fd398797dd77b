"""An exact cache of the token ids of prompt segments: chat turns repeat whole segments.

A Hugging Face ``tokenizers`` tokenizer first splits its input at the added
tokens that are matched on the raw text (``normalized: false``: the chat
template's special tokens), leftmost-longest; each segment between two of
them is then normalized, pre-tokenized and modelled on its own, and the
post-processor adds its special tokens (BOS, EOS) around the whole. So the
ids of a text are ``prefix + ids(segment 1) + ... + ids(segment n) + suffix``,
and a segment's ids depend on its text and on one thing more: whether it
starts the text (offset 0: Metaspace's ``prepend_scheme: "first"`` adds its
``▁`` there only). A segment that does not start the text always follows an
added token, so it is encoded the same way here: behind one (an *anchor*,
whose id is then dropped).

That holds only where the tokenizer's configuration makes it so, so
:meth:`SegmentCache.for_tokenizer` reads the configuration and refuses (no
cache; the reason in :attr:`SegmentCache.refused`) where it is not sure:

- an added token that strips whitespace around it or must be a single word
  (``lstrip``, ``rstrip``, ``single_word``: it reaches into the segments
  beside it), or with empty content;
- special tokens split like text (``encode_special_tokens``);
- a model, normalizer, pre-tokenizer or post-processor type not known to
  work segment by segment (BPE with dropout is random);
- a post-processor whose added ids are not one fixed prefix and suffix;
- a self-check: texts mixing added tokens and text must encode alike both ways.

Keys are ``(scope, starts the text, segment)``: the caller's scope (the
router's: the request's cache salt) keeps one tenant's segments from ever
answering another's. Bounded by an estimate of the bytes held (the texts, and
the ids as a Python list of ints), least recently used first.
One lock around each batch (the router has one tokenizing thread, or one per process).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["SegmentCache"]

#: Types that work split by split (tokenizers 0.2x).
_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
_NORMALIZERS = {
    "BertNormalizer",
    "Strip",
    "StripAccents",
    "NFC",
    "NFD",
    "NFKC",
    "NFKD",
    "Sequence",
    "Lowercase",
    "Nmt",
    "Precompiled",
    "Replace",
    "Prepend",
    "ByteLevel",
}
_PRE_TOKENIZERS = {
    "BertPreTokenizer",
    "ByteLevel",
    "Delimiter",
    "CharDelimiterSplit",
    "Metaspace",
    "Whitespace",
    "Sequence",
    "Split",
    "Punctuation",
    "WhitespaceSplit",
    "Digits",
    "UnicodeScripts",
    "FixedLength",
}
#: Post-processors that only add fixed ids around a single sequence (ByteLevel: offsets only).
_POST = {"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel", "Sequence"}

#: Texts of the self-check, with ``{0}`` / ``{1}`` two added tokens.
_PROBES = (
    "{0}",
    "{0}{1}",
    "Hello world{0}",
    "{0}system\nYou are helpful.{1}\n{0}user\n  Hi there!  {1}\n{0}assistant\n",
    " leading space{0} after{1}  two spaces\n\n",
    "▁meta space▁ {0}▁x{1}\t tab",
    "ünïcode ✓ 数字 123{0}456{1}{1}end ",
)


def _types(node: Any) -> list[str]:
    """The ``type`` of a component and of every member of a ``Sequence``."""
    if node is None:
        return []
    if not isinstance(node, dict):
        return ["?"]
    out = [str(node.get("type"))]
    for key in ("normalizers", "pretokenizers", "processors"):
        for child in node.get(key) or ():
            out += _types(child)
    return out


def _raw_added(cfg: dict[str, Any]) -> list[tuple[str, int]] | str:
    """The added tokens matched on the raw text (content, id), or why the cache is refused."""
    raw: list[tuple[str, int]] = []
    for t in cfg.get("added_tokens") or ():
        if not t.get("content"):
            return "an added token with empty content"
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return f"added token {t['content']!r} reaches into its neighbours (strip/word)"
        if not t.get("normalized"):
            raw.append((t["content"], int(t["id"])))
    if not raw:
        return "no added tokens matched on the raw text: nothing to split at"
    return raw


def _components_refused(cfg: dict[str, Any]) -> str | None:
    """Why the model, normalizer, pre-tokenizer or post-processor may not work split by split."""
    model = cfg.get("model") or {}
    if model.get("type") not in _MODELS:
        return f"model type {model.get('type')!r}"
    if model.get("dropout"):
        return "BPE dropout (random ids)"
    for name, allowed in (
        ("normalizer", _NORMALIZERS),
        ("pre_tokenizer", _PRE_TOKENIZERS),
        ("post_processor", _POST),
    ):
        bad = [t for t in _types(cfg.get(name)) if t not in allowed]
        if bad:
            return f"{name} type {bad[0]!r}"
    return None


def _cost(key: tuple[str, bool, str], ids: list[int]) -> int:
    """About what an entry holds: its strings, and a list of ids (8 + 32 bytes an int)."""
    return 200 + len(key[0]) + len(key[2]) + 40 * len(ids)


class SegmentCache:
    """The ids of a text from the cached ids of its segments (see the module's docstring)."""

    def __init__(
        self,
        fast: Any,
        splitter: re.Pattern[str],
        anchor: tuple[str, int],
        affixes: dict[bool, tuple[list[int], list[int]]],
        max_bytes: int,
    ) -> None:
        self._fast = fast
        self._split = splitter
        self._anchor, self._anchor_id = anchor
        self._affixes = affixes
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lru: OrderedDict[tuple[str, bool, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, fast: Any, *, max_bytes: int = 64 << 20) -> SegmentCache | str:
        """A cache for a Rust ``tokenizers.Tokenizer``, or why it would not be exact."""
        if max_bytes <= 0:
            return "turned off"
        if getattr(fast, "encode_special_tokens", False):
            return "special tokens are split like text (encode_special_tokens)"
        cfg = json.loads(fast.to_str())
        raw = _raw_added(cfg)
        if isinstance(raw, str):
            return raw
        refused = _components_refused(cfg)
        if refused is not None:
            return refused
        # Leftmost-longest, as tokenizers' Aho-Corasick matches: Python's regex takes the
        # leftmost match, and at one position the first alternative, so longest first.
        contents = sorted({c for c, _ in raw}, key=lambda c: (-len(c), c))
        splitter = re.compile("|".join(map(re.escape, contents)))
        anchor = max(raw, key=lambda r: (len(r[0]), r[0]))
        if fast.encode_batch_fast([anchor[0]], add_special_tokens=False)[0].ids != [anchor[1]]:
            return f"added token {anchor[0]!r} does not encode to its own id"
        affixes: dict[bool, tuple[list[int], list[int]]] = {}
        for special in (True, False):
            got = cls._affixes_of(fast, special)
            if got is None:
                return "the post-processor's ids are not a fixed prefix and suffix"
            affixes[special] = got
        cache = cls(fast, splitter, anchor, affixes, max_bytes)
        second = next((c for c, _ in raw if c != anchor[0]), anchor[0])
        probes = [p.format(anchor[0], second) for p in _PROBES]
        for special in (True, False):
            want = [e.ids for e in fast.encode_batch_fast(probes, add_special_tokens=special)]
            for scope in ("probe", "probe"):  # twice: from the misses, then from the hits
                if cache.encode_batch(probes, special, [scope] * len(probes)) != want:
                    return "the self-check: segment by segment differs from the whole"
        cache.clear()
        return cache

    @staticmethod
    def _affixes_of(fast: Any, special: bool) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after the text's own, the same for two."""
        found = set()
        for text in ("a", "b c 1"):
            bare = fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
            full = fast.encode_batch_fast([text], add_special_tokens=special)[0].ids
            spots = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
            if len(spots) != 1 or not bare:
                return None
            i = spots[0]
            found.add((tuple(full[:i]), tuple(full[i + len(bare) :])))
        if len(found) != 1:
            return None
        pre, suf = found.pop()
        return list(pre), list(suf)

    def clear(self) -> None:
        self._lru.clear()
        self.bytes = self.hits = self.misses = 0

    def segments(self, text: str) -> list[tuple[bool, str]] | None:
        """``(starts the text, segment)`` of ``text``: added tokens and the text between them.

        None for a text without an added token: one segment, most likely never seen again.
        """
        out: list[tuple[bool, str]] = []
        at = 0
        for m in self._split.finditer(text):
            if m.start() > at:
                out.append((at == 0, text[at : m.start()]))
            out.append((m.start() == 0, m.group()))
            at = m.end()
        if not at:
            return None
        if at < len(text):
            out.append((False, text[at:]))
        return out

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool, scopes: list[str]
    ) -> list[list[int]]:
        """The ids of each text, as the tokenizer gives them for the whole text.

        A text without an added token is encoded whole (and not kept).
        """
        with self._lock:
            return self._encode_batch(texts, add_special_tokens, scopes)

    def _encode_batch(
        self, texts: list[str], add_special_tokens: bool, scopes: list[str]
    ) -> list[list[int]]:
        split = [self.segments(t) for t in texts]
        plain = [t for t, segs in zip(texts, split, strict=True) if segs is None]
        encs = self._fast.encode_batch_fast(plain, add_special_tokens=add_special_tokens)
        whole = iter([e.ids for e in encs] if plain else [])
        lru = self._lru
        want: dict[tuple[str, bool, str], None] = {}
        for scope, segs in zip(scopes, split, strict=True):
            for first, seg in segs or ():
                key = (scope, first, seg)
                if key in lru:
                    lru.move_to_end(key)
                else:
                    want[key] = None
        fresh: dict[tuple[str, bool, str], list[int]] = {}
        if want:
            keys = list(want)
            inputs = [seg if first else self._anchor + seg for _, first, seg in keys]
            encs = self._fast.encode_batch_fast(inputs, add_special_tokens=False)
            for key, enc in zip(keys, encs, strict=True):
                ids = enc.ids
                if not key[1]:
                    if not ids or ids[0] != self._anchor_id:
                        raise RuntimeError("the anchor token did not encode to its id")
                    ids = ids[1:]
                fresh[key] = ids
        self.misses += len(fresh)
        pre, suf = self._affixes[add_special_tokens]
        out: list[list[int]] = []
        for scope, segs in zip(scopes, split, strict=True):
            if segs is None:
                out.append(next(whole))
                continue
            ids = list(pre)
            for first, seg in segs:
                key = (scope, first, seg)
                got = fresh.get(key)
                if got is None:
                    got = lru[key]
                    self.hits += 1
                ids += got
            ids += suf
            out.append(ids)
        for key, ids in fresh.items():
            lru[key] = ids
            self.bytes += _cost(key, ids)
        while self.bytes > self.max_bytes and lru:
            key, ids = lru.popitem(last=False)
            self.bytes -= _cost(key, ids)
        return out
