"""Revocation at once (protocol-v1.md §6.1): what a policy change takes away, and when.

Three parts:

* :func:`policy_diff`: what replacing one policy by another changes (grants
  added and removed per principal, tenants added, removed and revoked,
  per-tenant settings changed); ``kvoffload policy diff`` prints it and a
  reload logs it.
* :class:`RevokedSet`: tenants *revoked* by a reload, i.e. named by the old
  policy (a ``[tenants.X]`` table or a grant's list) and by none of the new
  one's. Their chunks are served to nobody, not even through a ``"*"`` grant
  or to an admin, until a later policy names the tenant in a grant again;
  ``purge`` remains the way to erase them. The set is kept in
  ``<index_dir>/revoked.json`` (written atomically), so it survives a restart.
* :class:`PolicyState`: the policy's source, generation, load time and the
  last reload's outcome, for ``stats`` and the metrics.

The session side (``session.py``) compares the service's policy generation
with the one its cached decisions were made under, per request; the service
(``service.py``) releases, at the moment of the swap, the handles a
connection no longer may hold and cancels the loads in flight of a tenant
some connection lost (``Store.cancel_loads``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from kvoffload.errors import ConfigError
from kvoffload.posix import atomic_create
from kvoffload.units import duration_setting, size_setting

from .policy import AllTenants, Grant, Policy, TenantPolicy

log = logging.getLogger("kvoffload.server")

REVOKED_VERSION: Final = 1
REVOKED_FILE: Final = "revoked.json"


# ---------------------------------------------------------------------------
# What a policy names


def named_tenants(policy: object) -> frozenset[str]:
    """Tenants a policy names: its ``[tenants.X]`` tables and its grants' lists."""
    if not isinstance(policy, Policy):
        return frozenset()
    out = set(policy.tenants)
    for g in policy.grants:
        if not isinstance(g.tenants, AllTenants):
            out |= g.tenants
    return frozenset(out)


def granted_tenants(policy: object) -> frozenset[str]:
    """Tenants named in a grant's list (not ``"*"``): these are "granted again"."""
    if not isinstance(policy, Policy):
        return frozenset()
    out: set[str] = set()
    for g in policy.grants:
        if not isinstance(g.tenants, AllTenants):
            out |= g.tenants
    return frozenset(out)


def _principal(g: Grant) -> str:
    return f"{g.principal} {g.id}"


def _access(policy: Policy) -> dict[str, tuple[frozenset[str] | None, bool]]:
    """principal → (tenants, None for "*"; admin)."""
    out: dict[str, tuple[frozenset[str] | None, bool]] = {}
    for g in policy.grants:
        key = _principal(g)
        old_t, old_admin = out.get(key, (frozenset(), False))
        if old_t is None or isinstance(g.tenants, AllTenants):
            tenants: frozenset[str] | None = None
        else:
            tenants = old_t | g.tenants
        out[key] = (tenants, old_admin or g.admin)
    return out


def _settings(tp: TenantPolicy) -> dict[str, Any]:
    return {f.name: getattr(tp, f.name) for f in fields(tp)}


def policy_diff(old: Policy, new: Policy) -> dict[str, Any]:
    """What replacing ``old`` by ``new`` changes; plain data (JSON-ready).

    ``grants``: per principal (``uid N`` / ``gid N``) the tenants ``added``
    and ``removed`` (``"*"`` for every tenant) and an ``admin`` change.
    ``tenants``: ``added`` / ``removed`` (named by one policy only) and
    ``revoked`` (what a reload would revoke: named before, not at all now).
    ``settings``: per tenant whose effective settings change (``[defaults]``
    under ``"[defaults]"``), each changed field as ``[old, new]``.
    """
    grants: dict[str, dict[str, Any]] = {}
    a, b = _access(old), _access(new)
    for principal in sorted(set(a) | set(b)):
        ot, oadm = a.get(principal, (frozenset(), False))
        nt, nadm = b.get(principal, (frozenset(), False))
        entry: dict[str, Any] = {}
        if ot != nt:
            if ot is None or nt is None:
                added = ["*"] if nt is None else sorted(nt)
                removed = ["*"] if ot is None else sorted(ot)
            else:
                added, removed = sorted(nt - ot), sorted(ot - nt)
            if added:
                entry["added"] = added
            if removed:
                entry["removed"] = removed
        if oadm != nadm:
            entry["admin"] = [oadm, nadm]
        if entry:
            grants[principal] = entry
    on, nn = named_tenants(old), named_tenants(new)
    settings: dict[str, dict[str, list[Any]]] = {}
    od, nd = _settings(old.defaults), _settings(new.defaults)
    if od != nd:
        settings["[defaults]"] = {k: [od[k], nd[k]] for k in od if od[k] != nd[k]}
    for t in sorted(on & nn):
        os_, ns = _settings(old.tenant(t)), _settings(new.tenant(t))
        changed = {k: [os_[k], ns[k]] for k in os_ if os_[k] != ns[k]}
        if changed:
            settings[t] = changed
    return {
        "grants": grants,
        "tenants": {
            "added": sorted(nn - on),
            "removed": sorted(on - nn),
            "revoked": sorted(on - nn),
        },
        "settings": settings,
    }


def diff_is_empty(d: Mapping[str, Any]) -> bool:
    t = d["tenants"]
    return not (d["grants"] or d["settings"] or t["added"] or t["removed"])


def format_diff(d: Mapping[str, Any]) -> list[str]:
    """Human lines for :func:`policy_diff` (``kvoffload policy diff``)."""
    lines: list[str] = []
    for principal, e in d["grants"].items():
        if e.get("added"):
            lines.append(f"+ grant {principal}: {', '.join(e['added'])}")
        if e.get("removed"):
            lines.append(f"- grant {principal}: {', '.join(e['removed'])}")
        if "admin" in e:
            lines.append(f"~ admin {principal}: {str(e['admin'][0]).lower()} -> "
                         f"{str(e['admin'][1]).lower()}")  # fmt: skip
    t = d["tenants"]
    for name in t["added"]:
        lines.append(f"+ tenant {name}")
    for name in t["removed"]:
        lines.append(f"- tenant {name} (revoked: served to nobody until granted again)")
    for name, changed in d["settings"].items():
        for k, (o, n) in changed.items():
            key, old_text = setting_as_written(k, o)
            lines.append(f"~ {name} {key} = {old_text} -> {setting_as_written(k, n)[1]}")
    return lines


#: TenantPolicy field → the policy file's key and how a value of it is written there.
_AS_WRITTEN: dict[str, tuple[str, Callable[[Any], str]]] = {
    "encryption": ("encryption", lambda v: '"aes-256-gcm"' if v else '"none"'),
    "ttl_s": ("ttl", lambda v: f'"{duration_setting(v)}"'),
    "quota_bytes": ("quota", lambda v: f'"{size_setting(v)}"'),
    "max_age_s": ("max_age", lambda v: f'"{duration_setting(v)}"'),
    "idle_ttl_s": ("idle_ttl", lambda v: f'"{duration_setting(v)}"'),
    "lookup_floor_s": ("lookup_floor", lambda v: f'"{duration_setting(v)}"'),
    "lookup_jitter_s": ("lookup_jitter", lambda v: f'"{duration_setting(v)}"'),
    "direct_gid": ("direct_group", lambda v: "(none)" if v is None else str(v)),
}


def setting_as_written(field_name: str, value: Any) -> tuple[str, str]:
    """A tenant setting as the policy file spells it: ``("ttl", '"12h"')`` for
    ``ttl_s = 43200.0``; booleans ``true``/``false``, strings quoted, unset ``(none)``."""
    if field_name in _AS_WRITTEN:
        key, show = _AS_WRITTEN[field_name]
        return key, show(value)
    if isinstance(value, bool):
        return field_name, "true" if value else "false"
    if value is None:
        return field_name, "(none)"
    return field_name, json.dumps(value) if isinstance(value, str) else str(value)


# ---------------------------------------------------------------------------
# The revoked set


class RevokedSet:
    """Tenants revoked by a policy change (see the module docstring); thread-safe reads.

    Besides the revoked tenants it keeps the tenants the policy in force
    names, so that a tenant removed from the file while the daemon was down
    is revoked when the daemon starts with the new file, as a reload would.
    ``path`` None keeps both in memory only (a server without a store
    directory, in tests); otherwise every change is written atomically
    (0600) before it takes effect.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._mu = threading.Lock()
        self._tenants: frozenset[str] = frozenset()
        self._named: frozenset[str] | None = None
        if path is not None:
            self._tenants, self._named = self._load(path)

    @staticmethod
    def _load(path: Path) -> tuple[frozenset[str], frozenset[str] | None]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return frozenset(), None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != REVOKED_VERSION:
                raise ValueError("not a version-1 revoked-tenant list")
            lists = [doc["tenants"], doc.get("named", [])]
            for v in lists:
                if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
                    raise ValueError("a list of tenant ids expected")
        except (ValueError, KeyError) as exc:
            # Fail closed: serving a revoked tenant is worse than not starting.
            raise ConfigError(
                f"{path}: the revoked-tenant list is unreadable ({exc}); restore it, or "
                "remove it to revoke nothing"
            ) from None
        named = frozenset(doc["named"]) if "named" in doc else None
        return frozenset(doc["tenants"]), named

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants

    @property
    def tenants(self) -> frozenset[str]:
        return self._tenants

    def apply(self, policy: object) -> tuple[list[str], list[str]]:
        """``policy`` is now in force: revoke what the previous one named and it
        does not, restore what its grants name. (Newly revoked, restored.)"""
        named = named_tenants(policy)
        with self._mu:
            before = self._tenants
            removed = (self._named or frozenset()) - named
            after = (before | removed) - (granted_tenants(policy) - removed)
            if (after, named) != (before, self._named) and self._path is not None:
                data = json.dumps(
                    {"version": REVOKED_VERSION, "tenants": sorted(after), "named": sorted(named)},
                    sort_keys=True,
                ).encode()
                atomic_create(self._path, data, mode=0o600, replace=True)
            self._tenants, self._named = after, named
            return sorted(after - before), sorted(before - after)


# ---------------------------------------------------------------------------
# The policy's state, for stats and metrics


@dataclass
class PolicyState:
    source: str = "<built-in>"
    generation: int = 0
    loaded_at: float = field(default_factory=time.time)
    last_reload_at: float | None = None
    last_reload_ok: bool = True
    last_error: str | None = None
    reloads_ok: int = 0
    reloads_refused: int = 0

    def to_stats(self, revoked: Iterable[str]) -> dict[str, Any]:
        return {
            "source": self.source,
            "generation": self.generation,
            "loaded_at": self.loaded_at,
            "last_reload_at": self.last_reload_at,
            "last_reload_ok": self.last_reload_ok,
            "last_error": self.last_error,
            "reloads": {"ok": self.reloads_ok, "refused": self.reloads_refused},
            "revoked_tenants": sorted(revoked),
        }


def revoked_path(index_dir: str | os.PathLike[str]) -> Path:
    return Path(index_dir) / REVOKED_FILE


__all__ = [
    "REVOKED_FILE",
    "PolicyState",
    "RevokedSet",
    "diff_is_empty",
    "format_diff",
    "granted_tenants",
    "named_tenants",
    "policy_diff",
    "revoked_path",
]
