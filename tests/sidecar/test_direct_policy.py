"""The policy keys of the direct path: direct, direct_group."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kvoffload.errors import PolicyError
from kvoffload.sidecar.access.policy_file import load_policy, parse_policy

# ----------------------------------------------------------------------- policy


def policy_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"policy-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def refused(tmp_path: Path, text: str, line: int, *needles: str) -> PolicyError:
    path = policy_file(tmp_path, text)
    with pytest.raises(PolicyError) as ei:
        load_policy(path)
    err = ei.value
    assert err.line == line, str(err)
    assert str(err).startswith(f"{path}:{line}:"), str(err)
    for n in needles:
        assert n in str(err), str(err)
    return err


def test_policy_direct_with_plaintext_encryption(tmp_path: Path) -> None:
    pol = load_policy(
        policy_file(
            tmp_path,
            'version = 1\n\n[tenants.acme]\nencryption = "none"\ndirect = true\n\n'
            "[tenants.beta]\nencryption = \"none\"\n\n[tenants.gamma]\nencryption = 'none'\n"
            "direct = false\n",
        )
    )
    acme = pol.tenant("acme")
    assert acme.direct is True and acme.encryption is False and acme.direct_gid is None
    assert pol.tenant("beta").direct is False
    assert pol.tenant("gamma").direct is False
    assert pol.tenant("unlisted").direct is False and pol.defaults.direct is False


def test_policy_direct_inherits_plaintext_from_defaults(tmp_path: Path) -> None:
    pol = load_policy(
        policy_file(
            tmp_path, 'version = 1\n[defaults]\nencryption = "none"\n[tenants.a]\ndirect = true\n'
        )
    )
    assert pol.tenant("a").direct is True and pol.tenant("a").encryption is False


def test_policy_direct_with_sealed_encryption_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, "version = 1\n\n[tenants.acme]\ndirect = true\n", 4, "direct", '"none"')
    refused(
        tmp_path,
        'version = 1\n[defaults]\nencryption = "none"\n[tenants.acme]\n'
        'encryption = "aes-256-gcm"\nquota = "1GiB"\ndirect = true\n',
        7,
        'encryption = "none"',
    )


@pytest.mark.parametrize(
    ("value", "gid"),
    [("0", 0), ('"root"', 0), (str(os.getgid()), os.getgid()), ("12345", 12345)],
)
def test_policy_direct_group_by_gid_or_name(tmp_path: Path, value: str, gid: int) -> None:
    pol = load_policy(
        policy_file(
            tmp_path,
            f'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = true\n'
            f"direct_group = {value}\n",
        )
    )
    assert pol.tenant("acme").direct_gid == gid and pol.tenant("acme").direct


def test_policy_direct_group_errors(tmp_path: Path) -> None:
    head = 'version = 1\n[tenants.acme]\nencryption = "none"\n'
    missing = f"kvo-no-such-group-{uuid.uuid4().hex[:12]}"
    refused(
        tmp_path, head + f'direct = true\ndirect_group = "{missing}"\n', 5, "unknown group", missing
    )
    refused(tmp_path, head + 'direct_group = "root"\n', 4, "direct_group", "direct = true")
    refused(tmp_path, head + 'direct = false\ndirect_group = "root"\n', 5, "direct = true")
    refused(tmp_path, head + "direct = true\ndirect_group = -1\n", 5, "out of range")
    refused(tmp_path, head + 'direct = true\ndirect_group = ""\n', 5, "group name or gid")
    refused(tmp_path, head + "direct = true\ndirect_group = true\n", 5, "group name or gid")
    refused(tmp_path, head + "direct = true\ndirect_group = [0]\n", 5, "group name or gid")


def test_policy_direct_keys_are_per_tenant_only(tmp_path: Path) -> None:
    for k, v in (("direct", "true"), ("direct_group", '"root"')):
        refused(
            tmp_path,
            f'version = 1\n[defaults]\nencryption = "none"\n{k} = {v}\n',
            4,
            k,
            "per tenant",
        )


@pytest.mark.parametrize("value", ['"yes"', "1", "0", '"true"', "[true]"])
def test_policy_direct_must_be_a_bool(tmp_path: Path, value: str) -> None:
    refused(
        tmp_path,
        f'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = {value}\n',
        4,
        "direct must be true or false",
    )


def test_policy_text_api_agrees(tmp_path: Path) -> None:
    text = 'version = 1\n[tenants.acme]\nencryption = "none"\ndirect = true\ndirect_group = 0\n'
    pol = parse_policy(text)
    assert pol.tenant("acme") == load_policy(policy_file(tmp_path, text)).tenant("acme")
