"""Trust groups in the key (keys-v1.md §12): the real policy parser, a real store and
server over a real Unix socket, the real client."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from kvoffload.client import SidecarClient
from kvoffload.contract import CompatContract
from kvoffload.errors import KeyDerivationError, PolicyError
from kvoffload.keys import chunk_keys, group_salt, root_key
from kvoffload.protocol import fake_salt
from kvoffload.sidecar.access.policy import Grant, Policy, TenantPolicy
from kvoffload.sidecar.access.policy_file import parse_policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.staging import PAGE
from tests.conftest import make_contract
from tests.helpers.server import ServerThread

SECRET = b"\x5a" * 32
SALT = bytes(range(32))
TOKENS = list(range(1000, 1000 + 4 * 16))


def test_no_group_derives_exactly_as_before() -> None:
    assert group_salt(SALT, None) == SALT


def test_group_salt_is_the_specified_blake2b() -> None:
    """The derivation of keys-v1.md §12, byte for byte."""
    want = hashlib.blake2b(b"\x04prod", digest_size=32, key=SALT, person=b"kvo-tgrp-v1").digest()
    assert group_salt(SALT, "prod") == want


def test_same_tokens_same_contract_different_groups_give_disjoint_keys() -> None:
    c = make_contract(block_size=16, chunk_tokens=16)
    sets = {
        g: chunk_keys(c, group_salt(SALT, g), TOKENS) for g in (None, "prod", "research", "prod2")
    }
    flat = [k for keys in sets.values() for k in keys]
    assert len(flat) == len(set(flat)) == 4 * 4
    # the roots too: nothing to probe at any depth
    roots = {root_key(c.fingerprint(), group_salt(SALT, g)) for g in sets}
    assert len(roots) == 4


def test_group_labels_are_length_prefixed() -> None:
    """No two labels share an encoding (``ab`` vs ``a`` + ``b`` cannot line up)."""
    labels = ["a", "ab", "a.b", "b", "A"]
    assert len({group_salt(SALT, g) for g in labels}) == len(labels)
    with pytest.raises(KeyDerivationError):
        group_salt(SALT, "x" * 256)


# -- the policy ---------------------------------------------------------------------

GOOD = """
version = 1
[tenants.alice]
trust_group = "research"
[tenants.bob]
trust_group = "research"
[tenants.pool]
trust_group = "research"
share_prefixes = true
[tenants.carol]
trust_group = "prod"
[[grants]]
uid = 1001
tenants = ["alice", "bob", "pool"]
[[grants]]
uid = 1002
tenants = ["carol"]
[[grants]]
uid = 0
tenants = ["*"]
"""


def test_policy_reads_share_prefixes() -> None:
    pol = parse_policy(GOOD)
    assert pol.tenant("pool").share_prefixes and pol.tenant("pool").trust_group == "research"
    assert not pol.tenant("alice").share_prefixes


@pytest.mark.parametrize(
    ("edit", "line", "words"),
    [
        (  # sharing without a group
            ('[tenants.pool]\ntrust_group = "research"\n', "[tenants.pool]\n"),
            8,
            "needs a trust_group",
        ),
        (  # two shared tenants in one group
            (
                '[tenants.bob]\ntrust_group = "research"\n',
                '[tenants.bob]\ntrust_group = "research"\nshare_prefixes = true\n',
            ),
            10,  # the second one named
            "already has a shared tenant",
        ),
        (  # a grant mixing the shared tenant with another group's tenant
            ('tenants = ["alice", "bob", "pool"]', 'tenants = ["alice", "pool", "carol"]'),
            14,
            "outside that group",
        ),
        (  # ... or with a tenant of no group
            ('tenants = ["alice", "bob", "pool"]', 'tenants = ["pool", "loner"]'),
            14,
            "'loner' outside that group",
        ),
        (
            ("share_prefixes = true", 'share_prefixes = "yes"'),
            9,
            "true or false",
        ),
        (
            ("[tenants.alice]\n", "[defaults]\nshare_prefixes = true\n[tenants.alice]\n"),
            4,
            "per tenant",
        ),
    ],
)
def test_policy_refuses_sharing_that_crosses_groups(
    edit: tuple[str, str], line: int, words: str
) -> None:
    text = GOOD.replace(*edit, 1)
    assert text != GOOD
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "policy.toml")
    msg = str(info.value)
    assert words in msg
    assert f"policy.toml:{line}" in msg


# -- the salts handed out ----------------------------------------------------------------


def _policy(me_tenants: frozenset[str], groups: dict[str, str | None]) -> Policy:
    tenants = {t: TenantPolicy(trust_group=g) for t, g in groups.items()}
    return Policy(tenants=tenants, grants=[Grant("uid", os.getuid(), me_tenants)])


def _serve(sock_dir: Path, store: Any, policy: Policy) -> ServerThread:
    cfg = ServerConfig(socket_path=sock_dir / "kvo.sock", secret=SECRET, workers=2)
    return ServerThread(store, policy, cfg)


def _path(st: ServerThread) -> Path:
    assert st.server.config.socket_path is not None
    return st.server.config.socket_path


def test_hello_hands_out_the_group_bound_salt_and_never_another_groups(
    sock_dir: Path, store: Any
) -> None:
    groups = {"alice": "research", "carol": "prod", "plain": None}
    st = _serve(sock_dir, store, _policy(frozenset({"alice", "plain"}), groups))
    try:
        with SidecarClient(_path(st), "alice", staging_bytes=4 * PAGE) as c:
            assert c.salt == group_salt(store.tenant_salt("alice"), "research")
            assert c.salt != store.tenant_salt("alice")
        with SidecarClient(_path(st), "plain", staging_bytes=4 * PAGE) as c:
            assert c.salt == store.tenant_salt("plain")  # unchanged without a group
        # carol (group prod) is not granted: the stable fake salt, unrelated to hers
        with SidecarClient(_path(st), "carol", staging_bytes=4 * PAGE) as c:
            assert c.salt == fake_salt(SECRET, "carol")
            assert c.salt not in (
                store.tenant_salt("carol"),
                group_salt(store.tenant_salt("carol"), "prod"),
            )
    finally:
        st.stop()


def test_a_tenant_moved_to_another_group_misses_never_hits(
    sock_dir: Path, store: Any, contract: CompatContract
) -> None:
    """Chunks stored under group A are misses once the tenant is in group B."""
    n = contract.chunk_tokens
    tokens = list(range(7, 7 + 2 * n))
    st = _serve(sock_dir, store, _policy(frozenset({"acme"}), {"acme": "a"}))
    try:
        with SidecarClient(_path(st), "acme", staging_bytes=64 * PAGE) as c:
            assert c.salt is not None
            keys = chunk_keys(contract, c.salt, tokens)
            stored = c.save(contract.fingerprint(), [(k, [os.urandom(100)]) for k in keys])
            assert stored == [True, True]
            assert c.lookup(keys) == 2
        st.server.policy = _policy(frozenset({"acme"}), {"acme": "b"})
        with SidecarClient(_path(st), "acme", staging_bytes=64 * PAGE) as c:
            assert c.salt is not None
            moved = chunk_keys(contract, c.salt, tokens)
            assert set(moved).isdisjoint(keys)
            assert c.lookup(moved) == 0
    finally:
        st.stop()
