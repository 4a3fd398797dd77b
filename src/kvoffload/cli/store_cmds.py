"""Commands that open the store in-process: init, inspect, ls, purge, fsck, keys."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .app import (
    JsonOpt,
    app,
    config,
    emit,
    err,
    human_bytes,
    keys_app,
    open_store,
    parse_ns,
)
from .exits import _Aborted, _CliUsageError, _FsckProblems


@app.command()
def init(as_json: JsonOpt = False) -> None:
    """Create a store (layout.json, keys/, objects/) and its index."""
    cfg = config()
    with open_store(cfg, create=True) as store:
        data = {
            "store_root": str(cfg.store_root),
            "index_dir": str(cfg.resolved_index_dir),
            "store_id": store.layout.store_id,
            "layout_version": store.layout.version,
        }
    emit(as_json, data)


@app.command()
def inspect(as_json: JsonOpt = False) -> None:
    """Store id, layout version, tenants, namespaces, chunks, bytes, capacity."""
    cfg = config()
    with open_store(cfg) as store:
        tenants = store.tenant_usage()
        data: dict[str, Any] = {
            "store_root": str(cfg.store_root),
            "store_id": store.layout.store_id,
            "layout_version": store.layout.version,
            "capacity_bytes": store.config.capacity_bytes,
            "used_bytes": store.used_bytes,
            "chunks": store.chunk_count(),
            "tenants": {
                t: {
                    "chunks": u.count,
                    "bytes": u.bytes,
                    "namespaces": {
                        ns.hex(): {"chunks": nu.count, "bytes": nu.bytes}
                        for ns, nu in store.namespace_usage(t).items()
                    },
                }
                for t, u in sorted(tenants.items())
            },
            "tenants_with_keys": store.tenants(),
            "tenants_with_unreadable_keys": store.key_problems(),
        }
    table = Table(title=f"store {data['store_id']} (layout v{data['layout_version']})")
    for col in ("tenant", "namespaces", "chunks", "bytes"):
        table.add_column(col)
    for t, info in data["tenants"].items():
        table.add_row(
            t, str(len(info["namespaces"])), str(info["chunks"]), human_bytes(info["bytes"])
        )
    table.caption = (
        f"{data['chunks']} chunks, {human_bytes(data['used_bytes'])} of "
        f"{human_bytes(data['capacity_bytes'])}"
    )
    emit(as_json, data, table)


def _duration(text: str, option: str) -> float:
    from ..errors import ConfigError
    from ..units import parse_duration

    try:
        return parse_duration(text, allow_none=False, what=option) or 0.0
    except ConfigError as exc:
        raise _CliUsageError(str(exc)) from exc


@app.command("ls")
def ls_(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t")] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Hex fingerprint.")
    ] = None,
    older_than: Annotated[
        str | None, typer.Option("--older-than", help="Only chunks created before, e.g. 7d.")
    ] = None,
    newer_than: Annotated[str | None, typer.Option("--newer-than")] = None,
    limit: Annotated[int, typer.Option("--limit")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """List chunks, filtered by tenant, namespace and age."""
    cfg = config()
    ns = parse_ns(namespace)
    now = time.time_ns()
    old_cut = now - int(_duration(older_than, "--older-than") * 1e9) if older_than else None
    new_cut = now - int(_duration(newer_than, "--newer-than") * 1e9) if newer_than else None
    rows: list[dict[str, Any]] = []
    with open_store(cfg) as store:
        for rec in store.chunks(tenant=tenant, namespace=ns):
            if old_cut is not None and rec.created_ns >= old_cut:
                continue
            if new_cut is not None and rec.created_ns < new_cut:
                continue
            rows.append(
                {
                    "tenant": rec.tenant,
                    "key": rec.chunk_key.hex(),
                    "namespace": rec.namespace.hex(),
                    "bytes": rec.size,
                    "layers": rec.num_layers,
                    "sealed": rec.key_epoch > 0,
                    "age_s": round((now - rec.created_ns) / 1e9, 1),
                }
            )
            if len(rows) >= limit:
                break
    table = Table()
    for col in ("tenant", "key", "namespace", "bytes", "layers", "sealed", "age_s"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["tenant"], r["key"][:16], r["namespace"][:12], str(r["bytes"]),
            str(r["layers"]), str(r["sealed"]), str(r["age_s"]),
        )  # fmt: skip
    emit(as_json, rows, table)


@app.command()
def purge(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n")] = None,
    older_than: Annotated[str | None, typer.Option("--older-than")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove data. --tenant alone is a crypto-erase: its keys are destroyed first."""
    if tenant is None and namespace is None and older_than is None:
        raise _CliUsageError(
            "say what to purge: --tenant, --namespace (with --tenant) or --older-than"
        )
    if namespace is not None and tenant is None:
        raise _CliUsageError("--namespace needs --tenant")
    ns = parse_ns(namespace)
    age = _duration(older_than, "--older-than") if older_than is not None else None
    cfg = config()
    what = (
        f"tenant {tenant} (crypto-erase: keys destroyed, irreversible)"
        if tenant and ns is None and older_than is None
        else f"namespace {namespace} of tenant {tenant}"
        if ns is not None
        else f"chunks older than {older_than}" + (f" of tenant {tenant}" if tenant else "")
    )
    if not yes and not typer.confirm(f"Purge {what}?", default=False, err=True):
        raise _Aborted(f"nothing purged ({what})")
    with open_store(cfg) as store:
        if age is not None:
            n = store.purge_older_than(age, tenant)
            kind = "age"
        elif ns is not None:
            assert tenant is not None
            n = store.purge_namespace(tenant, ns)
            kind = "namespace"
        else:
            assert tenant is not None
            with err.status(f"erasing tenant {tenant}…"):
                n = store.purge_tenant(tenant, wait=True)
            kind = "tenant"
    emit(as_json, {"purged": kind, "tenant": tenant, "namespace": namespace, "chunks": n})


@app.command()
def fsck(
    repair: Annotated[
        bool, typer.Option("--repair", help="Rebuild the index from the files.")
    ] = False,
    verify_data: Annotated[
        bool, typer.Option("--verify-data", help="Also decrypt/checksum every layer.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compare the index with the files; --repair rebuilds the index from the files alone."""
    cfg = config()
    with open_store(cfg) as store:
        if as_json:
            report = store.fsck(repair, verify_data=verify_data)
        else:
            with err.status("checking objects…") as status:
                report = store.fsck(
                    repair,
                    verify_data=verify_data,
                    progress=lambda n: status.update(f"checked {n} objects…"),
                )
    data = report.to_dict()
    emit(as_json, data)
    if not report.clean and not repair:
        raise _FsckProblems("the store has problems: run `kvoffload fsck --repair`")


@keys_app.command("rotate-kek")
def rotate_kek(
    new_kek_file: Annotated[Path, typer.Option("--new-kek-file", help="The new KEK.")],
    as_json: JsonOpt = False,
) -> None:
    """Re-wrap every tenant's keys under a new KEK; then destroy the old KEK."""
    from ..errors import KeyringError
    from ..sidecar.keyring import Kek

    cfg = config()
    try:
        new = Kek.from_file(new_kek_file)
    except KeyringError as exc:
        raise KeyringError(f"new KEK: {exc}") from exc
    with open_store(cfg) as store:
        n = store.rotate_kek(new)
    emit(
        as_json,
        {
            "rewrapped_tenants": n,
            "new_kek_id": new.key_id,
            "next": "point the sidecar at the new KEK file, then destroy the old one",
        },
    )
