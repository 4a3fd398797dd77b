"""``kvoffload policy diff OLD NEW`` and the engine side of ``kvoffload purge --engine``.

``policy diff`` prints what a reload from OLD to NEW would change (grants
added and removed per principal, tenants added, removed and revoked,
per-tenant settings); both files are checked as a reload checks them, and an
invalid one is one line naming the file and line, exit 1.

``purge --engine URL`` reaches what kvoffload cannot: a vLLM engine's own
prefix caches (GPU, and the CPU tier of its offloading). vLLM offers
``POST /reset_prefix_cache`` (``vllm/entrypoints/serve/dev/cache/api_router.py``),
served only when the engine runs with ``VLLM_SERVER_DEV_MODE=1``; it resets
the cache of **every tenant of that engine**, not only the purged one, and
answers ``{"success": false}`` while blocks are held by running requests.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer

from .app import JsonOpt, emit, out
from .config_cmds import policy_app

#: How long one engine may take to answer ``/reset_prefix_cache``.
ENGINE_TIMEOUT_S = 10.0


@policy_app.command("diff")
def policy_diff_cmd(
    old: Annotated[
        Path, typer.Argument(metavar="OLD", readable=False, help="The policy in force (TOML).")
    ],
    new: Annotated[
        Path, typer.Argument(metavar="NEW", readable=False, help="The edited policy (TOML).")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Show what a reload from OLD to NEW would change (nothing is reloaded).

    Lines: `+ grant uid N: T` / `- grant …` (grants added or removed per
    principal), `~ admin …`, `+ tenant T`, `- tenant T (revoked …)` (a tenant
    NEW no longer names is revoked: served to nobody until granted again),
    `~ T key = old -> new` (settings, as the file writes them: `~ acme ttl =
    "12h" -> "1h"`; --json: each changed field in bytes and seconds). Exit 0
    whether or not they differ; 1 (one line, file:line) if either file is invalid.
    """
    from ..sidecar.access.policy_file import load_policy
    from ..sidecar.access.revocation import diff_is_empty, format_diff, policy_diff

    d = policy_diff(load_policy(old), load_policy(new))
    if as_json:
        emit(True, {"old": str(old), "new": str(new), "changed": not diff_is_empty(d), **d})
        return
    lines = format_diff(d)
    if not lines:
        out.print(f"no change from {old} to {new}")
    for line in lines:
        out.print(line)


def engine_url(raw: str) -> str:
    """``http(s)://host:port`` of an engine, from what the user typed."""
    url = raw if "://" in raw else f"http://{raw}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--engine {raw!r}: not an http(s) URL of a vLLM server")
    return url.rstrip("/")


def reset_engine(url: str, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
    """POST ``<url>/reset_prefix_cache``: ``{"engine", "ok", "detail"}``, never raises."""
    endpoint = f"{url}/reset_prefix_cache"
    req = urllib.request.Request(endpoint, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read(65536)
    except urllib.error.HTTPError as exc:
        detail = f"HTTP {exc.code} from {endpoint}"
        if exc.code == 404:
            detail += " (start vLLM with VLLM_SERVER_DEV_MODE=1 to serve it)"
        return {"engine": url, "ok": False, "detail": detail}
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"engine": url, "ok": False, "detail": f"unreachable: {reason}"}
    try:
        success = json.loads(body).get("success")
    except (ValueError, AttributeError):
        success = None
    if success is True:
        return {"engine": url, "ok": True, "detail": "prefix cache reset (every tenant)"}
    if success is False:
        return {
            "engine": url,
            "ok": False,
            "detail": "the engine refused (blocks still held by running requests); retry",
        }
    return {"engine": url, "ok": False, "detail": "not a vLLM reset_prefix_cache answer"}


__all__ = ["ENGINE_TIMEOUT_S", "engine_url", "policy_diff_cmd", "reset_engine"]
