"""The policy file: reading, checking and parsing it into a :class:`~.policy.Policy`.

The format and its rules are written down in :mod:`.policy`'s docstring (and
``systemd/policy.example.toml``); every rule a file breaks refuses the whole
file with one :class:`~kvoffload.errors.PolicyError` naming the file, the key
and, where it can, the line.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import stat
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

from kvoffload import units
from kvoffload.errors import ConfigError, PolicyError

from .policy import (
    ALL_TENANTS,
    AllTenants,
    Grant,
    Policy,
    TenantPolicy,
    TenantSet,
    is_valid_tenant_id,
)

POLICY_VERSION: Final = 1
WILDCARD: Final = "*"

ENCRYPTIONS: Final[Mapping[str, bool]] = MappingProxyType({"aes-256-gcm": True, "none": False})

_UID_LIMIT: Final = 2**32 - 1  # (uid_t)-1 means "no change" to the kernel, never a real id


_TOP_KEYS: Final = ("version", "defaults", "tenants", "grants")
_DEFAULTS_KEYS: Final = (
    "encryption",
    "ttl",
    "quota",
    "events",
    "max_age",
    "idle_ttl",
    "lookup_floor",
    "lookup_jitter",
)
_TENANT_KEYS: Final = (
    "encryption",
    "ttl",
    "max_age",
    "idle_ttl",
    "sensitivity",
    "quota",
    "trust_group",
    "direct",
    "direct_group",
    "events",
    "lookup_floor",
    "lookup_jitter",
    "share_prefixes",
)
_PER_TENANT_ONLY: Final = (
    "trust_group",
    "direct",
    "direct_group",
    "sensitivity",
    "share_prefixes",
)

SENSITIVITIES: Final = ("normal", "high")
#: ``sensitivity = "high"``: the defaults of max_age and idle_ttl where the
#: tenant's table sets neither (a value from [defaults] does not count: only a
#: deliberate, per-tenant choice overrides them, and never with "none").
HIGH_SENSITIVITY_MAX_AGE_S: Final = 3600.0
HIGH_SENSITIVITY_IDLE_TTL_S: Final = 600.0
#: ``sensitivity = "high"``: the default lookup floor (seconds) where the
#: tenant's table sets no ``lookup_floor`` (every lookup reply takes at least
#: this long, so a hit and a miss look alike in time; docs/threat-model.md).
HIGH_SENSITIVITY_LOOKUP_FLOOR_S: Final = 0.002
#: Keys that would let a tenant share a prefix namespace with other tenants
#: (trust-group sharing); a high-sensitivity tenant may set none of them.
_SHARING_KEYS: Final = ("share_prefixes", "shared_salt", "share_salt")
_GRANT_KEYS: Final = ("uid", "gid", "user", "group", "tenants", "admin")
_PRINCIPAL_KEYS: Final = ("uid", "gid", "user", "group")
#: The largest lookup_floor and lookup_jitter: a padded lookup is on the engine's
#: scheduler path, and a second of it per request is already far past useful.
MAX_LOOKUP_PADDING_S: Final = 1.0


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate the policy file at ``path``."""
    source = os.fspath(path)
    try:
        with Path(path).open("rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except OSError as exc:
        raise PolicyError(source, f"cannot read policy: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise PolicyError(source, "policy is not a regular file")
    if st.st_mode & stat.S_IWOTH:
        raise PolicyError(
            source,
            f"policy is writable by everyone (mode {stat.filemode(st.st_mode)}); refusing it",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PolicyError(source, "policy is not valid UTF-8", line) from exc
    return parse_policy(text, source=source)


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """The policy in ``text`` (a policy file's contents), checked."""
    return _Parser(text, source).parse()


# -- parsing --------------------------------------------------------------------------

_Path = tuple[str | int, ...]

_BARE_OR_QUOTED = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEYS = rf"{_BARE_OR_QUOTED}(?:\s*\.\s*{_BARE_OR_QUOTED})*"
_ARRAY_HEADER_RE: Final = re.compile(rf"^\s*\[\[\s*({_KEYS})\s*\]\]")
_TABLE_HEADER_RE: Final = re.compile(rf"^\s*\[\s*({_KEYS})\s*\]")
_KEY_LINE_RE: Final = re.compile(rf"^\s*({_KEYS})\s*=")
_KEY_PART_RE: Final = re.compile(_BARE_OR_QUOTED)
_TOML_POS_RE: Final = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def _unquote(key: str) -> str:
    if key.startswith("'"):
        return key[1:-1]
    if key.startswith('"'):
        # TOML's basic-string escapes are JSON's plus \U; a key JSON cannot
        # read stays as written, which only costs the line number.
        try:
            return str(json.loads(key))
        except ValueError:
            return key[1:-1]
    return key


def _split_keys(keys: str) -> tuple[str, ...]:
    return tuple(_unquote(k) for k in _KEY_PART_RE.findall(keys))


class _Locator:
    """Finds the line that defines a key path, for messages about semantic errors.

    tomllib returns plain dicts without positions, so this re-reads the text
    just far enough to map table headers and ``key =`` lines to key paths
    (``("grants", 2, "uid")``). For a path it has no line for, it gives the
    line of the nearest enclosing table; failing that, None.
    """

    def __init__(self, text: str) -> None:
        self._entries: list[tuple[_Path, int]] = []
        current: _Path = ()
        arrays: dict[tuple[str, ...], int] = {}
        in_multiline: str | None = None
        for lineno, line in enumerate(text.splitlines(), start=1):
            if in_multiline is not None:
                if line.count(in_multiline) % 2 == 1:
                    in_multiline = None
                continue
            if m := _ARRAY_HEADER_RE.match(line):
                base = _split_keys(m.group(1))
                arrays[base] = arrays.get(base, -1) + 1
                current = (*base, arrays[base])
                self._entries.append((current, lineno))
            elif m := _TABLE_HEADER_RE.match(line):
                current = _split_keys(m.group(1))
                self._entries.append((current, lineno))
            elif m := _KEY_LINE_RE.match(line):
                self._entries.append(((*current, *_split_keys(m.group(1))), lineno))
            for delim in ('"""', "'''"):
                if line.count(delim) % 2 == 1:
                    in_multiline = delim
                    break

    def line_of(self, path: _Path) -> int | None:
        # Exact key first; then the first line inside it (a table only ever
        # named in headers such as [tenant.acme]); then the innermost
        # enclosing table or inline-table key.
        best_len, best_line = 0, None
        for entry, lineno in self._entries:
            if entry == path:
                return lineno
        for entry, lineno in self._entries:
            if path and entry[: len(path)] == path:
                return lineno
        for entry, lineno in self._entries:
            n = len(entry)
            if best_len < n < len(path) and path[:n] == entry:
                best_len, best_line = n, lineno
        return best_line


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _fmt_path(path: _Path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _high_defaults(
    table: Mapping[str, Any], max_age_s: float | None, idle_ttl_s: float | None, floor: float
) -> tuple[float | None, float | None, float]:
    """What ``sensitivity = "high"`` sets where the tenant's table leaves it out:
    ``max_age``, ``idle_ttl`` and the lookup floor (module docstring)."""
    if "max_age" not in table:
        max_age_s = HIGH_SENSITIVITY_MAX_AGE_S
    if "idle_ttl" not in table:
        idle_ttl_s = HIGH_SENSITIVITY_IDLE_TTL_S
    if "lookup_floor" not in table:
        floor = max(floor, HIGH_SENSITIVITY_LOOKUP_FLOOR_S)
    return max_age_s, idle_ttl_s, floor


class _Parser:
    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self._locator: _Locator | None = None

    def fail(self, path: _Path, reason: str) -> PolicyError:
        if self._locator is None:
            self._locator = _Locator(self.text)
        return PolicyError(self.source, reason, self._locator.line_of(path))

    def parse(self) -> Policy:
        doc = self._load()
        self._check_keys(doc, (), _TOP_KEYS)
        if "version" not in doc:
            raise self.fail((), f"missing 'version = {POLICY_VERSION}' at the top of the policy")
        version = doc["version"]
        if isinstance(version, bool) or version != POLICY_VERSION:
            raise self.fail(
                ("version",),
                f"unsupported policy version {_describe(version)}; this kvoffload reads "
                f"version {POLICY_VERSION}",
            )

        defaults = self._tenant_table(
            self._table(doc, ("defaults",)), ("defaults",), TenantPolicy(), _DEFAULTS_KEYS
        )
        tenants: dict[str, TenantPolicy] = {}
        for name, table in self._table(doc, ("tenants",)).items():
            path: _Path = ("tenants", name)
            if not is_valid_tenant_id(name):
                raise self.fail(path, self._bad_tenant(name))
            if not isinstance(table, dict):
                raise self.fail(path, f"tenants.{name} must be a table, not {_describe(table)}")
            tenants[name] = self._tenant_table(table, path, defaults, _TENANT_KEYS)

        raw_grants = doc.get("grants", [])
        if not isinstance(raw_grants, list):
            raise self.fail(("grants",), "'grants' must be an array of tables ([[grants]])")
        grants = [self._grant(g, ("grants", i)) for i, g in enumerate(raw_grants)]
        self._check_trust_groups(tenants, grants)
        return Policy(defaults=defaults, tenants=tenants, grants=grants, source=self.source)

    def _load(self) -> dict[str, Any]:
        try:
            return tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            msg = str(exc)
            m = _TOML_POS_RE.match(msg)
            if m is None:
                raise PolicyError(self.source, f"invalid TOML: {msg}") from exc
            raise PolicyError(
                self.source, f"invalid TOML: {m['msg']}", int(m["line"]), int(m["col"])
            ) from exc

    def _check_keys(self, table: Mapping[str, Any], path: _Path, allowed: Sequence[str]) -> None:
        for key in table:
            if key not in allowed:
                where = f"in [{_fmt_path(path)}]" if path else "at the top level"
                raise self.fail(
                    (*path, key),
                    f"unknown key {key!r} {where}; allowed: {', '.join(allowed)}",
                )

    def _table(self, doc: Mapping[str, Any], path: tuple[str]) -> dict[str, Any]:
        value = doc.get(path[0], {})
        if not isinstance(value, dict):
            raise self.fail(path, f"'{path[0]}' must be a table, not {_describe(value)}")
        return value

    def _bad_tenant(self, name: object) -> str:
        return (
            f"invalid tenant id {name!r}: 1-64 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )

    def _tenant_table(
        self,
        table: Mapping[str, Any],
        path: _Path,
        base: TenantPolicy,
        allowed: Sequence[str],
    ) -> TenantPolicy:
        # The rules are checked in this order: the first one a file breaks is the one
        # its error names.
        if path == ("defaults",):
            self._refuse_per_tenant_keys(table, path)
        self._check_keys(table, path, allowed)
        encryption = self._encryption(table, path, base.encryption)
        ttl_s = self._duration(table["ttl"], (*path, "ttl")) if "ttl" in table else base.ttl_s
        max_age_s = self._optional_duration(table, path, "max_age", base.max_age_s)
        idle_ttl_s = self._optional_duration(table, path, "idle_ttl", base.idle_ttl_s)
        sensitivity = table.get("sensitivity", "normal")
        if sensitivity not in SENSITIVITIES:
            raise self.fail(
                (*path, "sensitivity"),
                f'sensitivity must be "normal" or "high", not {_describe(sensitivity)}',
            )
        quota = (
            self._size(table["quota"], (*path, "quota")) if "quota" in table else base.quota_bytes
        )
        trust_group = self._trust_group(table, path, base.trust_group)
        direct, direct_gid = self._direct(table, path, encryption)
        events = self._flag(table, path, "events", base.events)
        if sensitivity == "high":
            self._check_high(table, path, encryption, direct)
            events = False
        share = self._share_prefixes(table, path, trust_group)
        floor = self._padding(table, path, "lookup_floor", base.lookup_floor_s)
        jitter = self._padding(table, path, "lookup_jitter", base.lookup_jitter_s)
        if sensitivity == "high":
            max_age_s, idle_ttl_s, floor = _high_defaults(table, max_age_s, idle_ttl_s, floor)
        return TenantPolicy(
            encryption, ttl_s, quota, trust_group, direct, direct_gid, events,
            max_age_s, idle_ttl_s, sensitivity, floor, jitter, share,
        )  # fmt: skip

    def _refuse_per_tenant_keys(self, table: Mapping[str, Any], path: _Path) -> None:
        for key in _PER_TENANT_ONLY:
            if key in table:
                raise self.fail(
                    (*path, key),
                    f"{key} is set per tenant, in [tenants.<id>], not in [defaults]",
                )

    def _encryption(self, table: Mapping[str, Any], path: _Path, base: bool) -> bool:
        if "encryption" not in table:
            return base
        value = table["encryption"]
        if not isinstance(value, str) or value not in ENCRYPTIONS:
            raise self.fail(
                (*path, "encryption"),
                f"encryption must be one of {', '.join(map(repr, ENCRYPTIONS))}, "
                f"not {_describe(value)}",
            )
        return ENCRYPTIONS[value]

    def _optional_duration(
        self, table: Mapping[str, Any], path: _Path, key: str, base: float | None
    ) -> float | None:
        """``max_age``/``idle_ttl``: a duration or "none"; ``base`` where the key is absent."""
        if key not in table:
            return base
        return self._duration(table[key], (*path, key), key)

    def _trust_group(self, table: Mapping[str, Any], path: _Path, base: str | None) -> str | None:
        if "trust_group" not in table:
            return base
        value = table["trust_group"]
        if not is_valid_tenant_id(value):
            raise self.fail(
                (*path, "trust_group"),
                f"trust_group must be a name of 1-64 characters of [A-Za-z0-9._-], "
                f"not {_describe(value)}",
            )
        return str(value)

    def _flag(self, table: Mapping[str, Any], path: _Path, key: str, default: bool) -> bool:
        """A true/false setting; ``default`` where it is absent."""
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise self.fail((*path, key), f"{key} must be true or false, not {_describe(value)}")
        return value

    def _direct(
        self, table: Mapping[str, Any], path: _Path, encryption: bool
    ) -> tuple[bool, int | None]:
        """``direct`` and the gid of ``direct_group`` (None: not set)."""
        direct = self._flag(table, path, "direct", False)
        if direct and encryption:
            raise self.fail(
                (*path, "direct"),
                'direct = true needs encryption = "none": a worker writing its own files has '
                "no data key, and a sealed tenant's bytes never leave the sidecar in plaintext",
            )
        if "direct_group" not in table:
            return direct, None
        if not direct:
            raise self.fail(
                (*path, "direct_group"), "direct_group is only meaningful with direct = true"
            )
        return direct, self._group_id(table["direct_group"], (*path, "direct_group"))

    def _share_prefixes(
        self, table: Mapping[str, Any], path: _Path, trust_group: str | None
    ) -> bool:
        share = self._flag(table, path, "share_prefixes", False)
        if share and trust_group is None:
            raise self.fail(
                (*path, "share_prefixes"),
                "share_prefixes = true needs a trust_group: it makes this tenant the "
                "shared prefix namespace of that group",
            )
        return share

    def _check_high(
        self, table: Mapping[str, Any], path: _Path, encryption: bool, direct: bool
    ) -> None:
        """The rules of ``sensitivity = "high"`` (module docstring)."""
        if not encryption:
            raise self.fail(
                (*path, "encryption") if "encryption" in table else (*path, "sensitivity"),
                'a tenant with sensitivity = "high" must be encrypted: '
                'encryption = "none" (here or from [defaults]) is refused',
            )
        if direct:
            raise self.fail(
                (*path, "direct"),
                'a tenant with sensitivity = "high" may not use the direct path '
                "(its bytes would be stored in plaintext)",
            )
        for key in _SHARING_KEYS:
            if key in table:
                raise self.fail(
                    (*path, key),
                    f'a tenant with sensitivity = "high" keeps its own prefix namespace: '
                    f"{key} is refused",
                )
        for key in ("max_age", "idle_ttl"):
            if key in table and table[key] == "none":
                raise self.fail(
                    (*path, key),
                    f'a tenant with sensitivity = "high" has a {key}: "none" is refused '
                    "(set a duration, or leave it out for the default)",
                )
        if table.get("events", False) is not False:
            raise self.fail(
                (*path, "events"),
                'a tenant with sensitivity = "high" never has its chunks announced on '
                "the KV-event feed: leave events out or set it to false",
            )

    def _padding(self, table: Mapping[str, Any], path: _Path, key: str, base: float) -> float:
        """``lookup_floor``/``lookup_jitter``: a duration of 0 to 1 s ("none" is 0)."""
        if key not in table:
            return base
        value = table[key]
        try:
            seconds = units.parse_duration(value, require_unit=True, what=f"duration for {key}")
        except ConfigError as exc:
            raise self.fail((*path, key), str(exc)) from None
        seconds = 0.0 if seconds is None else seconds
        if not 0.0 <= seconds <= MAX_LOOKUP_PADDING_S:
            raise self.fail(
                (*path, key),
                f"{key} must be between 0s and {MAX_LOOKUP_PADDING_S:g}s, not {value!r}: "
                "it delays every lookup reply of the tenant",
            )
        return seconds

    def _check_trust_groups(
        self, tenants: Mapping[str, TenantPolicy], grants: Sequence[Grant]
    ) -> None:
        """keys-v1.md §12: one shared tenant per group; its grants stay inside the group."""
        shared: dict[str, str] = {}
        for name, tp in tenants.items():
            if tp.share_prefixes and tp.trust_group is not None:
                first = shared.setdefault(tp.trust_group, name)
                if first != name:
                    raise self.fail(
                        ("tenants", name, "share_prefixes"),
                        f"trust group {tp.trust_group!r} already has a shared tenant, "
                        f"{first!r}: a group shares prefixes through exactly one tenant",
                    )
        owner = {t: g for g, t in shared.items()}
        for i, g in enumerate(grants):
            if isinstance(g.tenants, AllTenants):
                continue
            for name in sorted(g.tenants):
                group = owner.get(name)
                if group is None:
                    continue
                outside = sorted(
                    t
                    for t in g.tenants
                    if (tenants[t].trust_group if t in tenants else None) != group
                )
                if outside:
                    raise self.fail(
                        ("grants", i, "tenants"),
                        f"grant for {g.label} lists {name!r}, the shared prefix namespace of "
                        f"trust group {group!r}, together with {', '.join(map(repr, outside))} "
                        "outside that group: a worker that writes a group's shared prefixes "
                        "must serve only that group",
                    )

    def _group_id(self, value: object, path: _Path) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < _UID_LIMIT:
                raise self.fail(path, f"gid {value} is out of range")
            return value
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"a group name or gid, not {_describe(value)}")
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise self.fail(path, f"unknown group {value!r} (not in the group database)") from None

    def _duration(self, value: object, path: _Path, what: str = "ttl") -> float | None:
        try:
            seconds = units.parse_duration(value, require_unit=True, what=f"duration for {what}")
        except ConfigError as exc:
            raise self.fail(path, str(exc)) from None
        if seconds is not None and seconds <= 0:
            raise self.fail(
                path, f'{what} must be positive, not {value!r}; use "none" for no {what}'
            )
        return seconds

    def _size(self, value: object, path: _Path) -> int | None:
        try:
            return units.parse_size(value, require_unit=True, whole=True, what="size for quota")
        except ConfigError as exc:
            raise self.fail(path, str(exc)) from None

    def _grant(self, raw: object, path: _Path) -> Grant:
        if not isinstance(raw, dict):
            raise self.fail(path, f"each grant must be a table, not {_describe(raw)}")
        self._check_keys(raw, path, _GRANT_KEYS)
        named = [k for k in _PRINCIPAL_KEYS if k in raw]
        if len(named) != 1:
            raise self.fail(
                path,
                "a grant names exactly one of uid, gid, user, group"
                + (f"; this one has {', '.join(named)}" if named else ""),
            )
        kind = named[0]
        value = raw[kind]
        principal: Literal["uid", "gid"]
        if kind in ("uid", "gid"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail((*path, kind), f"{kind} must be an integer, not {_describe(value)}")
            if not 0 <= value < _UID_LIMIT:
                raise self.fail((*path, kind), f"{kind} {value} is out of range")
            principal = "uid" if kind == "uid" else "gid"
            ident, label = value, f"{kind} {value}"
        else:
            if not isinstance(value, str) or not value:
                raise self.fail((*path, kind), f"{kind} must be a name, not {_describe(value)}")
            try:
                if kind == "user":
                    principal, ident = "uid", pwd.getpwnam(value).pw_uid
                else:
                    principal, ident = "gid", grp.getgrnam(value).gr_gid
            except KeyError:
                raise self.fail(
                    (*path, kind), f"unknown {kind} {value!r} (not in the {kind} database)"
                ) from None
            label = f"{kind} {value!r} ({principal} {ident})"

        if "tenants" not in raw:
            raise self.fail(path, f"grant for {label} has no 'tenants' list")
        tenants = self._tenant_list(raw["tenants"], (*path, "tenants"))
        admin = raw.get("admin", False)
        if not isinstance(admin, bool):
            raise self.fail(
                (*path, "admin"), f"admin must be true or false, not {_describe(admin)}"
            )
        return Grant(principal, ident, tenants, admin, label)

    def _tenant_list(self, value: object, path: _Path) -> TenantSet:
        if not isinstance(value, list):
            raise self.fail(path, f"tenants must be an array of tenant ids, not {_describe(value)}")
        if WILDCARD in value:
            if len(value) != 1:
                raise self.fail(path, f'"{WILDCARD}" stands for every tenant and must stand alone')
            return ALL_TENANTS
        for name in value:
            if not is_valid_tenant_id(name):
                raise self.fail(path, self._bad_tenant(name))
        return frozenset(value)


__all__ = ["POLICY_VERSION", "load_policy", "parse_policy"]
