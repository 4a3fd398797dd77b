"""Retention per tenant (issue 16 item 4): ttl, max_age and idle_ttl enforced on
every read from the *current* policy (a miss at once, before any sweep), swept
in the background, applied to chunks already stored when the policy changes,
on a shared root too; and ``sensitivity = "high"`` with defaults that say so.

Real LMDB, real files, real AES-GCM; ages are set through the index's own
timestamps (the records' created / last-access times), never by timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvoffload.client import SidecarClient
from kvoffload.errors import PolicyError
from kvoffload.sidecar.access.policy import Policy, TenantPolicy
from kvoffload.sidecar.access.policy_file import (
    HIGH_SENSITIVITY_IDLE_TTL_S,
    HIGH_SENSITIVITY_LOOKUP_FLOOR_S,
    HIGH_SENSITIVITY_MAX_AGE_S,
    load_policy,
)
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek
from kvoffload.testing import cli_argv
from tests.helpers.cli import sidecar
from tests.helpers.stores import make_store

NS = bytes(range(32))
K = [bytes([i]) * 32 for i in range(1, 5)]
S = 1_000_000_000


def age(store: Store, tenant: str, key: bytes, *, created_s: float = 0, idle_s: float = 0) -> None:
    """Move a chunk's creation / last access ``created_s`` / ``idle_s`` seconds back."""
    rec = store.index.get(tenant, key)
    assert rec is not None
    store.index.remove(tenant, key)
    store.index.put(
        replace(
            rec,
            created_ns=rec.created_ns - int(created_s * S),
            last_access_ns=rec.last_access_ns - int(idle_s * S),
        )
    )


class Limits:
    """The policy a sidecar would hand the store, changeable like a reload."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, TenantPolicy] = {}

    def __call__(self, tenant: str) -> TenantPolicy:
        return self.by_tenant.get(tenant, TenantPolicy())


@pytest.fixture
def store(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    s = make_store(tmp_path / "store", kek_file, durability="none")
    yield s
    s.close()


def put_all(store: Store, tenant: str = "acme", **kw: object) -> None:
    for i, k in enumerate(K):
        assert store.put(tenant, NS, k, [bytes([i]) * 3000], **kw)  # type: ignore[arg-type]


def test_a_chunk_past_max_age_is_never_served_before_the_sweep(store: Store) -> None:
    limits = Limits()
    store.set_retention(limits)
    put_all(store)
    limits.by_tenant["acme"] = TenantPolicy(max_age_s=3600)
    assert store.lookup("acme", K) == 4
    age(store, "acme", K[2], created_s=3601)
    # Touched just now: max_age counts from creation, regardless of touches.
    store.touch("acme", [K[2]])
    store._state.access.flush()
    assert store.index.get("acme", K[2]) is not None  # no sweep has run
    assert store.lookup_cached("acme", K) in (None, 2)
    assert store.lookup("acme", K) == 2
    assert store.get("acme", K[2]) is None
    out = [memoryview(bytearray(3000)) for _ in K]
    got = store.get_many_into("acme", K, out)
    assert [g is not None for g in got] == [True, True, False, False]
    assert store.payload_info("acme", K[2]) is None
    assert store.index.get("acme", K[2]) is None  # dropped by the read itself
    assert store.get("acme", K[3]) is not None  # the others are untouched


def test_a_retention_change_applies_to_chunks_already_stored(store: Store) -> None:
    limits = Limits()
    store.set_retention(limits)
    put_all(store)
    put_all(store, "beta")
    for k in K:
        age(store, "acme", k, created_s=7200)
        age(store, "beta", k, created_s=7200)
    assert store.lookup("acme", K) == 4  # no limit yet
    limits.by_tenant["acme"] = TenantPolicy(ttl_s=3600)  # a reload shortens acme's ttl
    assert store.lookup("acme", K) == 0
    assert store.lookup("beta", K) == 4  # another tenant's limits are its own
    limits.by_tenant["beta"] = TenantPolicy(max_age_s=10_000)
    assert store.lookup("beta", K) == 4
    limits.by_tenant["beta"] = TenantPolicy(max_age_s=7000)
    assert store.get("beta", K[0]) is None


def test_a_save_cannot_outlive_the_tenants_ttl(store: Store) -> None:
    limits = Limits()
    limits.by_tenant["acme"] = TenantPolicy(ttl_s=60)
    store.set_retention(limits)
    put_all(store, ttl_s=86400)  # the save asks for a day
    age(store, "acme", K[0], created_s=61)
    assert store.lookup("acme", K) == 0
    put_all(store, "beta", ttl_s=1e-9)  # a shorter one is honoured (stamped)
    assert store.lookup("beta", K) == 0


def test_idle_ttl_counts_from_the_last_access_and_lookups_do_not_count(store: Store) -> None:
    limits = Limits()
    limits.by_tenant["acme"] = TenantPolicy(idle_ttl_s=600)
    store.set_retention(limits)
    put_all(store)
    for k in K:
        age(store, "acme", k, created_s=900, idle_s=900)
    # K[0] is loaded (an access) after the ageing: it stays; a lookup is no access.
    limits.by_tenant["acme"] = TenantPolicy()
    assert store.get("acme", K[0]) is not None
    assert store.lookup("acme", K) == 4
    store._state.access.flush()
    limits.by_tenant["acme"] = TenantPolicy(idle_ttl_s=600)
    assert store.lookup("acme", K[:1]) == 1
    assert store.lookup("acme", K) == 1
    assert store.get("acme", K[1]) is None


def test_the_sweep_removes_what_the_policy_expired(store: Store) -> None:
    limits = Limits()
    store.set_retention(limits)
    put_all(store)
    put_all(store, "beta")
    age(store, "acme", K[0], created_s=100)
    age(store, "acme", K[1], idle_s=100)
    limits.by_tenant["acme"] = TenantPolicy(max_age_s=50, idle_ttl_s=50)
    used = store.used_bytes
    done = store.maintain()
    assert done["expired"] == 2
    assert store.index.get("acme", K[0]) is None and store.index.get("acme", K[1]) is None
    assert not store._path("acme", K[0]).exists()
    assert store.used_bytes < used
    assert store.lookup("beta", K) == 4


def test_max_age_holds_on_another_node_of_a_shared_root(tmp_path: Path, kek_file: Path) -> None:
    kek = Kek.from_file(kek_file)

    def node(name: str) -> Store:
        cfg = StoreConfig(
            root=tmp_path / "root",
            index_dir=tmp_path / f"idx-{name}",
            durability="none",
            shared=True,
            journal_poll_s=3600,
        )
        return Store(cfg, kek, create=True)  # type: ignore[arg-type]

    a, b = node("a"), node("b")
    try:
        limits = Limits()
        b.set_retention(limits)
        put_all(a)
        assert b.lookup("acme", K) == 4  # found by name (a stat), adopted
        age(b, "acme", K[1], created_s=120)
        limits.by_tenant["acme"] = TenantPolicy(max_age_s=60)
        assert b.lookup("acme", K) == 1
        assert b.get("acme", K[1]) is None
        assert a.lookup("acme", K) == 4  # node a has no such policy
    finally:
        a.close()
        b.close()


# -- the policy file ---------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    p.chmod(0o644)
    return p


def test_policy_parses_max_age_idle_ttl_and_sensitivity(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        'version = 1\n[defaults]\nttl = "7d"\nmax_age = "2d"\nidle_ttl = "1h"\n'
        '[tenants.plain]\nidle_ttl = "none"\n'
        '[tenants.secret]\nsensitivity = "high"\n'
        '[tenants.tuned]\nsensitivity = "high"\nmax_age = "15m"\nidle_ttl = "1m"\n'
        '[tenants.fast]\nsensitivity = "high"\nlookup_floor = "5ms"\n',
    )
    pol = load_policy(p)
    d = pol.defaults
    assert (d.ttl_s, d.max_age_s, d.idle_ttl_s, d.sensitivity) == (604800, 172800, 3600, "normal")
    assert pol.tenant("plain").idle_ttl_s is None and pol.tenant("plain").max_age_s == 172800
    assert pol.tenant("other").age_limit_s() == 172800  # the lesser of ttl and max_age
    hi = pol.tenant("secret")
    assert (hi.max_age_s, hi.idle_ttl_s) == (
        HIGH_SENSITIVITY_MAX_AGE_S,
        HIGH_SENSITIVITY_IDLE_TTL_S,
    )
    assert (hi.events, hi.encryption, hi.sensitivity) == (False, True, "high")
    assert HIGH_SENSITIVITY_MAX_AGE_S == 3600 and HIGH_SENSITIVITY_IDLE_TTL_S == 600
    assert HIGH_SENSITIVITY_LOOKUP_FLOOR_S == 0.002
    tuned = pol.tenant("tuned")
    assert (tuned.max_age_s, tuned.idle_ttl_s) == (900, 60)
    assert pol.tenant("fast").lookup_floor_s == 0.005
    # A high-sensitivity tenant's lookups are padded unless its own table says otherwise.
    assert hi.lookup_floor_s == HIGH_SENSITIVITY_LOOKUP_FLOOR_S
    assert pol.tenant("plain").lookup_floor_s == 0.0


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ('[tenants.s]\nsensitivity = "high"\nencryption = "none"\n', 4, "must be encrypted"),
        ('[defaults]\nencryption = "none"\n[tenants.s]\nsensitivity = "high"\n', 5, "encrypted"),
        ('[tenants.s]\nsensitivity = "high"\nencryption = "none"\ndirect = true\n', 4, "encrypted"),
        ('[tenants.s]\nsensitivity = "high"\nevents = true\n', 4, "KV-event feed"),
        ('[tenants.s]\nsensitivity = "high"\nmax_age = "none"\n', 4, "refused"),
        ('[tenants.s]\nsensitivity = "top"\n', 3, "normal"),
        ('[defaults]\nsensitivity = "high"\n', 3, "per tenant"),
        ("[tenants.s]\nmax_age = 60\n", 3, "unit"),
        ('[tenants.s]\nidle_ttl = "0s"\n', 3, "idle_ttl must be positive"),
    ],
)
def test_bad_retention_settings_are_refused_with_file_and_line(
    tmp_path: Path, text: str, line: int, words: str
) -> None:
    p = write(tmp_path, "version = 1\n" + text)
    with pytest.raises(PolicyError) as info:
        load_policy(p)
    msg = str(info.value)
    assert f"{p}:{line}" in msg and words in msg, msg


def test_policy_check_and_config_show_print_the_effective_values(tmp_path: Path) -> None:
    p = write(tmp_path, 'version = 1\n[tenants.secret]\nsensitivity = "high"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    r = subprocess.run(
        cli_argv("policy", "check", str(p), "--json"),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["tenants"]["secret"]
    assert (t["max_age_s"], t["idle_ttl_s"], t["events"], t["sensitivity"]) == (
        3600,
        600,
        False,
        "high",
    )
    env["KVOFFLOAD_POLICY"] = str(p)
    r = subprocess.run(
        cli_argv("--root", str(tmp_path / "r"), "config", "show", "--json"),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = {row["setting"]: row["value"] for row in json.loads(r.stdout)}
    assert rows["policy secret max_age"] == 3600  # JSON: seconds, booleans, numbers
    assert rows["policy secret idle_ttl"] == 600
    assert rows["policy secret events"] is False
    assert rows["[audit] keep"] == 8


def test_a_built_in_policy_has_no_limits() -> None:
    assert Policy().tenant("x").age_limit_s() is None


# -- a real sidecar -----------------------------------------------------------------


def test_a_sidecar_serves_nothing_past_max_age_and_applies_a_reload(tmp_path: Path) -> None:
    """max_age of 1 s: polled until it has passed (no speed asserted); the sidecar's
    sweep runs every 30 s, so the misses come from the read path. Then a reload
    that sets max_age for the other tenant expires its stored chunks."""
    pol = write(
        tmp_path,
        f"version = 1\n[[grants]]\nuid = {os.getuid()}\ntenants = ['*']\nadmin = true\n"
        '[tenants.short]\nmax_age = "1s"\n',
    )
    conf = tmp_path / "kvo.toml"
    conf.write_text(f"[security]\npolicy = {json.dumps(str(pol))}\n")
    with tempfile.TemporaryDirectory(prefix="kvo-r-") as d:
        sock = Path(d) / "kvo.sock"
        with sidecar(tmp_path, sock, "--config", str(conf)) as proc:
            with SidecarClient(sock, "short", staging_bytes=1 << 20) as c:
                assert c.save(NS, [(K[0], [b"a" * 5000])]) == [True]
                saved = time.time()  # after the save: on a loaded machine it may take a while
                while time.time() < saved + 1.2:  # past max_age, well before any sweep
                    time.sleep(0.1)
                assert c.lookup(K[:1]) == 0
                assert not any(ch.ok for ch in c.load(K[:1]))
            with SidecarClient(sock, "long", staging_bytes=1 << 20) as c:
                assert c.save(NS, [(K[1], [b"b" * 5000])]) == [True]
                assert c.lookup(K[1:2]) == 1
                saved = time.time()
                pol.write_text(pol.read_text() + '[tenants.long]\nmax_age = "1s"\n')
                proc.signal(signal.SIGHUP)
                while "policy reloaded" not in proc.log_text():
                    assert proc.alive()
                    time.sleep(0.05)
                while time.time() < saved + 1.2:
                    time.sleep(0.1)
                assert c.lookup(K[1:2]) == 0


def test_a_save_replaces_a_chunk_past_its_limits_at_once(store: Store) -> None:
    limits = Limits()
    limits.by_tenant["acme"] = TenantPolicy(max_age_s=60)
    store.set_retention(limits)
    put_all(store)
    age(store, "acme", K[0], created_s=61)
    # Not "exists": the expired chunk would be a miss until the sweep otherwise.
    assert store.put("acme", NS, K[0], [b"new" * 1000])
    assert store.get("acme", K[0]) == [b"new" * 1000]
    assert store.lookup("acme", K) == 4
