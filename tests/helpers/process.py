"""Helpers shared by the tests (moved out of test_sidecar_process.py)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from kvoffload.layouts import v1
from tests.sidecar_proc import (
    Procs,
    Sidecar,
)

UNUSED_UID = 4242


NO_GRANT_UID = 4343


def _socket_group() -> str | None:
    """An existing group for the uid test's socket (the children join it)."""
    import grp

    for name in ("nogroup", "nobody"):
        try:
            grp.getgrnam(name)
        except KeyError:
            continue
        return name
    return None


SOCKET_GROUP = _socket_group()


def write_config(
    workdir: Path, policy: str, *, socket_group: str | None = None, reservation_timeout: str = "60s"
) -> Path:
    """A production-style setup: config file, KEK file and policy file."""
    kek = workdir / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    pol = workdir / "policy.toml"
    pol.write_text(textwrap.dedent(policy))
    pol.chmod(0o644)
    group = f'socket_group = "{socket_group}"\n' if socket_group else ""
    cfg = workdir / "kvoffload.toml"
    cfg.write_text(
        textwrap.dedent(
            f"""\
            [store]
            root = "{workdir}/store"
            index_dir = "{workdir}/index"
            durability = "batch"

            [server]
            socket = "{workdir}/run/kvo.sock"
            idle_reservation_timeout = "{reservation_timeout}"
            """
        )
        + group
        + textwrap.dedent(
            f"""
            [security]
            kek_file = "{kek}"
            policy = "{pol}"
            """
        )
    )
    return cfg


def start_configured(procs: Procs, workdir: Path, cfg: Path) -> Sidecar:
    s = procs.sidecar(
        workdir, workdir / "run" / "kvo.sock", Sidecar.serve_argv("--config", str(cfg), "serve")
    )
    s.start().wait_ready()
    return s


def save(seed: str, indices: list[int], tenant: str = "acme", **kw: Any) -> dict[str, Any]:
    return {"op": "save", "tenant": tenant, "seed": seed, "indices": indices, **kw}


def load(seed: str, indices: list[int], tenant: str = "acme", **kw: Any) -> dict[str, Any]:
    return {"op": "load", "tenant": tenant, "seed": seed, "indices": indices, **kw}


def lookup(seed: str, indices: list[int], tenant: str = "acme") -> dict[str, Any]:
    return {"op": "lookup", "tenant": tenant, "seed": seed, "indices": indices}


def values(results: list[dict[str, Any]]) -> list[Any]:
    return [r["value"] for r in results]


def tmp_files(store_root: Path) -> list[Path]:
    return [q for q in (store_root / "objects").rglob("*") if q.name.startswith(v1.TMP_PREFIX)]


def no_tracebacks(sidecar: Sidecar) -> None:
    assert "Traceback" not in sidecar.log_text(), sidecar.log_text()
