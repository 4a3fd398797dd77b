"""A purge's report names exactly the tiers it removed something of the tenant
from (protocol-v1.md §5.11, store/purge.py): every tier that held the tenant's
data is named, with how much went, and the disk agrees; a tier that held
nothing of it is never claimed. Real stores on real files, a real RAM tier
(O_DIRECT reads), real LMDB and AES-GCM; the offline CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.layouts import v1
from kvoffload.sidecar.admin import DAEMON_TIERS, TIERS_OUTSIDE, purge_tiers
from kvoffload.store import PurgeReport, Store, StoreConfig
from kvoffload.store.api import STORE_TIERS
from kvoffload.store.contracts import CONTRACTS_DIR
from kvoffload.store.iobackend import probe_direct
from kvoffload.store.keys.keyring import Kek
from kvoffload.store.retention import RETENTION_DIR
from tests.conftest import make_contract
from tests.helpers.stores import make_store

NS = bytes(range(32))
NS2 = bytes(range(1, 33))
#: Two 600 KiB layers: a sealed object of about 1.2 MiB, over the RAM tier's
#: 1 MiB floor (direct_read_min) below.
BIG = 600 << 10


def key(i: int) -> bytes:
    return bytes([i]) * 32


def big_layers(i: int) -> list[bytes]:
    return [bytes([i]) * BIG, bytes([i + 1]) * BIG]


@pytest.fixture
def store(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    """A store with a RAM tier: its large objects are read around the page cache."""
    if not probe_direct(tmp_path).supported:
        pytest.skip(f"no O_DIRECT in {tmp_path}: no RAM tier to purge")
    s = make_store(
        tmp_path / "store",
        kek_file,
        durability="none",
        io="posix",
        direct_read_min=1 << 20,
        ram_cache=16 << 20,
        io_streams=2,
    )
    assert s.has_ram_tier
    try:
        yield s
    finally:
        s.close()


def save_with_image(s: Store, tenant: str, i: int) -> None:
    """Save a large chunk once the RAM tier has a spare buffer, so its image is kept."""
    ram = s._state.ram
    assert ram is not None
    size = v1.object_size([BIG, BIG], True)
    deadline = time.monotonic() + 30
    while (slot := ram.lend(size)) is None:  # the first asks the filler for spares
        assert time.monotonic() < deadline, ram.stats()
        time.sleep(0.01)
    ram.give_back(slot)
    assert s.put(tenant, NS, key(i), big_layers(i))
    assert ram.holds(tenant, key(i))


def quarantine_one(s: Store, tenant: str, i: int) -> None:
    """Save a small chunk, flip a byte of its object, read it: quarantined."""
    assert s.put(tenant, NS, key(i), [b"q" * 5000])
    path = s._path(tenant, key(i))
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    assert s.get(tenant, key(i)) is None
    assert quarantined(s, tenant)


def quarantined(s: Store, tenant: str) -> list[Path]:
    q = s.root / "quarantine"
    return [p for p in q.iterdir() if p.name.startswith(f"{tenant}.")] if q.is_dir() else []


def register(s: Store, tenant: str) -> bytes:
    """Register a contract for ``tenant``; its namespace."""
    c = make_contract(tenant_namespace=tenant)
    assert s.record_contract(tenant, c.fingerprint(), c.to_dict())
    return c.fingerprint()


def test_a_tenant_purge_names_each_tier_it_emptied_and_how_much(store: Store) -> None:
    s = store
    save_with_image(s, "acme", 1)  # an image in the RAM tier
    assert s.put("acme", NS, key(2), [b"t" * 5000], ttl_s=3600)  # a retention record
    quarantine_one(s, "acme", 3)  # a quarantined object, its entry dropped
    register(s, "acme")  # a contract record
    # Another tenant with the same kinds of data: nothing of it is touched.
    save_with_image(s, "beta", 4)
    assert s.put("beta", NS, key(5), [b"u" * 5000], ttl_s=3600)
    quarantine_one(s, "beta", 6)
    beta_ns = register(s, "beta")

    for held in (RETENTION_DIR, CONTRACTS_DIR, "objects"):
        assert (s.root / held / "acme").is_dir()
    report = s.purge("acme")

    assert isinstance(report, PurgeReport) and report.removed == 2
    assert report.reached == {
        "ram_tier": 1,
        "keys": 1,
        "objects": 2,
        "retention_journal": 1,
        "contracts": 1,
        "quarantine": 1,
        "index": 2,
    }
    assert set(report.tiers) <= set(STORE_TIERS) and "shared_nodes" not in report.tiers
    # The disk agrees, tier by tier.
    ram = s._state.ram
    assert ram is not None and not ram.holds("acme", key(1))
    assert not (s.root / "keys" / "acme.key").exists()
    assert not (s.root / "objects" / "acme").exists()
    assert not (s.root / RETENTION_DIR / "acme").exists()
    assert not (s.root / CONTRACTS_DIR / "acme").exists()
    assert quarantined(s, "acme") == []
    assert list(s.chunks(tenant="acme")) == []
    # ... and beta kept all of its own.
    assert ram.holds("beta", key(4)) and s.get("beta", key(5)) == [b"u" * 5000]
    assert len(quarantined(s, "beta")) == 1
    assert s.contracts.get("beta", beta_ns) is not None
    assert list((s.root / RETENTION_DIR / "beta").iterdir())


def test_a_purge_never_claims_a_tier_that_held_nothing_of_the_tenant(store: Store) -> None:
    s = store
    # Small chunks only: no RAM image, no ttl, no contract, nothing quarantined.
    assert s.put_many("acme", NS, [(key(i), [b"s" * 5000]) for i in range(3)]) == [True] * 3
    save_with_image(s, "beta", 9)  # the RAM tier holds another tenant's image
    report = s.purge("acme")
    assert report.tiers == ("keys", "objects", "index")
    assert report.reached == {"keys": 1, "objects": 3, "index": 3}
    # A tenant with nothing at all: no tier held anything of it.
    empty = s.purge("nobody")
    assert empty.removed == 0 and empty.tiers == ()


def test_a_namespace_purge_names_what_it_removed_and_leaves_the_rest(store: Store) -> None:
    s = store
    save_with_image(s, "acme", 1)
    assert s.put("acme", NS, key(2), [b"a" * 5000], ttl_s=3600)
    assert s.put("acme", NS2, key(3), [b"b" * 5000])
    report = s.purge("acme", NS)
    assert report.removed == 2 and report.namespace == NS
    assert report.reached == {"ram_tier": 1, "objects": 2, "index": 2}
    assert s.get("acme", key(3)) == [b"b" * 5000]  # the other namespace stays
    assert (s.root / "keys" / "acme.key").exists()  # not a crypto-erase


def test_the_reply_gives_the_store_tiers_then_the_daemons(store: Store) -> None:
    """sidecar/admin.py: the store's tiers as its report names them, then the
    daemon's own (and the event feed when it runs); offline, the store's alone."""
    s = store
    assert s.put("acme", NS, key(1), [b"x" * 5000], ttl_s=60)
    report = s.purge("acme")
    reply = purge_tiers(report.tiers, events=True)
    assert reply == {
        "reached": ("keys", "objects", "retention_journal", "index", *DAEMON_TIERS, "events"),
        "outside": TIERS_OUTSIDE,
    }
    offline = purge_tiers(report.tiers, events=True, daemon=False)
    assert offline["reached"] == ("keys", "objects", "retention_journal", "index")


def test_the_offline_cli_reports_the_tiers_the_store_reached(tmp_path: Path) -> None:
    """``kvoffload purge --json`` with no sidecar: the tiers come from the store's
    report (a retention record and a contract named; no RAM tier, no daemon)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", "--dev", *args],
            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip

    assert cli("init", "--json").returncode == 0
    cfg = StoreConfig(
        root=tmp_path / ".kvoffload/store", index_dir=tmp_path / ".kvoffload/index", ram_cache=0
    )
    s = Store(cfg, Kek.from_file(tmp_path / ".kvoffload/dev-kek"))
    try:
        assert s.put("acme", NS, key(1), [b"c" * 5000], ttl_s=3600)
        register(s, "acme")
    finally:
        s.close()
    done = cli("purge", "--tenant", "acme", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    tiers = json.loads(done.stdout)["tiers"]
    assert tiers["reached"] == ["keys", "objects", "retention_journal", "contracts", "index"]
    assert tiers["outside"] == list(TIERS_OUTSIDE)
