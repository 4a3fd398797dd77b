"""The access policy file: parsing, refusal of bad files with a line, and lookups."""

from __future__ import annotations

import copy
import grp
import os
import pickle
import pwd
import textwrap
import uuid
from pathlib import Path

import pytest

from kvoffload.errors import PolicyError
from kvoffload.sidecar.access.policy import ALL_TENANTS, AllTenants, Policy, TenantPolicy
from kvoffload.sidecar.access.policy_file import load_policy, parse_policy

GOOD = """\
version = 1

[defaults]
encryption = "aes-256-gcm"
ttl = "7d"
quota = "200GiB"

[tenants.acme]
encryption = "none"
ttl = "1h"
quota = "10GiB"
trust_group = "prod"

[tenants.beta]
quota = "none"

[[grants]]
uid = 1001
tenants = ["acme", "beta"]

[[grants]]
gid = 2000
tenants = ["gamma"]

[[grants]]
uid = 0
tenants = ["*"]
admin = true

[[grants]]
gid = 3000
tenants = []
admin = true
"""


def write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def refused(tmp_path: Path, text: str) -> PolicyError:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    err = info.value
    assert err.source == str(path)
    assert str(path) in str(err)
    return err


def assert_at_line(err: PolicyError, line: int) -> None:
    assert err.line == line, str(err)
    assert str(err).startswith(f"{err.source}:{line}:"), str(err)


# -- a good file -----------------------------------------------------------------------


def test_good_file_settings(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD))
    assert policy.source == str(tmp_path / "policy.toml")
    assert policy.defaults == TenantPolicy(
        encryption=True, ttl_s=7 * 86400.0, quota_bytes=200 * 2**30, trust_group=None
    )
    assert policy.tenant("acme") == TenantPolicy(False, 3600.0, 10 * 2**30, "prod")
    # Keys a tenant table leaves out come from [defaults]; "none" clears a default.
    assert policy.tenant("beta") == TenantPolicy(True, 7 * 86400.0, None, None)
    # A tenant without a table gets exactly the defaults.
    assert policy.tenant("unlisted") == policy.defaults
    assert set(policy.tenants) == {"acme", "beta"}


def test_good_file_grants(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD))
    assert policy.tenants_for(1001, [1001]) == frozenset({"acme", "beta"})
    assert policy.may_use(1001, [1001], "acme")
    assert not policy.may_use(1001, [1001], "gamma")
    assert not policy.is_admin(1001, [1001])

    # Grants add up across the uid and every group passed.
    assert policy.tenants_for(1001, [1001, 2000]) == frozenset({"acme", "beta", "gamma"})
    assert policy.tenants_for(5000, [2000]) == frozenset({"gamma"})

    # Nothing for a peer that no grant names.
    assert policy.tenants_for(4242, [4242]) == frozenset()
    assert not policy.may_use(4242, [4242], "acme")
    assert not policy.is_admin(4242, [4242])

    # "*" covers tenants the file never mentions, and wins over any list.
    assert policy.tenants_for(0, [0]) is ALL_TENANTS
    assert policy.tenants_for(0, [2000]) is ALL_TENANTS
    assert policy.may_use(0, [0], "never-mentioned")
    assert policy.is_admin(0, [0])

    # Admin alone gives the verbs, not the data.
    assert policy.is_admin(6000, [3000])
    assert policy.tenants_for(6000, [3000]) == frozenset()


def test_invalid_tenant_id_is_never_usable(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD))
    for bad in ["", "-acme", "a/b", "../x", "a" * 65, "é", "acme\n", "acme\x00"]:
        assert not policy.may_use(0, [0], bad)
        with pytest.raises(ValueError):
            policy.tenant(bad)


def test_names_resolve_at_load(tmp_path: Path) -> None:
    me = pwd.getpwuid(os.getuid())
    root_group = grp.getgrgid(0)
    policy = load_policy(
        write(
            tmp_path,
            f"""\
            version = 1
            [[grants]]
            user = "{me.pw_name}"
            tenants = ["mine"]
            [[grants]]
            group = "{root_group.gr_name}"
            tenants = ["ops"]
            admin = true
            """,
        )
    )
    assert policy.tenants_for(me.pw_uid, []) == frozenset({"mine"})
    assert policy.tenants_for(12345, [0]) == frozenset({"ops"})
    assert policy.is_admin(12345, [0])
    labels = [g.label for g in policy.grants]
    assert labels[0] == f"user {me.pw_name!r} (uid {me.pw_uid})"


def test_minimal_file_denies_everything(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "version = 1\n"))
    assert policy.defaults == TenantPolicy(True, None, None, None)
    assert policy.tenants_for(0, [0]) == frozenset()
    assert not policy.is_admin(0, [0])


@pytest.mark.parametrize(
    ("ttl", "seconds"),
    [("30s", 30.0), ("15m", 900.0), ("12h", 43200.0), ("7d", 604800.0), ("1.5h", 5400.0)],
)
def test_durations(ttl: str, seconds: float) -> None:
    policy = parse_policy(f'version = 1\n[defaults]\nttl = "{ttl}"\n')
    assert policy.defaults.ttl_s == seconds


@pytest.mark.parametrize(
    ("quota", "size"),
    [
        ("200GiB", 200 * 2**30),
        ("1.5KiB", 1536),
        ("10KB", 10_000),
        ("3 MB", 3_000_000),
        ("2TiB", 2 * 2**40),
        ("1TB", 10**12),
        ("1PiB", 2**50),
        ("512B", 512),
        ("0B", 0),
    ],
)
def test_sizes(quota: str, size: int) -> None:
    policy = parse_policy(f'version = 1\n[defaults]\nquota = "{quota}"\n')
    assert policy.defaults.quota_bytes == size


def test_from_text_default_source() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy("version = 2\n")
    assert str(info.value).startswith("<string>:1:")


# -- refused files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('version = 1\nencryption = "none"\n', 2),
        ('version = 1\n\n[defaults]\nttl = "1h"\nencrpytion = "none"\n', 5),
        ('version = 1\n[tenants.acme]\nquota = "1GiB"\n\nttll = "1h"\n', 5),
        ('version = 1\n[[grants]]\nuid = 1\ntenants = ["a"]\n[[grants]]\ntennants = ["b"]\n', 6),
        ('version = 1\n[[grants]]\nuid = 1\ntenants = ["a"]\nadmin = false\nadmn = true\n', 6),
        ('version = 1\n[tenant.acme]\nttl = "1h"\n', 2),
        ('version = 1\n[tenants]\nacme = { ttl = "1h", qouta = "1GiB" }\n', 3),
        ('version = 1\ndefaults.colour = "blue"\n', 2),
    ],
)
def test_unknown_key(tmp_path: Path, text: str, line: int) -> None:
    err = refused(tmp_path, text)
    assert "unknown key" in err.reason
    assert_at_line(err, line)


@pytest.mark.parametrize("ttl", ['"7"', '"7days"', "7", '"-1h"', '"0s"', '"1y"', '"h"', "true"])
def test_bad_duration(tmp_path: Path, ttl: str) -> None:
    err = refused(tmp_path, f'version = 1\n\n[tenants.acme]\nquota = "1GiB"\nttl = {ttl}\n')
    assert "ttl" in err.reason
    assert_at_line(err, 5)


@pytest.mark.parametrize(
    "quota", ['"10"', "10", '"10G"', '"10gib"', '"1.5B"', '"-1GiB"', '"GiB"', '"1 EiB"']
)
def test_bad_quota(tmp_path: Path, quota: str) -> None:
    err = refused(tmp_path, f'version = 1\n[defaults]\nttl = "1h"\nquota = {quota}\n')
    assert "quota" in err.reason
    assert_at_line(err, 4)


@pytest.mark.parametrize(
    "header",
    ['"bad name"', '"-acme"', "-acme", '"a/b"', '"' + "a" * 65 + '"', '"*"', '""', '"acme\\n"'],
)
def test_bad_tenant_table_name(tmp_path: Path, header: str) -> None:
    err = refused(
        tmp_path,
        f'version = 1\n[[grants]]\nuid = 1\ntenants = ["x"]\n\n[tenants.{header}]\nttl = "1h"\n',
    )
    assert "invalid tenant id" in err.reason
    assert_at_line(err, 6)


@pytest.mark.parametrize("entry", ['"bad name"', '"../etc"', "7", '""'])
def test_bad_tenant_in_grant(tmp_path: Path, entry: str) -> None:
    err = refused(tmp_path, f'version = 1\n[[grants]]\nuid = 1\ntenants = ["ok", {entry}]\n')
    assert "invalid tenant id" in err.reason
    assert_at_line(err, 4)


def test_wildcard_must_stand_alone(tmp_path: Path) -> None:
    err = refused(tmp_path, 'version = 1\n[[grants]]\nuid = 1\ntenants = ["*", "acme"]\n')
    assert "alone" in err.reason
    assert_at_line(err, 4)


@pytest.mark.parametrize(("value", "line"), [("2", 2), ("0", 2), ('"1"', 2), ("true", 2)])
def test_unknown_version(tmp_path: Path, value: str, line: int) -> None:
    err = refused(tmp_path, f"# kvoffload policy\nversion = {value}\n")
    assert "version" in err.reason
    assert_at_line(err, line)


def test_missing_version(tmp_path: Path) -> None:
    err = refused(tmp_path, '[defaults]\nttl = "1h"\n')
    assert "version" in err.reason
    assert err.line is None
    assert str(err).startswith(f"{err.source}: ")


def test_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    err = refused(tmp_path, "version = 1\n[defaults]\nttl = 7d\n")
    assert err.reason.startswith("invalid TOML")
    assert err.line == 3
    assert err.column is not None
    assert str(err).startswith(f"{err.source}:3:{err.column}: ")


def test_duplicate_table_is_a_syntax_error(tmp_path: Path) -> None:
    err = refused(tmp_path, 'version = 1\n[tenants.a]\nttl = "1h"\n[tenants.a]\nquota = "1GiB"\n')
    assert err.line == 4


def test_unknown_user_and_group(tmp_path: Path) -> None:
    ghost = "kvo-" + uuid.uuid4().hex[:12]
    err = refused(tmp_path, f'version = 1\n[[grants]]\ntenants = ["a"]\nuser = "{ghost}"\n')
    assert ghost in err.reason
    assert_at_line(err, 4)
    err = refused(tmp_path, f'version = 1\n\n[[grants]]\ngroup = "{ghost}"\ntenants = ["a"]\n')
    assert_at_line(err, 4)


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ('tenants = ["a"]\n', 2, "exactly one"),
        ('uid = 1\ngid = 2\ntenants = ["a"]\n', 2, "uid, gid"),
        ("uid = 1\n", 2, "tenants"),
        ('uid = -1\ntenants = ["a"]\n', 3, "out of range"),
        ('uid = 4294967295\ntenants = ["a"]\n', 3, "out of range"),
        ('uid = "1001"\ntenants = ["a"]\n', 3, "integer"),
        ('gid = true\ntenants = ["a"]\n', 3, "integer"),
        ('uid = 1\ntenants = "a"\n', 4, "array"),
        ('uid = 1\ntenants = ["a"]\nadmin = "yes"\n', 5, "true or false"),
    ],
)
def test_bad_grant(tmp_path: Path, body: str, line: int, words: str) -> None:
    err = refused(tmp_path, "version = 1\n[[grants]]\n" + body)
    assert words in err.reason
    assert_at_line(err, line)


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ('version = 1\n[defaults]\nencryption = "aes"\n', 3, "encryption"),
        ("version = 1\n[defaults]\nencryption = false\n", 3, "encryption"),
        ('version = 1\n[defaults]\ntrust_group = "prod"\n', 3, "per tenant"),
        ('version = 1\n[tenants.a]\ntrust_group = "bad group"\n', 3, "trust_group"),
        ('version = 1\ntenants = ["a"]\n', 2, "table"),
        ('version = 1\ndefaults = "x"\n', 2, "table"),
        ('version = 1\n[tenants]\nacme = "x"\n', 3, "table"),
        ("version = 1\ngrants = {uid = 1}\n", 2, "array of tables"),
    ],
)
def test_other_semantic_errors(tmp_path: Path, text: str, line: int, words: str) -> None:
    err = refused(tmp_path, text)
    assert words in err.reason
    assert_at_line(err, line)


def test_error_line_with_dotted_keys_and_multiline_strings(tmp_path: Path) -> None:
    text = 'version = 1\nnote = """\n[tenants.acme]\nttl = "never"\n"""\n'
    # The multi-line string is not a table header: the error is the key `note`.
    err = refused(tmp_path, text)
    assert_at_line(err, 2)
    err = refused(tmp_path, 'version = 1\ntenants.acme.ttl = "1h"\ntenants.beta.ttl = "soon"\n')
    assert_at_line(err, 3)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "missing.toml")
    assert str(info.value).startswith(f"{tmp_path / 'missing.toml'}: cannot read policy")

    with pytest.raises(PolicyError, match=str(tmp_path)):
        load_policy(tmp_path)

    binary = tmp_path / "latin1.toml"
    binary.write_bytes(b"version = 1\n# caf\xe9\n")
    with pytest.raises(PolicyError) as info:
        load_policy(binary)
    assert info.value.line == 2
    assert "UTF-8" in info.value.reason


def test_world_writable_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    path.chmod(0o666)
    with pytest.raises(PolicyError, match="writable by everyone"):
        load_policy(path)
    path.chmod(0o640)
    load_policy(path)


# -- the rest of the API ---------------------------------------------------------------


def test_default_dev() -> None:
    policy = Policy.default_dev()
    for uid in {0, os.getuid()}:
        assert policy.tenants_for(uid, []) is ALL_TENANTS
        assert policy.is_admin(uid, [])
        assert policy.may_use(uid, [], "anything")
    stranger = 4_000_000
    assert stranger != os.getuid()
    assert policy.tenants_for(stranger, [stranger]) == frozenset()
    assert not policy.is_admin(stranger, [0])
    assert policy.tenant("x").encryption


def test_all_tenants_is_a_singleton() -> None:
    assert AllTenants() is ALL_TENANTS
    assert copy.deepcopy(ALL_TENANTS) is ALL_TENANTS
    assert pickle.loads(pickle.dumps(ALL_TENANTS)) is ALL_TENANTS
    assert "acme" in ALL_TENANTS
    assert "bad name" not in ALL_TENANTS
    assert "acme\n" not in ALL_TENANTS
    assert 7 not in ALL_TENANTS


def test_policy_is_read_only(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD))
    with pytest.raises(TypeError):
        policy.tenants["evil"] = TenantPolicy()  # type: ignore[index]
    with pytest.raises(AttributeError):
        policy.defaults.encryption = False  # type: ignore[misc]


@pytest.mark.parametrize("text", ["500ms", "1.5h", "7d", "30 s"])
def test_policy_ttls_read_as_every_other_duration(text: str) -> None:
    """One units module: a ttl in the policy means what the same text means in the config."""
    from kvoffload import units

    policy = parse_policy(f'version = 1\n[defaults]\nttl = "{text}"\n')
    assert policy.defaults.ttl_s == units.parse_duration(text)
    assert policy.defaults.ttl_s is not None and policy.defaults.ttl_s > 0
