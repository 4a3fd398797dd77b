"""The store commands: init, inspect, ls, purge, fsck, keys (:mod:`.admin`: where they act)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..units import format_duration
from .admin import (
    ADMIN_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    SidecarTarget,
    Target,
    admin_target,
    offline_audit,
    sidecar_listening,
)
from .app import (
    JsonOpt,
    app,
    check_tenant,
    config,
    emit,
    err,
    human_bytes,
    keys_app,
    open_store,
    out,
    parse_ns,
    resolve_ns,
)
from .exits import _Aborted, _CliUsageError, _EngineResetFailed, _FsckProblems, _NothingToDo
from .revoke_cmds import engine_url, reset_engine


@app.command()
def init(as_json: JsonOpt = False) -> None:
    """Create a store (layout.json, keys/, objects/) and its index.

    A store that exists already is left as it is (exit 0, and it says so).
    """
    cfg = config()
    existed = (cfg.store_root / "layout.json").exists()
    with open_store(cfg, create=True) as store:
        offline_audit(store, "init", "ok", created=not existed)
        data = {
            "store_root": str(cfg.store_root),
            "index_dir": str(cfg.resolved_index_dir),
            "store_id": store.layout.store_id,
            "layout_version": store.layout.version,
            "created": not existed,
        }
    if existed and not as_json:
        out.print(
            f"already exists: the store at {cfg.store_root} (store id {data['store_id']}, "
            f"layout v{data['layout_version']}, index {data['index_dir']}); nothing changed"
        )
        return
    emit(as_json, data if as_json else {k: v for k, v in data.items() if k != "created"})


@app.command()
def inspect(as_json: JsonOpt = False) -> None:
    """Store id, layout version, tenants, namespaces, chunks, bytes, capacity.

    Asks the running sidecar when one serves the socket, else opens the store.
    """
    cfg = config()
    with admin_target(cfg) as target:
        data = target.inspect()
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
    shared = data.get("shared")
    if shared:
        ev = shared.get("evictor") or {}
        followed = ", ".join(
            f"{n[:8]}@{seg}:{off}" for n, (seg, off) in sorted(shared["nodes_followed"].items())
        )
        table.caption += (
            f"\nshared root: this node {shared['node_id'][:8]} (journal segment "
            f"{shared['journal_segment']}), following {followed or 'no other node'}; "
            f"evictor {str(ev.get('holder', 'none'))[:8]} (epoch {ev.get('epoch', '-')})"
        )
    emit(as_json, data, table)


def _duration(text: str | None, option: str) -> float | None:
    from ..errors import ConfigError
    from ..units import parse_duration

    if text is None:
        return None
    try:
        return parse_duration(text, allow_none=False, what=option) or 0.0
    except ConfigError as exc:
        raise _CliUsageError(str(exc)) from exc


TimeoutOpt = Annotated[
    str,
    typer.Option(
        "--timeout",
        metavar="DURATION",
        help=f"How long a running sidecar may take over the job (e.g. 4h; default "
        f"{ADMIN_TIMEOUT_S / 3600:g}h). One that does not answer at all is given up on "
        f"after {HELLO_TIMEOUT_S:g} s.",
    ),
]


def _job_timeout(text: str) -> float:
    seconds = _duration(text, "--timeout")
    if not seconds:
        raise _CliUsageError("--timeout must be more than 0")
    return seconds


NamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        "-n",
        metavar="HEX",
        help="The namespace's fingerprint: 64 hex digits, or a unique prefix of at least 4 "
        "(as ls and ls --namespaces show it).",
    ),
]


@app.command("ls")
def ls_(
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant", "-t", metavar="TENANT", help="Only this tenant's chunks (or namespaces)."
        ),
    ] = None,
    namespace: NamespaceOpt = None,
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", metavar="AGE", help="Only chunks created before, e.g. 7d."),
    ] = None,
    newer_than: Annotated[
        str | None,
        typer.Option("--newer-than", metavar="AGE", help="Only chunks created since, e.g. 1h."),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=0, metavar="N", help="Most rows to print (0 = all).")
    ] = 100,
    namespaces: Annotated[
        bool,
        typer.Option(
            "--namespaces", help="List namespaces (contract fields, sizes, ages), not chunks."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """List chunks, filtered by tenant, namespace and age; or, with --namespaces, namespaces."""
    check_tenant(tenant)
    if namespaces:
        if namespace is not None or older_than is not None or newer_than is not None:
            raise _CliUsageError("--namespaces combines with --tenant only")
        from .contract_cmds import show_namespaces

        show_namespaces(tenant, as_json)
        return
    given = parse_ns(namespace)
    old = _duration(older_than, "--older-than")
    new = _duration(newer_than, "--newer-than")
    cfg = config()
    with admin_target(cfg) as target:
        ns = None
        if given is not None:
            ns = resolve_ns(given, target.inspect() if len(given) < 64 else {}, tenant)
            if ns is None:
                of = f" of tenant {tenant}" if tenant else ""
                raise _CliUsageError(
                    f"--namespace {given}: no namespace{of} in {target.where} starts with it"
                )
        rows = target.ls(tenant, ns, old, new, limit)
    table = Table()
    for col in ("tenant", "key", "namespace", "size", "layers", "sealed", "age"):
        table.add_column(col)
    for r in rows:
        # Sizes and ages for people, as inspect prints them; --json keeps bytes and seconds.
        table.add_row(
            r["tenant"], r["key"][:16], r["namespace"][:12], human_bytes(r["bytes"]),
            str(r["layers"]), "yes" if r["sealed"] else "no", format_duration(r["age_s"]),
        )  # fmt: skip
    emit(as_json, rows, table)


@app.command()
def purge(
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            "-t",
            metavar="TENANT",
            help="The tenant to purge; alone, a crypto-erase (its keys are destroyed first).",
        ),
    ] = None,
    namespace: NamespaceOpt = None,
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than",
            metavar="AGE",
            help="Only chunks created longer ago, e.g. 7d (of --tenant, or of all).",
        ),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    timeout: TimeoutOpt = "1h",
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            metavar="URL",
            help="After the purge, POST URL/reset_prefix_cache to this vLLM server "
            "(repeatable). Resets EVERY tenant's prefix cache of that engine; vLLM "
            "serves it only with VLLM_SERVER_DEV_MODE=1.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove data. --tenant alone is a crypto-erase: its keys are destroyed first.

    Through the running sidecar when one serves the socket, else offline. A
    tenant with neither keys nor data, or a namespace without chunks, is exit
    8 (a typo?), nothing asked.
    The report lists the tiers the purge removed something of the tenant
    from (RAM tier, keys, other nodes of a shared root, objects, retention
    journal, contracts, quarantine, index; through a sidecar also loads in
    flight, leased files, pending stores, KV events) and those outside
    kvoffload (the engines' own GPU and CPU prefix caches), which --engine
    URL resets. An engine not reset is one
    line each and exit 1; the store purge is done regardless.
    """
    _check_purge_options(tenant, namespace, older_than)
    check_tenant(tenant)
    given = parse_ns(namespace)
    age = _duration(older_than, "--older-than")
    job_timeout = _job_timeout(timeout)
    try:
        engines = [engine_url(e) for e in engine or []]
    except ValueError as exc:
        raise _CliUsageError(str(exc)) from None
    cfg = config()
    with admin_target(cfg, job_timeout, command="purge") as target:
        ns = None
        if tenant is not None:
            info = target.inspect()
            if tenant not in info["tenants"] and tenant not in info["tenants_with_keys"]:
                raise _NothingToDo(f"tenant {tenant} has no keys or data in {target.where}")
            if given is not None:
                ns = _purged_namespace(given, info, tenant, target.where)
        what = (
            f"tenant {tenant} (crypto-erase: keys destroyed, irreversible)"
            if tenant and ns is None and age is None
            else f"namespace {ns.hex()} of tenant {tenant}"
            if ns is not None
            else f"chunks older than {older_than}" + (f" of tenant {tenant}" if tenant else "")
        )
        if not yes:
            _confirm_purge(what)
        kind, n = _run_purge(target, tenant, ns, age)
        tiers = getattr(target, "tiers", None) if kind != "age" else None
    results = [reset_engine(u) for u in engines]
    namespace = ns.hex() if ns is not None else None
    report: dict[str, Any] = {"purged": kind, "tenant": tenant, "namespace": namespace, "chunks": n}
    if tiers is not None:
        report["tiers"] = tiers
    if engines:
        report["engines"] = results
    if as_json:
        emit(True, report)
    else:
        _print_purge(report, older_than)
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise _EngineResetFailed(
            "; ".join(f"{r['engine']}: {r['detail']}" for r in failed)
            + " (the store purge itself was done)"
        )


def _check_purge_options(tenant: str | None, namespace: str | None, older_than: str | None) -> None:
    """Exit 2 unless the options name one thing to purge."""
    if tenant is None and namespace is None and older_than is None:
        raise _CliUsageError(
            "say what to purge: --tenant, --namespace (with --tenant) or --older-than"
        )
    if namespace is not None and tenant is None:
        raise _CliUsageError("--namespace needs --tenant")
    if namespace is not None and older_than is not None:
        raise _CliUsageError("--namespace and --older-than do not combine")


def _confirm_purge(what: str) -> None:
    """Ask before purging ``what``; exit 1 (nothing purged) on no, or on no answer."""
    try:
        ok = typer.confirm(f"Purge {what}?", default=False, err=True)
    except typer.Abort:
        err.print()  # end the prompt's line: the reason gets its own
        raise _Aborted(
            f"nothing purged ({what}): no answer at the prompt; pass --yes to purge without one"
        ) from None
    if not ok:
        raise _Aborted(f"nothing purged ({what})")


def _run_purge(
    target: Target, tenant: str | None, ns: bytes | None, age: float | None
) -> tuple[str, int]:
    """Purge by age, by namespace or the whole tenant; returns (kind, chunks purged)."""
    if age is not None:
        return "age", target.purge_older(age, tenant)
    assert tenant is not None
    if ns is not None:
        return "namespace", target.purge_namespace(tenant, ns)
    with err.status(f"erasing tenant {tenant}…"):
        return "tenant", target.purge_tenant(tenant)


def _print_purge(report: dict[str, Any], older_than: str | None) -> None:
    """The purge report for people: what was purged, the tiers, each engine reset."""
    for label, value in (
        ("purged", report["purged"]),
        ("tenant", report["tenant"]),
        ("namespace", report["namespace"]),
        ("older than", older_than),
        ("chunks", report["chunks"]),
    ):
        if value is not None:  # only what this purge was about
            out.print(f"{label}: {value}")
    engines = report.get("engines", [])
    tiers = report.get("tiers")
    if tiers is not None:
        out.print(f"tiers reached: {', '.join(tiers.get('reached', []))}")
        out.print(f"tiers outside kvoffload: {', '.join(tiers.get('outside', []))}"
                  + ("" if engines else " (reset them with --engine URL)"))  # fmt: skip
    for r in engines:
        out.print(f"engine {r['engine']}: {'reset' if r['ok'] else 'NOT reset'}: {r['detail']}")


def _purged_namespace(given: str, info: dict[str, Any], tenant: str, where: str) -> bytes:
    """The namespace a purge names; exit 8 when it has no chunks (a typo?)."""
    ns = resolve_ns(given, info, tenant)
    if ns is None or ns.hex() not in info["tenants"].get(tenant, {}).get("namespaces", {}):
        raise _NothingToDo(
            f"no namespace of tenant {tenant} in {where} "
            + (f"is {given}" if len(given) == 64 else f"starts with {given}")
            + " (`kvoffload ls --namespaces --tenant T` lists them)"
        )
    return ns


@app.command("drop-cache")
def drop_cache(as_json: JsonOpt = False) -> None:
    """Empty the running sidecar's RAM tier: the next load of every chunk reads its file.

    For cold measurements, or to see what a load costs from disk. The tier's
    memory stays mapped as spare buffers; the stored data is untouched. With
    no sidecar running nothing is held in memory: nothing to drop.
    """
    cfg = config()
    data: dict[str, Any] = {"sidecar": None, "dropped": 0, "held_bytes": 0}
    if not sidecar_listening(cfg.socket_path):
        said = f"no sidecar serves {cfg.socket_path}: no RAM tier to drop"
    else:
        target = SidecarTarget(cfg.socket_path)
        target.check_store(cfg)
        dropped, held = target.drop_cache()
        data = {"sidecar": str(cfg.socket_path), "dropped": dropped, "held_bytes": held}
        said = (
            f"dropped {dropped} chunk image(s) from the RAM tier of {target.where}; "
            f"{human_bytes(held)} stay mapped as spare buffers"
        )
    if as_json:
        emit(True, data)
    else:
        out.print(said)


#: fsck report key → (what it lists, what --repair did about it)
_FSCK_FINDINGS: dict[str, tuple[str, str]] = {
    "missing_files": ("index records without a file", "dropped from the index"),
    "mismatched_records": ("index records that differ from their file", "re-read from the file"),
    "unindexed_files": ("files without an index record", "indexed"),
    "corrupt_files": ("corrupt objects", "removed"),
    "purged_tenant_files": ("objects of purged tenants", "removed"),
    "orphan_tmp_files": ("stale temp files", "removed"),
}


def _print_fsck(report: dict[str, Any], repair: bool) -> None:
    out.print(
        f"objects on disk: {report['objects_on_disk']}, index records: "
        f"{report['index_records']}, ok: {report['ok']}"
    )
    for key, (label, action) in _FSCK_FINDINGS.items():
        items = report.get(key) or []
        if not items:
            continue
        head = f"{label}: {len(items)}" + (f" ({action})" if repair else "")
        out.print(head)
        for item in items[:20]:
            out.print(f"  {item}")
        if len(items) > 20:
            out.print(f"  … and {len(items) - 20} more (--json lists all)")
    if report["clean"]:
        out.print("clean: no problems found")
    elif repair:
        out.print("repaired: " + _repair_summary(report))
    else:
        out.print("problems found: run `kvoffload fsck --repair`")


def _repair_summary(report: dict[str, Any]) -> str:
    def n(*keys: str) -> int:
        return sum(len(report.get(k) or []) for k in keys)

    return (
        f"removed {n('corrupt_files', 'purged_tenant_files', 'orphan_tmp_files')} files, "
        f"dropped {n('missing_files')} index records, "
        f"re-indexed {n('unindexed_files', 'mismatched_records')} objects"
    )


@app.command()
def fsck(
    repair: Annotated[
        bool, typer.Option("--repair", help="Rebuild the index from the files.")
    ] = False,
    verify_data: Annotated[
        bool, typer.Option("--verify-data", help="Also decrypt/checksum every layer.")
    ] = False,
    timeout: TimeoutOpt = "1h",
    as_json: JsonOpt = False,
) -> None:
    """Compare the index with the files; --repair rebuilds the index from the files alone.

    Through the running sidecar when one serves the socket, else offline.
    """
    job_timeout = _job_timeout(timeout)
    cfg = config()
    with admin_target(cfg, job_timeout) as target:
        if as_json:
            data = target.fsck(repair, verify_data, None)
        else:
            with err.status("checking objects…") as status:
                data = target.fsck(
                    repair, verify_data, lambda n: status.update(f"checked {n} objects…")
                )
    if repair:
        data["summary"] = _repair_summary(data)
    if as_json:
        emit(True, data)
    else:
        _print_fsck(data, repair)
    if not data["clean"] and not repair:
        raise _FsckProblems("the store has problems: run `kvoffload fsck --repair`")


@keys_app.command("rotate-kek")
def rotate_kek(
    new_kek_file: Annotated[
        Path, typer.Option("--new-kek-file", metavar="FILE", readable=False, help="The new KEK.")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Re-wrap every tenant's keys under a new KEK; then destroy the old KEK.

    Offline only: the sidecar holds the store and its KEK, and has no verb for
    this. Stop it, rotate, point it at the new KEK and start it again (an
    unfinished rotation opens with either KEK; running this again finishes it).
    """
    from ..errors import KeyringError, StoreLocked
    from ..store.keys.keyring import Kek

    cfg = config()
    try:
        new = Kek.from_file(new_kek_file)
    except KeyringError as exc:
        raise KeyringError(f"new KEK: {exc}") from exc
    stop_first = (
        "stop it first (systemctl stop kvoffload), run keys rotate-kek, point it at the "
        "new KEK (under systemd: its LoadCredential= file) and start it again; the "
        "sidecar has no verb to rotate the KEK while it runs"
    )
    if sidecar_listening(cfg.socket_path):
        raise StoreLocked(f"the sidecar on {cfg.socket_path} holds the store: {stop_first}")
    with contextlib.ExitStack() as opened:
        try:
            store = opened.enter_context(open_store(cfg))
        except StoreLocked as exc:
            raise StoreLocked(
                f"the index at {cfg.resolved_index_dir} is held by another process (a "
                f"sidecar on another socket than {cfg.socket_path}?): {stop_first}"
            ) from exc
        n = store.rotate_kek(new)
        offline_audit(store, "rotate-kek", "ok", new_kek_id=new.key_id, rewrapped_tenants=n)
    emit(
        as_json,
        {
            "rewrapped_tenants": n,
            "new_kek_id": new.key_id,
            "next": "point the sidecar at the new KEK file, then destroy the old one",
        },
    )
