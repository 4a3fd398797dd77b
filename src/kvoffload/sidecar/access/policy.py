"""The access policy: which peers may use which tenants, and each tenant's settings.

The sidecar's socket is 0660 with a dedicated group, so anyone who can connect
is a legitimate client of *some* tenant; this file decides which. Each
connection's ``SO_PEERCRED`` uid and groups are looked up in the grants, and a
request for a tenant that the peer may not use is answered as if the tenant
were empty. The file is TOML (``/etc/kvoffload/policy.toml``)::

    version = 1                     # required; the only version there is

    [defaults]                      # settings of tenants without their own table
    encryption = "aes-256-gcm"      # or "none": stored in plaintext, still checksummed
    ttl = "7d"                      # 30s, 15m, 12h, 7d (also 1.5h), or "none"
    quota = "200GiB"                # B, KiB, MiB, GiB, TiB, PiB; KB, MB, GB, TB, PB
                                    # (powers of ten); or "none". The tenant's stored +
                                    # in-flight bytes; its own LRU chunks make room

    max_age = "none"                # hard limit on a chunk's age from its creation
    idle_ttl = "none"               # a chunk not accessed for this long expires

    [tenants.acme]                  # a table per tenant with settings of its own;
    encryption = "none"             # a key left out is taken from [defaults]
    ttl = "1h"
    quota = "10GiB"
    trust_group = "prod"            # optional, per tenant only: the tenant's keys are
                                    # bound to the group (docs/spec/keys-v1.md §12)
    share_prefixes = false          # optional, per tenant, needs trust_group: this tenant
                                    # is its group's one shared prefix namespace (§12)
    direct = true                   # optional, per tenant, needs encryption = "none":
                                    # workers may write and read this tenant's objects
                                    # themselves (GPUDirect Storage); docs/spec/layout-v1.md §4.1
    events = false                  # optional: never publish this tenant's chunks on the
                                    # KV-event feed (docs/spec/events-v1.md §7); default true
    lookup_floor = "5ms"            # optional (also in [defaults]): every lookup reply of
    lookup_jitter = "2ms"           # this tenant leaves no earlier than its arrival + floor
                                    # + U(0, jitter); each 0 to 1s (docs/threat-model.md)
    direct_group = "vllm-acme"      # optional: the group (name or gid) whose members'
                                    # workers get the direct path; the sidecar shares the
                                    # tenant's object tree with it. Without it, only
                                    # workers running as the sidecar's own uid (or root)
                                    # can open the leased files, so only they get it.
    sensitivity = "normal"          # optional, per tenant: "normal" or "high" (below)

    [[grants]]                      # who may use which tenants
    uid = 1001                      # exactly one of uid, gid, user, group
    tenants = ["acme", "beta"]      # tenant ids, or ["*"] for every tenant
    admin = false                   # optional: may use the admin verbs (purge, fsck)

Retention: three limits, each enforced on read (an expired chunk is a miss at
once, in ``lookup`` and in every load, before the background sweep removes
it) and each taken from the *current* policy, so a reload that shortens one
applies to the chunks already stored:

* ``ttl``: a chunk's lifetime from its creation. A save stamps it on the chunk
  (the index and the retention journal, layout-v1.md §4.2, so an index rebuilt
  from the files keeps it); a save may ask for a shorter one (``ttl_s``), and
  on read the tenant's current ttl is a ceiling from creation as well.
* ``max_age``: a hard limit on age from creation, set by the operator only:
  no save, re-save, load or touch extends it, and it does not depend on what
  was stamped (the creation time is in the object's header, so it holds after
  an index rebuild too). Where both are set, the lesser of ttl and max_age wins.
* ``idle_ttl``: a chunk not *accessed* for this long expires; an access is the
  save that wrote it, a load or a ``touch`` (not a ``lookup``, nor a save
  answered ``exists``: probing must not keep a chunk alive). Access times reach
  the index in batches (at most 0.5 s late), so a chunk may expire up to that
  much early, never late.

``sensitivity = "high"`` (per tenant) means: ``max_age`` 1 h and ``idle_ttl``
10 min unless the tenant's own table sets them (``"none"`` is refused),
``events`` off (``events = true`` is refused), encryption required
(``encryption = "none"``, here or from [defaults], and ``direct = true`` are
refused), its own prefix namespace (no key that would share its salt with a
trust group, e.g. ``share_prefixes``, is accepted), and lookups padded to
:data:`HIGH_SENSITIVITY_LOOKUP_FLOOR_S` by default (the lookup floor).

Rules, all of which make a file that breaks them refuse to load (`PolicyError`,
whose message names the file and, where it can be found, the line):

* Unknown keys anywhere are errors: a typo such as ``encrpytion = "none"`` or
  ``tennants = [...]`` must never silently weaken or widen isolation.
* ``version`` must be present and equal to 1.
* Tenant ids (table names and grant entries) match
  ``^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`` (`kvoffload.contract.TENANT_RE`).
  ``"*"`` must stand alone in its list.
* Durations and sizes are strings with a unit; a bare number is refused because
  ``quota = 10`` (10 bytes? 10 GiB?) is exactly the kind of mistake to catch.
  A ttl must be positive; a quota of ``"0B"`` is allowed and stores nothing.
* ``user``/``group`` names are resolved through pwd/grp when the file is
  loaded, so an unknown name fails at load time instead of granting nothing at
  request time; reload the policy after renumbering accounts.
* A file writable by everyone is refused: whoever can edit it owns every tenant.
* Trust groups (docs/spec/keys-v1.md §12): ``share_prefixes = true`` needs a
  ``trust_group``; a group has at most one such tenant; and a grant that lists
  a group's shared tenant lists no tenant outside that group (``["*"]``
  excepted), so a worker that may write a group's shared prefixes serves only
  that group.

Without any grant nobody may use anything: root is not special, give it an
explicit grant (usually ``uid = 0``, ``tenants = ["*"]``, ``admin = true``).
Grants add up: a peer gets the union of every grant that matches its uid or any
of its groups. ``admin`` allows the admin verbs on any tenant; it does not by
itself allow reading or writing a tenant's data.

`SO_PEERCRED` reports only the peer's primary gid; for ``gid``/``group``
grants to see supplementary groups as well, the caller passes them too (from
``SO_PEERGROUPS`` or ``/proc/<pid>/status``).

The file is read and checked by :mod:`.policy_file`
(:func:`~.policy_file.load_policy`); this module holds what it builds. A
`Policy` is immutable: reloading builds a new one and swaps it in, so a
revocation takes effect for the next request without locking.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Final, Literal, final

from kvoffload.contract import TENANT_RE


@final
class AllTenants:
    """Every tenant, including those the policy has no table for (a ``"*"`` grant).

    Supports ``tenant in ALL_TENANTS`` like the frozenset it stands in for, so
    callers need not tell the two apart for a membership test.
    """

    _instance: ClassVar[AllTenants | None] = None

    def __new__(cls) -> AllTenants:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __contains__(self, tenant: object) -> bool:
        return is_valid_tenant_id(tenant)

    def __repr__(self) -> str:
        return "ALL_TENANTS"

    def __reduce__(self) -> str:
        return "ALL_TENANTS"


ALL_TENANTS: Final = AllTenants()

TenantSet = frozenset[str] | AllTenants


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """The effective settings of one tenant (its own table over ``[defaults]``)."""

    encryption: bool = True
    ttl_s: float | None = None
    quota_bytes: int | None = None
    trust_group: str | None = None
    #: The direct path (docs/spec/layout-v1.md §4.1) is allowed; implies ``encryption`` off.
    direct: bool = False
    #: The group that shares the tenant's object tree with the sidecar.
    direct_gid: int | None = None
    #: The tenant's chunks are announced on the KV-event feed (events-v1 §7).
    events: bool = True
    #: Hard limit on a chunk's age from its creation; no save or touch extends it.
    max_age_s: float | None = None
    #: A chunk not accessed (written, loaded, touched) for this long expires.
    idle_ttl_s: float | None = None
    #: "normal" or "high" (defaults that say so, see the module docstring).
    sensitivity: str = "normal"
    #: Every lookup reply of the tenant leaves no earlier than the request's
    #: arrival + ``lookup_floor_s`` + U(0, ``lookup_jitter_s``) (docs/threat-model.md).
    lookup_floor_s: float = 0.0
    lookup_jitter_s: float = 0.0
    #: The tenant is its trust group's shared prefix namespace (keys-v1.md §12).
    share_prefixes: bool = False

    def age_limit_s(self) -> float | None:
        """The limit on age from creation enforced on read: the lesser of ttl and max_age."""
        # Asked on every lookup and read (store cutoffs): no list, no generator.
        ttl, age = self.ttl_s, self.max_age_s
        if ttl is None or age is None:
            return age if ttl is None else ttl
        return min(ttl, age)


@dataclass(frozen=True, slots=True)
class Grant:
    """One ``[[grants]]`` entry, with user/group names already resolved to ids."""

    principal: Literal["uid", "gid"]
    id: int
    tenants: TenantSet
    admin: bool = False
    #: How the file named the principal (``user "vllm"``), for messages and audits.
    label: str = ""


@dataclass(frozen=True, slots=True)
class _Access:
    tenants: TenantSet
    admin: bool


def _merge(a: _Access | None, b: _Access) -> _Access:
    if a is None:
        return b
    tenants: TenantSet
    if isinstance(a.tenants, AllTenants) or isinstance(b.tenants, AllTenants):
        tenants = ALL_TENANTS
    else:
        tenants = a.tenants | b.tenants
    return _Access(tenants, a.admin or b.admin)


_NO_ACCESS: Final = _Access(frozenset(), False)


def is_valid_tenant_id(tenant: object) -> bool:
    # fullmatch, not match: the pattern's "$" also matches before a trailing
    # newline, and "acme\n" must not pass for a tenant id.
    return isinstance(tenant, str) and TENANT_RE.fullmatch(tenant) is not None


class Policy:
    """An immutable, loaded policy; see the module docstring for the file format."""

    def __init__(
        self,
        *,
        defaults: TenantPolicy = TenantPolicy(),  # frozen, so one shared default is safe
        tenants: Mapping[str, TenantPolicy] | None = None,
        grants: Iterable[Grant] = (),
        source: str = "<built-in>",
    ) -> None:
        tenants = dict(tenants or {})
        for name in tenants:
            if not is_valid_tenant_id(name):
                raise ValueError(f"invalid tenant id {name!r}")
        self._source = source
        self._defaults = defaults
        self._tenants: Mapping[str, TenantPolicy] = MappingProxyType(tenants)
        self._grants = tuple(grants)
        by_uid: dict[int, _Access] = {}
        by_gid: dict[int, _Access] = {}
        for g in self._grants:
            if not isinstance(g.tenants, AllTenants):
                for name in g.tenants:
                    if not is_valid_tenant_id(name):
                        raise ValueError(f"invalid tenant id {name!r} in grant for {g.label}")
            table = by_uid if g.principal == "uid" else by_gid
            table[g.id] = _merge(table.get(g.id), _Access(g.tenants, g.admin))
        self._by_uid: Mapping[int, _Access] = by_uid
        self._by_gid: Mapping[int, _Access] = by_gid

    # -- construction ---------------------------------------------------------------

    @classmethod
    def default_dev(cls) -> Policy:
        """A permissive policy for the embedded dev mode.

        Root and the current user may use every tenant and the admin verbs;
        everyone else nothing, so a dev socket left readable still isolates.
        """
        uids = dict.fromkeys((0, os.getuid()))
        grants = [Grant("uid", uid, ALL_TENANTS, admin=True, label=f"uid {uid}") for uid in uids]
        return cls(grants=grants, source="<dev>")

    # -- queries --------------------------------------------------------------------

    @property
    def source(self) -> str:
        return self._source

    @property
    def defaults(self) -> TenantPolicy:
        return self._defaults

    @property
    def tenants(self) -> Mapping[str, TenantPolicy]:
        """Tenants with a table of their own (others get `defaults`)."""
        return self._tenants

    @property
    def grants(self) -> tuple[Grant, ...]:
        return self._grants

    def _access(self, uid: int, gids: Sequence[int]) -> _Access:
        acc = self._by_uid.get(uid)
        for gid in gids:
            g = self._by_gid.get(gid)
            if g is not None:
                acc = _merge(acc, g)
        return acc if acc is not None else _NO_ACCESS

    def tenants_for(self, uid: int, gids: Sequence[int]) -> frozenset[str] | AllTenants:
        """The tenants a peer with this uid and these groups may use."""
        return self._access(uid, gids).tenants

    def may_use(self, uid: int, gids: Sequence[int], tenant: str) -> bool:
        # An invalid id is simply not usable: the caller answers it like any
        # forbidden tenant, so the reply reveals nothing about the policy.
        return is_valid_tenant_id(tenant) and tenant in self.tenants_for(uid, gids)

    def is_admin(self, uid: int, gids: Sequence[int]) -> bool:
        return self._access(uid, gids).admin

    def tenant(self, tenant: str) -> TenantPolicy:
        """The effective settings of ``tenant``; `defaults` if it has no table."""
        if not is_valid_tenant_id(tenant):
            raise ValueError(f"invalid tenant id {tenant!r}")
        return self._tenants.get(tenant, self._defaults)

    def __repr__(self) -> str:
        return (
            f"Policy(source={self._source!r}, tenants={len(self._tenants)}, "
            f"grants={len(self._grants)})"
        )
