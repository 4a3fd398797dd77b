"""The SGLang page → kvoffload chunk identity (no SGLang needed)."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.integrations.sglang.identity import (
    Coordinates,
    KeyMapper,
    PoolShape,
    Settings,
    SettingsError,
    chunk_plan,
    make_contract,
)

SHAPE = PoolShape(
    "kv",
    "MHATokenToKVPoolHost",
    "page_first",
    "bfloat16",
    64,
    32,
    8,
    128,
    2 * 64 * 32 * 8 * 128 * 2,
    (64 * 32 * 8 * 128 * 2,) * 2,
)
COORDS = Coordinates("Org/model", 1, 4, 0, 1, 0, 1, 0, 1, False)
DEFAULT = Settings()
SALT_A, SALT_B = b"a" * 32, b"b" * 32
PAGE_KEYS = ["ab" * 32, "cd" * 32]


def _keys(
    s: Settings = DEFAULT, c: Coordinates = COORDS, p: PoolShape = SHAPE, salt: bytes = SALT_A
) -> list[bytes]:
    return KeyMapper(make_contract(s, c, p), p.pool).keys(salt, PAGE_KEYS)


def test_every_input_that_shapes_a_page_changes_its_key() -> None:
    base = _keys()
    variants = [
        _keys(salt=SALT_B),
        _keys(s=Settings(tenant="other")),
        _keys(s=Settings(model_revision="Org/model@rev2")),
        _keys(s=Settings(lora_id="adapter")),
        _keys(c=dataclasses.replace(COORDS, tp_rank=2)),
        _keys(c=dataclasses.replace(COORDS, pp_size=2, pp_rank=1)),
        _keys(c=dataclasses.replace(COORDS, cp_size=2, cp_rank=1)),
        _keys(p=dataclasses.replace(SHAPE, layout="layer_first")),
        _keys(p=dataclasses.replace(SHAPE, dtype="float8_e4m3fn")),
        _keys(p=dataclasses.replace(SHAPE, page_size=32)),
        _keys(p=dataclasses.replace(SHAPE, pool="mamba")),
    ]
    assert len({k for v in [base, *variants] for k in v}) == 2 * (1 + len(variants))
    assert _keys() == base  # deterministic


def test_mla_kv_is_shared_by_tp_ranks_but_mamba_state_is_not() -> None:
    mla = dataclasses.replace(COORDS, is_mla=True)
    assert _keys(c=mla) == _keys(c=dataclasses.replace(mla, tp_rank=0))
    state = dataclasses.replace(SHAPE, pool="mamba")
    assert _keys(c=mla, p=state) != _keys(c=dataclasses.replace(mla, tp_rank=0), p=state)


def test_dp_rank_does_not_enter_the_namespace() -> None:
    # DP-attention replicas with one attention-TP rank hold the same heads.
    assert "dp" not in make_contract(Settings(), COORDS, SHAPE).attention_backend.split(";")[0]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tenat": "x"}, "unknown key"),
        ({"tenant": "no spaces"}, "tenant"),
        ({"staging_bytes": 10}, "staging_bytes"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"socket_path": ""}, "socket_path"),
    ],
)
def test_bad_extra_config_is_one_line(extra: dict[str, object], match: str) -> None:
    with pytest.raises(SettingsError, match=match) as err:
        Settings.from_extra_config(extra)
    assert "\n" not in str(err.value)


def test_sglang_own_keys_are_accepted_and_a_model_is_required() -> None:
    s = Settings.from_extra_config(
        {
            "backend_name": "kvoffload",
            "module_path": "m",
            "class_name": "C",
            "interface_v1": 1,
            "tenant": "acme",
        }
    )
    assert s.tenant == "acme"
    with pytest.raises(SettingsError, match="model"):
        make_contract(s, dataclasses.replace(COORDS, model_name=None), SHAPE)
    with pytest.raises(SettingsError, match="tp_lcm_size"):
        make_contract(s, dataclasses.replace(COORDS, split_heads=True), SHAPE)


def test_the_sglang_requirements_pin_everything_and_name_themselves() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "requirements/sglang-cpu.txt").read_text()
    lines = text.splitlines()
    assert re.findall(r"-r (\S+)", "\n".join(lines[:3])) == ["requirements/sglang-cpu.txt"]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    assert "sglang==0.5.23" in reqs and all("==" in r for r in reqs)
    assert not any(r.startswith(("torch==", "torchvision")) for r in reqs)


def test_a_page_of_two_runs_is_two_chunks_of_their_own_namespace() -> None:
    """page_first K and V runs are one chunk each (in place needs a chunk packed in
    one span): two keys per page, none equal to the one-chunk layout's keys, in
    a namespace that says so; three or more runs stay one chunk."""
    runs = [(64 * 32 * 8 * 128 * 2,), (64 * 32 * 8 * 128 * 2,)]
    assert chunk_plan(runs) == tuple(runs)
    assert chunk_plan(runs[:1]) == () and chunk_plan(runs * 2) == ()
    split = dataclasses.replace(SHAPE, chunks=chunk_plan(runs))
    assert split.plan == tuple(runs) and SHAPE.plan == (SHAPE.layer_bytes,)
    c_one, c_two = make_contract(DEFAULT, COORDS, SHAPE), make_contract(DEFAULT, COORDS, split)
    assert c_one.fingerprint() != c_two.fingerprint()
    two = KeyMapper(c_two, "kv", 2).keys(SALT_A, PAGE_KEYS)
    assert len(two) == 4 and len(set(two) | set(_keys())) == 6
    # The same namespace and two parts: still apart from the one-part keys.
    assert not set(KeyMapper(c_one, "kv", 2).keys(SALT_A, PAGE_KEYS)) & set(_keys())
