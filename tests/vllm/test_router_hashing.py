"""The router's block hashes equal vLLM 0.33's own, computed by vLLM's functions.

vLLM's ``get_request_block_hasher`` over a real ``vllm.v1.request.Request``
(its ``init_none_hash`` seeded as the engine seeds it) against
:class:`kvoffload.router.hashing.BlockHasher`: every algorithm, with and
without ``cache_salt`` and LoRA, and the 64-bit form KV events publish
(``maybe_convert_block_hash``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvoffload.router.hashing import BlockHasher, cbor_canonical, external_hash

pytestmark = pytest.mark.vllm


@pytest.fixture
def seeded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process-wide NONE_HASH is vLLM state: restore it after each test."""
    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    yield
    if saved is not None:
        kv_cache_utils.NONE_HASH = saved


def vllm_hashes(
    tokens: list[int],
    algo: str,
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora: LoRARequest | None = None,
) -> list[bytes]:
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, fn)
    req = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=lora,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )
    return [bytes(h) for h in req.block_hashes]


TOKENS = [random.Random(7).randrange(128_000) for _ in range(16 * 37 + 5)]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("salt", [None, "tenant-a/5f2c"])
def test_hashes_equal_vllms(
    seeded: None, monkeypatch: pytest.MonkeyPatch, algo: str, block_size: int, salt: str | None
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    want = vllm_hashes(TOKENS, algo, block_size, cache_salt=salt)
    got = BlockHasher(block_size, algo).block_hashes(TOKENS, cache_salt=salt)
    assert len(got) == len(TOKENS) // block_size
    assert got == want
    assert [external_hash(h) for h in got] == [
        kv_cache_utils.maybe_convert_block_hash(h) for h in want
    ]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_lora_and_salt_together_equal_vllms(seeded: None, algo: str) -> None:
    lora = LoRARequest("sql-adapter", 3, "/adapters/sql")
    want = vllm_hashes(TOKENS, algo, 16, cache_salt="s", lora=lora)
    got = BlockHasher(16, algo).block_hashes(
        TOKENS, cache_salt="s", lora=("sql-adapter", "/adapters/sql")
    )
    assert got == want
    # Another adapter path under the same name is another KV.
    other = BlockHasher(16, algo).block_hashes(
        TOKENS, cache_salt="s", lora=("sql-adapter", "/adapters/sql-v2")
    )
    assert set(other).isdisjoint(want)


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "xxhash_cbor"])
def test_a_shared_pythonhashseed_is_honoured(
    seeded: None, monkeypatch: pytest.MonkeyPatch, algo: str
) -> None:
    pytest.importorskip("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    want = vllm_hashes(TOKENS, algo, 16, cache_salt="t")
    assert BlockHasher(16, algo, seed="1234").block_hashes(TOKENS, cache_salt="t") == want


def test_canonical_cbor_equals_cbor2() -> None:
    import cbor2

    samples = [
        (b"\x00" * 32, tuple(TOKENS[:16]), None),
        (b"\x01" * 32, (0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**63), (("cache_salt", "ü"),)),
        ("vllm-none-hash",),
        (b"", (), (("lora", "a", "/p"), ("cache_salt", "x"))),
    ]
    for obj in samples:
        assert cbor_canonical(obj) == cbor2.dumps(obj, canonical=True)
