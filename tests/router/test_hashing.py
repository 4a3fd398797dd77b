"""The router's block hashing: chained, salted, LoRA-keyed, and as events name the blocks.

The byte-for-byte check against vLLM's own functions is in the vLLM tier
(tests/vllm/test_router_hashing.py); these check the properties that hold
whatever the engine, with independent computations of the expected values.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest

from kvoffload.router.hashing import BlockHasher, cbor_canonical, external_hash, hash_function


def test_first_block_is_sha256_of_the_pickled_triple_rooted_in_the_default_seed() -> None:
    h = BlockHasher(block_size=4)
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    want = hashlib.sha256(pickle.dumps((none, (1, 2, 3, 4), None), protocol=5)).digest()
    assert h.block_hashes([1, 2, 3, 4, 5]) == [want]  # the partial tail has no hash


def test_hashes_chain_so_a_block_names_its_whole_prefix() -> None:
    h = BlockHasher(block_size=2)
    a = h.block_hashes([1, 2, 3, 4])
    b = h.block_hashes([9, 9, 3, 4])
    assert a[0] != b[0] and a[1] != b[1]
    assert h.block_hashes([1, 2, 3, 4, 5, 6])[:2] == a


def test_cache_salt_enters_the_first_block_only_and_changes_every_hash() -> None:
    h = BlockHasher(block_size=2)
    plain = h.block_hashes([1, 2, 3, 4])
    salted = h.block_hashes([1, 2, 3, 4], cache_salt="tenant-a")
    other = h.block_hashes([1, 2, 3, 4], cache_salt="tenant-b")
    assert len({plain[0], salted[0], other[0]}) == 3
    assert len({plain[1], salted[1], other[1]}) == 3
    assert h.extra_keys(0, cache_salt="s", lora=None) == (("cache_salt", "s"),)
    assert h.extra_keys(1, cache_salt="s", lora=None) is None


def test_lora_name_and_path_enter_every_block() -> None:
    h = BlockHasher(block_size=2)
    assert h.extra_keys(3, cache_salt=None, lora=("sql", "/a")) == (("lora", "sql", "/a"),)
    assert h.extra_keys(0, cache_salt="s", lora=("sql", "/a")) == (
        ("lora", "sql", "/a"),
        ("cache_salt", "s"),
    )
    base = h.block_hashes([1, 2, 3, 4])
    a = h.block_hashes([1, 2, 3, 4], lora=("sql", "/a"))
    b = h.block_hashes([1, 2, 3, 4], lora=("sql", "/b"))
    assert len({base[1], a[1], b[1]}) == 3


def test_seed_changes_the_root() -> None:
    assert BlockHasher(block_size=2, seed="42").block_hashes([1, 2]) != BlockHasher(
        block_size=2
    ).block_hashes([1, 2])


def test_xxhash_without_a_seed_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        BlockHasher(algorithm="xxhash")
    assert len(BlockHasher(algorithm="xxhash_cbor", seed="7").block_hashes(list(range(32)))) == 2


def test_unknown_algorithm_and_bad_block_size_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm"):
        BlockHasher(algorithm="md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size=0)


def test_external_hash_is_the_low_64_bits_big_endian() -> None:
    raw = bytes(range(32))
    assert external_hash(raw) == int.from_bytes(raw[-8:], "big")
    assert external_hash(1 << 70 | 5) == 5
    h = BlockHasher(block_size=2)
    assert h.external_hashes([1, 2]) == [external_hash(h.block_hashes([1, 2])[0])]


@pytest.mark.parametrize(
    ("obj", "encoded"),
    [
        # RFC 8949 appendix A vectors, and the shapes a block-hash triple holds.
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (-1, "20"),
        (-1000, "3903e7"),
        (b"\x01\x02", "420102"),
        ("a", "6161"),
        ("ü", "62c3bc"),
        (None, "f6"),
        (True, "f5"),
        ((1, (2, 3)), "8201820203"),
        ([], "80"),
    ],
)
def test_cbor_canonical_matches_rfc_8949_vectors(obj: object, encoded: str) -> None:
    assert cbor_canonical(obj).hex() == encoded


def test_cbor_refuses_what_a_block_hash_never_holds() -> None:
    with pytest.raises(TypeError):
        cbor_canonical(1.5)
    with pytest.raises(TypeError):
        cbor_canonical(1 << 65)


def test_cbor_algorithm_hashes_the_cbor_bytes() -> None:
    fn = hash_function("sha256_cbor")
    assert (
        fn((b"x", (1,), None)) == hashlib.sha256(bytes.fromhex("834178" + "8101" + "f6")).digest()
    )
