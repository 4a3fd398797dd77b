"""Lower-layer errors are mapped at the Store boundary (``raise … from exc``):
an index or keyring failure leaves a Store method as a StoreError, while a
chunk that cannot be read stays a miss."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.errors import IndexFailure, KeyringError, StoreError, StoreIOError, StoreKeyError
from kvoffload.store import Store, StoreConfig
from kvoffload.store.keys.keyring import Kek

NS = bytes(range(32))


def key(i: int) -> bytes:
    return bytes([i]) * 32


def config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(root=tmp_path / "store", durability="none")  # type: ignore[arg-type]


@pytest.fixture
def broken_index(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    """A store whose LMDB environment was closed under it."""
    s = Store(config(tmp_path), Kek.from_file(kek_file), create=True)
    s.put("acme", NS, key(1), [b"x" * 100])
    s.index.close()
    yield s
    with contextlib.suppress(StoreError):
        s.close()


def _raises_mapped(cls: type[StoreError], fn: object, *args: object, **kw: object) -> None:
    with pytest.raises(cls) as info:
        fn(*args, **kw)  # type: ignore[operator]
    assert isinstance(info.value.__cause__, IndexFailure | KeyringError)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put("acme", NS, key(2), [b"y" * 100]),
        lambda s: s.put_many("acme", NS, [(key(2), [b"y"]), (key(3), [b"z"])]),
        lambda s: s.reserve("acme", 100, quota=1000),
        lambda s: s.tenant_accounted("acme"),
        lambda s: s.lease_store("acme", NS, key(2), [100]),
        lambda s: s.delete("acme", key(1)),
        lambda s: s.purge_namespace("acme", NS),
        lambda s: s.fsck(),
        lambda s: s.stats(),
        lambda s: s.lookup("acme", [key(1)]),
        lambda s: s.get("acme", key(1)),
        lambda s: list(s.chunks()),
        lambda s: s.tenant_usage(),
    ],
)
def test_an_index_failure_leaves_the_store_as_store_io_error(broken_index: Store, call) -> None:  # type: ignore[no-untyped-def]
    _raises_mapped(StoreIOError, call, broken_index)


def test_close_with_a_broken_index_raises_store_io_error_and_frees_the_lock(
    tmp_path: Path, kek_file: Path
) -> None:
    s = Store(config(tmp_path), Kek.from_file(kek_file), create=True)
    s.index.close()
    with pytest.raises(StoreIOError):
        s.close()
    Store(config(tmp_path), Kek.from_file(kek_file)).close()  # the lock was released


def test_a_corrupt_index_at_open_is_a_store_io_error(tmp_path: Path, kek_file: Path) -> None:
    Store(config(tmp_path), Kek.from_file(kek_file), create=True).close()
    (tmp_path / "store.index" / "lmdb" / "data.mdb").write_bytes(os.urandom(16384))
    cfg = config(tmp_path)
    cfg.rebuild_corrupt_index = False  # the default moves it aside and rebuilds
    with pytest.raises(StoreIOError) as info:
        Store(cfg, Kek.from_file(kek_file))
    assert isinstance(info.value.__cause__, IndexFailure)
    # The lock file was released: the store opens once the index is rebuilt.
    (tmp_path / "store.index" / "lmdb" / "data.mdb").unlink()
    Store(config(tmp_path), Kek.from_file(kek_file)).close()


@pytest.fixture
def corrupt_keys(tmp_path: Path, kek_file: Path) -> Iterator[Store]:
    """A store where tenant zeta's key file was corrupted (acme's is fine, so the
    store still opens: the KEK check reads the first tenant's keys)."""
    s = Store(config(tmp_path), Kek.from_file(kek_file), create=True)
    s.put("acme", NS, key(1), [b"a" * 100])
    s.put("zeta", NS, key(1), [b"z" * 100])
    s.close()
    for p in (tmp_path / "store" / "keys").iterdir():
        if p.name.startswith("zeta"):
            p.write_bytes(b"{not a key file")
    s = Store(config(tmp_path), Kek.from_file(kek_file))
    yield s
    s.close()


def test_a_corrupt_key_file_on_write_is_a_store_key_error(corrupt_keys: Store) -> None:
    _raises_mapped(StoreKeyError, corrupt_keys.put, "zeta", NS, key(2), [b"z" * 100])
    _raises_mapped(StoreKeyError, corrupt_keys.tenant_salt, "zeta")
    assert corrupt_keys.reserved_bytes == 0  # the failed write gave its reservation back


def test_a_corrupt_key_file_on_read_is_a_miss(corrupt_keys: Store) -> None:
    assert corrupt_keys.get("zeta", key(1)) is None
    assert corrupt_keys.get("acme", key(1)) == [b"a" * 100]


def test_the_cli_reports_a_corrupt_index_without_a_traceback(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", "--dev", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            timeout=120,
        )

    assert run("init").returncode == 0
    data = next((tmp_path / ".kvoffload").rglob("data.mdb"))
    data.write_bytes(os.urandom(16384))
    r = run("inspect", "--json")
    # Moved aside and rebuilt from the files (issue 11 item 4), said in one log line.
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "moved aside" in r.stderr
