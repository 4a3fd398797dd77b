"""One registry of KVOFFLOAD_* variables, one units module, one Config tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import envvars, units
from kvoffload.errors import ConfigError
from kvoffload.sidecar.config import config_keys, load_config
from tests.helpers.paths import REPO

ROOT = REPO


def readme_table() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- envvars:begin -->\n(.*?)<!-- envvars:end -->", text, re.S)
    assert m, "README.md has no <!-- envvars:begin/end --> table"
    return m.group(1)


def test_readme_table_is_the_registry() -> None:
    assert readme_table() == envvars.markdown_table(), (
        "README's variable table is stale: paste kvoffload.envvars.markdown_table() "
        "between its <!-- envvars:begin/end --> markers"
    )


def test_every_config_key_has_its_variable() -> None:
    names = {v.name for v in envvars.REGISTRY}
    for section, key in config_keys():
        assert envvars.config_var(section, key) in names
    for v in envvars.REGISTRY:
        if v.config_key is not None:
            assert v.config_key in config_keys(), v


def test_every_variable_the_code_names_is_registered() -> None:
    names = {v.name for v in envvars.REGISTRY}
    found: set[str] = set()
    for path in (ROOT / "src" / "kvoffload").rglob("*.py"):
        found |= set(re.findall(r"KVOFFLOAD_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert found - names == set()


def test_unknown_variable_names_the_closest_known_one() -> None:
    envvars.check_environment({"KVOFFLOAD_STORE_ROOT": "/x", "PATH": "/bin"})
    with pytest.raises(
        ConfigError, match=r"KVOFFLOAD_STORE_ROOOT; did you mean KVOFFLOAD_STORE_ROOT"
    ):
        envvars.check_environment({"KVOFFLOAD_STORE_ROOOT": "/x"})
    with pytest.raises(ConfigError, match="see the README"):
        envvars.check_environment({"KVOFFLOAD_ZZZZZZZZZZZZZZZZZZZZZ": "1"})


def test_serve_refuses_an_unknown_variable_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_SERVER_SOKET"] = str(tmp_path / "s.sock")
    r = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "--dev", "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "config error: unknown environment variable $KVOFFLOAD_SERVER_SOKET; "
        "did you mean KVOFFLOAD_SERVER_SOCKET?"
    ]
    assert not (tmp_path / ".kvoffload").exists()  # refused before anything was created


def test_units() -> None:
    assert units.parse_size("512MiB") == 512 << 20
    assert units.parse_size("2TB") == 2 * 10**12
    assert units.parse_size(4096) == 4096
    assert units.parse_size("none") is None
    with pytest.raises(ConfigError, match="bad size"):
        units.parse_size("12 parsecs")
    with pytest.raises(ConfigError, match="bad quota"):
        units.parse_size(10, require_unit=True, what="quota")
    with pytest.raises(ConfigError, match="whole number"):
        units.parse_size("1.5B", whole=True)
    assert units.parse_duration("500ms") == 0.5
    assert units.parse_duration("7d") == 7 * 86400
    assert units.parse_duration(30) == 30.0
    with pytest.raises(ConfigError, match="bad --older-than"):
        units.parse_duration("none", allow_none=False, what="--older-than")
    assert units.format_size(512) == "512 B"
    assert units.format_size(3 << 29) == "1.5 GiB"
    assert units.format_size(None) == "unlimited"
    assert units.format_duration(0.25) == "250 ms"
    assert units.format_duration(90) == "1.5 m"


def test_one_config_tree_with_typed_sections(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(
        '[store]\nroot = "/srv/s"\ncapacity = "1GiB"\nkey_cache_ttl = "5s"\n'
        '[server]\nmax_inflight = "64MiB"\n[metrics]\nport = 9100\n'
        '[security]\nkek_file = "/k"\n'
    )
    cfg = load_config(cfg_file, env={"KVOFFLOAD_METRICS_HOST": "0.0.0.0"})
    assert cfg.store.root == Path("/srv/s") and cfg.store.capacity_bytes == 1 << 30
    assert cfg.store.key_cache_ttl_s == 5.0
    assert cfg.store.index_dir == Path("/srv/s.index")
    assert cfg.server.max_inflight_bytes == 64 << 20
    assert (cfg.metrics.port, cfg.metrics.host) == (9100, "0.0.0.0")
    assert cfg.security.kek_file == Path("/k") and cfg.security.policy_file is None
    with pytest.raises(ConfigError, match=r"\[store\] capacity: bad size"):
        load_config(env={"KVOFFLOAD_STORE_CAPACITY": "lots"})


def test_direct_read_min_reaches_the_store_config_and_refuses_nonsense(tmp_path: Path) -> None:
    assert load_config().store.direct_read_min is None  # the backend's default
    assert load_config().store_config().direct_read_min is None
    cfg = load_config(env={"KVOFFLOAD_STORE_DIRECT_READ_MIN": "64MiB"})
    assert cfg.store.direct_read_min == 64 << 20
    assert cfg.store_config().direct_read_min == 64 << 20
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[store]\ndirect_read_min = "0"\n')
    assert load_config(cfg_file).store_config().direct_read_min == 0  # never O_DIRECT
    for bad in ("big", "-1", "1.5B"):
        with pytest.raises(ConfigError, match=r"\[store\] direct_read_min: (bad )?size"):
            load_config(env={"KVOFFLOAD_STORE_DIRECT_READ_MIN": bad})


def test_ram_cache_reaches_the_store_config_and_refuses_nonsense(tmp_path: Path) -> None:
    assert load_config().store_config().ram_cache is None  # auto
    cfg = load_config(env={"KVOFFLOAD_STORE_RAM_CACHE": "2GiB"})
    assert cfg.store.ram_cache == 2 << 30
    assert cfg.store_config().ram_cache == 2 << 30
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[store]\nram_cache = "0"\n')
    assert load_config(cfg_file).store_config().ram_cache == 0  # no RAM tier
    cfg_file.write_text('[store]\nram_cache = "auto"\n')
    assert load_config(cfg_file).store_config().ram_cache is None
    for bad in ("lots", "-1", "1.5B", "none"):
        with pytest.raises(ConfigError, match=r"\[store\] ram_cache: (bad )?size"):
            load_config(env={"KVOFFLOAD_STORE_RAM_CACHE": bad})


def test_event_feed_readers_and_expiry_interval_are_read_and_checked() -> None:
    cfg = load_config(
        env={
            "KVOFFLOAD_DEV": "1",
            "KVOFFLOAD_EVENTS_READERS": "user:root, gid:4242,uid:7",
            "KVOFFLOAD_EVENTS_EXPIRY_INTERVAL": "250ms",
            "KVOFFLOAD_EVENTS_TENANT_BUFFER": "64",
        }
    )
    assert cfg.events.readers == ("uid:0", "gid:4242", "uid:7")
    assert cfg.events.expiry_interval_s == pytest.approx(0.25)
    assert cfg.events.tenant_buffer == 64
    for bad, words in (
        ("user:no-such-user-here", "no such user"),
        ("someone", "expected user:NAME"),
        ("uid:-1", "expected user:NAME"),
    ):
        with pytest.raises(ConfigError, match=words) as exc:
            load_config(env={"KVOFFLOAD_DEV": "1", "KVOFFLOAD_EVENTS_READERS": bad})
        assert "[events] readers" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="expiry_interval"):
        load_config(env={"KVOFFLOAD_DEV": "1", "KVOFFLOAD_EVENTS_EXPIRY_INTERVAL": "-1s"})
