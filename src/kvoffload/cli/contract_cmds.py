"""``kvoffload invalidate`` and ``kvoffload ls --namespaces``: namespaces by their contract.

A namespace's contract fields (model revision, tokenizer hash, chat template
version, …) are registered by the clients that store under it (protocol-v1.md
§5.19) and kept beside the chunks (layout-v1.md §2.1). ``invalidate`` purges
every namespace built under a model revision, tokenizer or chat template, on
every node of a shared root; namespaces stored without registered fields are
reported as "unknown contract" and left alone. Through the running sidecar
when one serves the socket, else offline (:mod:`.admin`).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .admin import admin_target
from .app import JsonOpt, app, check_tenant, config, emit, err, human_bytes, out
from .exits import _Aborted, _CliUsageError, _NothingToDo


def _age(seconds: float) -> str:
    s = int(seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def namespace_line(r: dict[str, Any]) -> str:
    """One namespace, one line: tenant, fingerprint, contract, size, ages."""
    c = r.get("contract")
    what = (
        f"{c['model_revision']} tokenizer={c['tokenizer_hash']} "
        f"template={c['chat_template_version']} dtype={c['kv_dtype']} "
        f"lora={c['lora_id'] or '-'} shard={c['shard']['tp_rank']}/{c['shard']['tp_size']}"
        if c
        else "(unknown contract: stored without registered fields)"
    )
    return (
        f"{r['tenant']} {r['namespace'][:16]} {what} — {r['chunks']} chunks, "
        f"{human_bytes(r['bytes'])}, oldest {_age(r['oldest_age_s'])}, "
        f"newest {_age(r['newest_age_s'])}"
    )


def show_namespaces(tenant: str | None, as_json: bool) -> None:
    """``ls --namespaces``: every namespace with its contract fields, size and ages."""
    cfg = config()
    with admin_target(cfg) as target:
        rows = target.namespaces(tenant)
    if as_json:
        emit(True, rows)
        return
    for r in rows:
        out.print(namespace_line(r), soft_wrap=True, highlight=False)
    if not rows:
        out.print("no namespaces with chunks")


def _selector(
    model_revision: str | None,
    tokenizer_hash: str | None,
    chat_template_version: str | None,
    model: str | None,
) -> dict[str, str]:
    given = {
        "model_revision": model_revision,
        "tokenizer_hash": tokenizer_hash,
        "chat_template_version": chat_template_version,
        "model": model,
    }
    for k, v in given.items():
        if v is not None and (not v.strip() or len(v) > 1024):
            flag = "--" + k.replace("_", "-")
            raise _CliUsageError(f"{flag} needs a non-empty value of at most 1024 characters")
    sel = {k: v for k, v in given.items() if v is not None}
    if not (model_revision or tokenizer_hash or chat_template_version):
        raise _CliUsageError(
            "say what to invalidate: --model-revision, --tokenizer-hash or "
            "--chat-template-version (--model and --tenant only narrow it)"
        )
    return sel


def _describe(sel: dict[str, str], tenant: str | None) -> str:
    parts = [f"{k.replace('_', ' ')} {v!r}" for k, v in sel.items()]
    return " and ".join(parts) + (f" of tenant {tenant}" if tenant else "")


def _print_report(report: dict[str, Any]) -> None:
    verb = "would remove" if report["dry_run"] else "removed"
    for r in report["namespaces"]:
        c = r.get("contract") or {}
        out.print(
            f"{verb} {r['tenant']}/{r['namespace'][:16]} ({c.get('model_revision')}, "
            f"tokenizer {c.get('tokenizer_hash')}, template "
            f"{c.get('chat_template_version')}): {r.get('removed', r['chunks'])} chunks, "
            f"{human_bytes(r['bytes'])}",
            soft_wrap=True,
            highlight=False,
        )
    hidden = report.get("namespaces_total", len(report["namespaces"])) - len(report["namespaces"])
    if hidden > 0:
        out.print(f"… and {hidden} more namespaces (the counts below include them)")
    out.print(
        f"{verb} {report['removed_namespaces']} namespaces, {report['removed_chunks']} chunks, "
        f"{human_bytes(report['removed_bytes'])}"
        + (" on every node of the shared root" if report.get("shared_root") else ""),
        soft_wrap=True,
        highlight=False,
    )
    unknown = report["unknown_contract"]
    if unknown:
        total = report.get("unknown_contract_total", len(unknown))
        chunks = sum(u["chunks"] for u in unknown)
        of = (
            f"{chunks} chunks"
            if total == len(unknown)
            else f"{chunks} chunks in the first {len(unknown)}"
        )
        out.print(
            f"left {total} namespaces with an unknown contract ({of}): "
            "stored without registered fields, so they cannot be matched; "
            "`kvoffload purge --tenant T --namespace NS` removes one",
            soft_wrap=True,
            highlight=False,
        )


@app.command()
def invalidate(
    model_revision: Annotated[
        str | None,
        typer.Option(
            "--model-revision",
            metavar="REVISION",
            help="Revision (or model@revision) to invalidate.",
        ),
    ] = None,
    tokenizer_hash: Annotated[
        str | None,
        typer.Option(
            "--tokenizer-hash",
            metavar="HASH",
            help="Tokenizer hash to invalidate (as `kvoffload tokenizer-hash` prints it).",
        ),
    ] = None,
    chat_template_version: Annotated[
        str | None,
        typer.Option(
            "--chat-template-version",
            metavar="VERSION",
            help="Chat-template version to invalidate.",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", metavar="MODEL", help="Only this model's.")
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", "-t", metavar="TENANT", help="Only this tenant's namespaces."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report, remove nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Purge every namespace built under a model revision, tokenizer or chat template.

    Matches the contract fields that clients registered for each namespace;
    namespaces without registered fields are reported and left. On a shared
    root the purge reaches every node. Through the running sidecar when one
    serves the socket, else offline.
    """
    sel = _selector(model_revision, tokenizer_hash, chat_template_version, model)
    check_tenant(tenant)
    what = _describe(sel, tenant)
    cfg = config()
    with admin_target(cfg) as target:
        if dry_run:
            report = target.invalidate(sel, tenant, True)
        else:
            if not yes:
                preview = target.invalidate(sel, tenant, True)
                if preview["removed_namespaces"]:
                    question = (
                        f"Invalidate {what}: remove {preview['removed_namespaces']} namespaces, "
                        f"{preview['removed_chunks']} chunks, "
                        f"{human_bytes(preview['removed_bytes'])}?"
                    )
                    try:
                        ok = typer.confirm(question, default=False, err=True)
                    except typer.Abort:
                        err.print()
                        raise _Aborted(
                            f"nothing invalidated ({what}): no answer at the prompt; pass "
                            "--yes to invalidate without one"
                        ) from None
                    if not ok:
                        raise _Aborted(f"nothing invalidated ({what})")
            report = target.invalidate(sel, tenant, False)
    if as_json:
        emit(True, report)
    else:
        _print_report(report)
    if not report["removed_namespaces"]:
        # As a purge that matches nothing: exit 8, after the report (it names
        # the namespaces left with an unknown contract).
        raise _NothingToDo(
            f"no namespace in {target.where} matches {what} (a typo? `kvoffload ls "
            "--namespaces` lists each one's contract)"
        )
