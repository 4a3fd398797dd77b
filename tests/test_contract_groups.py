"""The contract of one KV-cache group of a hybrid model (contract-v1.md §7)."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.contract import CompatContract, ContractError, KVGroup

from .conftest import make_contract

FULL = KVGroup(index=0, num_groups=2, kind="full_attention", layers=(0, 2))
SLIDING = KVGroup(index=1, num_groups=2, kind="sliding_window", layers=(1, 3), sliding_window=48)
MAMBA = KVGroup(
    index=1,
    num_groups=2,
    kind="mamba",
    layers=(1, 3),
    mamba_cache_mode="align",
    state="MAMBA2:4x32:float32",
)


def test_a_model_with_one_group_keeps_version_1() -> None:
    c = make_contract()
    d = c.to_dict()
    assert d["contract"] == 1 and "kv_group" not in d
    assert CompatContract.from_dict(d).fingerprint() == c.fingerprint()


@pytest.mark.parametrize("group", [FULL, SLIDING, MAMBA], ids=["full", "sliding", "mamba"])
def test_a_group_contract_is_version_2_and_round_trips(group: KVGroup) -> None:
    c = dataclasses.replace(make_contract(), kv_group=group)
    d = c.to_dict()
    assert d["contract"] == 2 and d["kv_group"]["kind"] == group.kind
    back = CompatContract.from_dict(d)
    assert back == c and back.fingerprint() == c.fingerprint()
    assert c.fingerprint() != make_contract().fingerprint()


def test_every_group_field_changes_the_fingerprint() -> None:
    base = dataclasses.replace(make_contract(), kv_group=SLIDING)
    changes = [
        dataclasses.replace(SLIDING, index=0),
        dataclasses.replace(SLIDING, num_groups=3),
        dataclasses.replace(SLIDING, layers=(1, 2)),
        dataclasses.replace(SLIDING, sliding_window=64),
        dataclasses.replace(SLIDING, extra_retained_tokens=8),
        FULL,
    ]
    prints = {dataclasses.replace(base, kv_group=g).fingerprint() for g in changes}
    assert len(prints) == len(changes) and base.fingerprint() not in prints


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("kv_group"), "needs a kv_group"),
        (lambda d: d.update(contract=1), "needs contract encoding version 2"),
        (lambda d: d["kv_group"].update(kind="cross"), "kv_group.kind"),
        (lambda d: d["kv_group"].update(sliding_window=None), "sliding_window"),
        (lambda d: d["kv_group"].update(layers="1,3"), "layers"),
        (lambda d: d["kv_group"].update(index=2), "outside"),
        (lambda d: d["kv_group"].update(colour="blue"), "invalid kv_group"),
    ],
)
def test_bad_group_fields_are_refused(edit: object, match: str) -> None:
    d = dataclasses.replace(make_contract(), kv_group=SLIDING).to_dict()
    edit(d)  # type: ignore[operator]
    with pytest.raises(ContractError, match=match):
        CompatContract.from_dict(d)
