"""``kvoffload audit``: read and verify the audit log beside the index (docs/spec/audit-v1.md).

Needs no KEK and no store lock: it reads the files while a sidecar writes them.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from .app import JsonOpt, app, check_tenant, config, emit, err, out
from .exits import _AuditBroken, _CliUsageError


def _since(text: str | None) -> float | None:
    """A duration back from now (``1h``), an ISO 8601 time, or unix seconds."""
    if text is None:
        return None
    from ..errors import ConfigError
    from ..units import parse_duration

    try:
        ago = parse_duration(text, allow_none=False, require_unit=True, what="--since")
        if ago is not None:
            return time.time() - ago
    except ConfigError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _CliUsageError(
            f"--since {text!r}: a duration (30m, 2h, 7d), an ISO 8601 time "
            "(2026-12-02T04:00:00Z) or unix seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _cell(value: Any) -> str:
    """A table cell: a field a record does not have (or has as null) is ``-``."""
    return "-" if value is None or value == "" else str(value)


def _matches(rec: dict[str, Any], since: float | None, tenant: str | None) -> bool:
    if since is not None and float(rec.get("ts", 0)) < since:
        return False
    if tenant is not None:
        tenants = rec.get("tenants")
        return rec.get("tenant") == tenant or (isinstance(tenants, list) and tenant in tenants)
    return True


@app.command("audit")
def audit(
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            metavar="WHEN",
            help="Only records since: 30m, 2h, 7d, an ISO time, unix secs.",
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant", "-t", metavar="TENANT", help="Only the records about this tenant."
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option("--verify", help="Check the hash chain and its anchor; exit 9 if broken."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print the audit log (purges, revocations, reloads, key events, admin verbs,
    refused access) and check its hash chain.

    With --verify a broken chain (a removed, edited or reordered line, a cut
    tail, a missing anchor) is one line naming the file and line, exit 9; so
    is a directory with no log at all (nothing to show intact).
    """
    from ..store.audit import ACTIVE, HEAD
    from ..store.audit import verify as verify_log

    check_tenant(tenant)
    cutoff = _since(since)
    cfg = config()
    directory = cfg.resolved_index_dir
    rep = verify_log(directory)  # AuditFormatError: "store: …", exit 1
    absent = not rep.files and not (directory / HEAD).exists()
    records = [r for r in rep.records if _matches(r, cutoff, tenant)]
    if as_json:
        emit(
            True,
            {
                "directory": str(directory),
                "files": rep.files,
                "present": not absent,
                "intact": rep.intact and not absent,
                "problems": [str(p) for p in rep.problems],
                "notes": rep.notes,
                "records": records,
            },
        )
    else:
        table = Table(title=f"audit log in {directory}")
        for col in ("seq", "time (UTC)", "event", "tenant", "verb", "result", "uid", "pid"):
            table.add_column(col)
        for r in records:
            when = dt.datetime.fromtimestamp(float(r.get("ts", 0)), dt.UTC)
            table.add_row(
                _cell(r.get("seq")),
                when.strftime("%Y-%m-%d %H:%M:%S"),
                _cell(r.get("event")),
                _cell(r.get("tenant") or ", ".join(map(str, r.get("tenants") or []))),
                *(_cell(r.get(k)) for k in ("verb", "result", "uid", "pid")),
            )
        if absent and verify:
            pass  # the one error line below says it
        elif not rep.files:
            out.print(f"no audit log in {directory}")
        else:
            out.print(table)
        for note in rep.notes:
            err.print(f"note: {note}")
        if rep.intact and rep.files:
            out.print(f"chain intact: {len(rep.records)} records in {len(rep.files)} file(s)")
    if absent and verify:
        raise _AuditBroken(
            f"no audit log in {directory} (no {ACTIVE}, no rotated file, no {HEAD}): "
            "nothing to verify; it was removed, or --index-dir/--config names another index"
        )
    if not rep.intact:
        if verify:
            raise _AuditBroken(f"the hash chain is broken at {rep.problems[0]}")
        if not as_json:
            err.print(f"warning: the hash chain is broken at {rep.problems[0]}")
