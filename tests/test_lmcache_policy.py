"""The LMCache adapter's decisions that need no LMCache: settings, tenants, identity."""

from __future__ import annotations

import pytest

from kvoffload.contract import Shard
from kvoffload.errors import ConnectorConfigError
from kvoffload.integrations.lmcache.policy import (
    Settings,
    object_chunk_key,
    shard_of,
)

SALT_A = bytes(range(32))
SALT_B = bytes(range(1, 33))


def test_salts_map_to_tenants_by_policy() -> None:
    s = Settings.from_dict({"tenants": {"u1": "alice", "u2": "alice", "": "anon"}})
    assert s.tenant_of("u1") == s.tenant_of("u2") == "alice"
    assert s.tenant_of("") == "anon"
    assert s.tenant_of("other") == "default"
    closed = Settings.from_dict({"tenants": {"u1": "alice"}, "default_tenant": None})
    assert closed.tenant_of("other") is None and closed.tenant_of("") is None
    own = Settings.from_dict({"salt_as_tenant": True, "default_tenant": None})
    assert own.tenant_of("bob") == "bob"
    assert own.tenant_of("not a tenant!") is None
    assert s.salts_alone() == {"": "anon"}


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"sockett": "/x"}, "unknown key 'sockett'"),
        ({"tenants": {"u": "bad tenant"}}, "adapter_params.tenants['u']"),
        ({"tenants": ["u"]}, "must map cache salts"),
        ({"max_capacity_bytes": -1}, "max_capacity_bytes must be an integer >= 0"),
        ({"staging_bytes": True}, "staging_bytes"),
        ({"salt_as_tenant": "yes"}, "salt_as_tenant"),
        ({"contract": {"tenant_namespace": "x"}}, "cannot be set"),
        ({"contract": {"block_size": 100, "chunk_tokens": 256}}, "adapter_params.contract"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ],
)
def test_bad_adapter_params_get_one_line(params: dict[str, object], says: str) -> None:
    with pytest.raises(ConnectorConfigError) as e:
        Settings.from_dict(params)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_every_object_key_field_and_the_tenant_shape_the_chunk_key() -> None:
    s = Settings.from_dict({})
    ns = s.contract_for("alice", "meta-llama/Llama-3-8B", 0x01000100).fingerprint()
    base = object_chunk_key(ns, SALT_A, b"h" * 32, 0x01000100, 0, "u1")
    assert base == object_chunk_key(ns, SALT_A, b"h" * 32, 0x01000100, 0, "u1")
    others = {
        object_chunk_key(ns, SALT_B, b"h" * 32, 0x01000100, 0, "u1"),  # another tenant's salt
        object_chunk_key(ns, SALT_A, b"i" * 32, 0x01000100, 0, "u1"),  # another chunk
        object_chunk_key(ns, SALT_A, b"h" * 32, 0x02010200, 0, "u1"),  # another rank
        object_chunk_key(ns, SALT_A, b"h" * 32, 0x01000100, 1, "u1"),  # another group
        object_chunk_key(ns, SALT_A, b"h" * 32, 0x01000100, 0, "u2"),  # another salt, same tenant
    }
    for ns2 in (
        s.contract_for("bob", "meta-llama/Llama-3-8B", 0x01000100).fingerprint(),
        s.contract_for("alice", "other-model", 0x01000100).fingerprint(),
        Settings.from_dict({"contract": {"kv_dtype": "bfloat16"}})
        .contract_for("alice", "meta-llama/Llama-3-8B", 0x01000100)
        .fingerprint(),
    ):
        assert ns2 != ns
        others.add(object_chunk_key(ns2, SALT_A, b"h" * 32, 0x01000100, 0, "u1"))
    assert base not in others and len(others) == 8


def test_kv_rank_gives_the_shard() -> None:
    assert shard_of(0x01000100) == Shard(0, 1)
    assert shard_of(0x04020402) == Shard(tp_rank=2, tp_size=4)
    assert shard_of(0) == Shard()  # unparsable: the single shard (the rank stays in the key)
    s = Settings.from_dict({"contract": {"model_revision": "rev-7"}})
    c = s.contract_for("alice", "m", 0x02010201)
    assert c.model_revision == "rev-7" and c.shard == Shard(1, 2) and c.tenant == "alice"
