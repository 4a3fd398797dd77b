"""Each namespace's contract fields, kept beside its chunks (layout-v1.md §2.1).

A namespace is a contract fingerprint: the store cannot tell from it which
model revision, tokenizer or chat template built the chunks. A client
registers the fields (protocol-v1.md §5.19); they are recorded only after
they hash to the namespace, as
``<root>/contracts/<tenant>/<namespace hex>.json`` (the contract's fields as
JSON, contract-v1.md), written once with temp file → fsync → ``link``.
Files in the root, not only in a node's index: an index rebuild keeps them
and every node of a shared root sees what any node registered, so an
invalidation run on one node knows every namespace's contract.

Every read checks the file's fields against its name again: a file that
does not hash to its name (damaged, planted, of a future encoding) is
reported as an unknown contract, so its namespace is never matched by an
invalidation on the strength of unverified fields.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvoffload.contract import TENANT_RE, CompatContract
from kvoffload.errors import ContractError

from ..posix import atomic_create

log = logging.getLogger(__name__)

CONTRACTS_DIR = "contracts"
_SUFFIX = ".json"
_MAX_FILE = 1 << 20


def verified_contract(namespace: bytes, fields: Mapping[str, Any]) -> CompatContract:
    """The contract ``fields`` describe, if they hash to ``namespace``; else ContractError."""
    if not isinstance(fields, Mapping):
        raise ContractError("contract must be a map of the contract's fields")
    try:
        contract = CompatContract.from_dict(fields)
        got = contract.fingerprint()
    except ContractError:
        raise
    except (TypeError, ValueError, ArithmeticError, RecursionError) as exc:
        # e.g. an integer too large for a float, or nesting too deep to encode
        raise ContractError(f"invalid contract fields: {type(exc).__name__}") from None
    if got != namespace:
        raise ContractError(
            f"contract fields hash to namespace {got.hex()[:16]}…, "
            f"not the request's {namespace.hex()[:16]}…: refusing unverified fields"
        )
    return contract


#: What ``invalidate`` selects on (protocol-v1.md §5.20); ``model`` only narrows.
SELECTORS = ("model_revision", "tokenizer_hash", "chat_template_version")
SELECTOR_KEYS = (*SELECTORS, "model")


def check_selector(selector: Mapping[str, str]) -> None:
    """At least one of :data:`SELECTORS`, nothing unknown, every value a non-empty str."""
    unknown = sorted(set(selector) - set(SELECTOR_KEYS))
    if unknown:
        raise ContractError(f"unknown invalidation selector {', '.join(unknown)}")
    if not any(k in selector for k in SELECTORS):
        raise ContractError(
            "say what to invalidate: model_revision, tokenizer_hash or chat_template_version"
        )
    for k, v in selector.items():
        if not isinstance(v, str) or not v or len(v) > 1024:
            raise ContractError(f"{k} must be a non-empty string of at most 1024 characters")


def _model_and_revision(model_revision: str) -> tuple[str, str] | None:
    model, at, rev = model_revision.rpartition("@")
    return (model, rev) if at and model and rev else None


def contract_matches(fields: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    """Whether a contract is built under everything ``selector`` names (all must hold).

    ``model_revision`` R matches a contract whose ``model_revision`` is R, or is
    ``<model>@R`` (the vLLM connector's form); ``model`` M matches one whose
    ``model_revision`` is M or ``M@<revision>``; the other selectors compare equal.
    """
    mr = fields.get("model_revision")
    if not isinstance(mr, str):
        return False
    split = _model_and_revision(mr)
    if "model_revision" in selector:
        r = selector["model_revision"]
        if not (mr == r or (split is not None and split[1] == r)):
            return False
    if "model" in selector:
        m = selector["model"]
        if not (mr == m or (split is not None and split[0] == m)):
            return False
    for key in ("tokenizer_hash", "chat_template_version"):
        if key in selector and fields.get(key) != selector[key]:
            return False
    return True


def contract_fields(contract: CompatContract) -> dict[str, Any]:
    """The fields as recorded (contract-v1.md §2), JSON-ready."""
    return contract.to_dict()


def contract_file_bytes(contract: CompatContract) -> bytes:
    """A contract file: the contract's fields (``to_dict``, contract-v1.md §2) as JSON
    with sorted keys, UTF-8. Not the canonical encoding, whose numbers are hex
    strings; a reader recomputes the fingerprint from the fields either way."""
    return json.dumps(contract.to_dict(), sort_keys=True, ensure_ascii=False).encode("utf-8")


class ContractRegistry:
    """``<root>/contracts/``: verified contract fields per (tenant, namespace)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / CONTRACTS_DIR
        self._known: set[tuple[str, bytes]] = set()
        self._mu = threading.Lock()

    def _path(self, tenant: str, namespace: bytes) -> Path:
        if not TENANT_RE.fullmatch(tenant) or len(namespace) != 32:
            raise ContractError(f"invalid tenant {tenant!r} or namespace")
        return self.dir / tenant / (namespace.hex() + _SUFFIX)

    def record(self, tenant: str, namespace: bytes, fields: Mapping[str, Any]) -> bool:
        """Verify ``fields`` against ``namespace`` and keep them; True if newly written."""
        contract = verified_contract(namespace, fields)
        with self._mu:
            if (tenant, namespace) in self._known:
                return False
        path = self._path(tenant, namespace)
        created = False
        if not path.exists():
            self.dir.mkdir(mode=0o700, exist_ok=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            try:
                atomic_create(path, contract_file_bytes(contract), mode=0o600)
                created = True
            except FileExistsError:
                pass  # another node or connection registered it first: same bytes
        with self._mu:
            self._known.add((tenant, namespace))
        return created

    def get(self, tenant: str, namespace: bytes) -> CompatContract | None:
        """The verified contract of a namespace, or None (unknown)."""
        try:
            path = self._path(tenant, namespace)
        except ContractError:
            return None
        return self._read(path, namespace)

    def _read(self, path: Path, namespace: bytes) -> CompatContract | None:
        try:
            with path.open("rb") as f:
                data = f.read(_MAX_FILE + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("contract file %s unreadable: %s", path, exc)
            return None
        if len(data) > _MAX_FILE:
            log.warning("contract file %s is too large; treated as unknown", path)
            return None
        try:
            return verified_contract(namespace, json.loads(data))
        except (ValueError, RecursionError, ContractError) as exc:
            log.warning("contract file %s does not verify (%s); treated as unknown", path, exc)
            return None

    def registered(self, tenant: str | None = None) -> Iterator[tuple[str, bytes, CompatContract]]:
        """Every verified (tenant, namespace, contract) on disk, of one tenant or all."""
        try:
            tenants = [tenant] if tenant is not None else sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return
        for t in tenants:
            if not TENANT_RE.fullmatch(t):
                continue
            try:
                names = sorted(os.listdir(self.dir / t))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                stem = name[: -len(_SUFFIX)]
                if not name.endswith(_SUFFIX) or len(stem) != 64:
                    continue
                try:
                    ns = bytes.fromhex(stem)
                except ValueError:
                    continue
                c = self._read(self.dir / t / name, ns)
                if c is not None:
                    yield t, ns, c

    def drop_tenant(self, tenant: str) -> int:
        """A purged tenant's contracts go with it; the number of contract
        records removed."""
        removed = 0
        if TENANT_RE.fullmatch(tenant):
            d = self.dir / tenant
            with contextlib.suppress(OSError):
                removed = sum(1 for p in d.iterdir() if p.name.endswith(_SUFFIX))
            shutil.rmtree(d, ignore_errors=True)
        with self._mu:
            self._known = {k for k in self._known if k[0] != tenant}
        return removed


__all__ = [
    "CONTRACTS_DIR",
    "SELECTORS",
    "SELECTOR_KEYS",
    "ContractRegistry",
    "check_selector",
    "contract_fields",
    "contract_file_bytes",
    "contract_matches",
    "verified_contract",
]
