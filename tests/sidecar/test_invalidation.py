"""Invalidation on model, tokenizer or chat-template updates (issue 16, item 3).

A namespace's contract fields are registered by the client (protocol-v1.md
§5.19), verified by the server and kept beside the chunks (layout-v1.md §2.1);
``kvoffload invalidate`` purges every namespace built under a field
(§5.20), ``ls --namespaces`` lists them. Real sidecar processes, the real
client and CLI, real stores; the shared-root test uses two real Stores on one
root (tests/store/test_shared_store.py's nodes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvoffload import protocol as p
from kvoffload.cli.exits import ExitCode
from kvoffload.client import SidecarClient
from kvoffload.contract import CompatContract
from kvoffload.errors import ContractError
from kvoffload.keys import chunk_keys
from kvoffload.sidecar.access.policy import Grant, Policy
from kvoffload.sidecar.config import ServerConfig
from kvoffload.staging import PAGE
from kvoffload.store import Store, StoreConfig
from kvoffload.store.contracts import contract_matches
from kvoffload.store.keys.keyring import Kek
from tests.conftest import make_contract
from tests.helpers.cli import cli, sidecar
from tests.helpers.server import Raw, ServerThread
from tests.helpers.shared import Nodes

R1 = make_contract(model_revision="llama-tiny@r1")
R2 = make_contract(model_revision="llama-tiny@r2")
R1_BETA = make_contract(model_revision="llama-tiny@r1", tenant_namespace="beta")
TOKENS = list(range(100, 100 + 3 * 64))  # three chunks of 64 tokens


def _layers(tag: str, i: int) -> list[bytes]:
    return [f"{tag}/{i}/{n}".encode() * 400 for n in range(2)]


def _save(client: SidecarClient, contract: CompatContract, tag: str) -> list[bytes]:
    keys = client.chunk_keys(contract, TOKENS)  # registers the contract (§5.19)
    assert len(keys) == 3
    items = [(k, _layers(tag, i)) for i, k in enumerate(keys)]
    assert client.save(contract.fingerprint(), items) == [True] * 3
    return keys


def _json(r: Any) -> Any:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_invalidate_a_model_revision_through_a_running_sidecar(
    tmp_path: Path, short_dir: Path
) -> None:
    sock = short_dir / "kvo.sock"
    assert cli(tmp_path, sock, "--dev", "init").returncode == 0
    unknown_ns = bytes(range(32))
    with sidecar(tmp_path, sock):
        with SidecarClient(sock, "acme", staging_bytes=1 << 20) as acme:
            k1 = _save(acme, R1, "r1")
            k2 = _save(acme, R2, "r2")
            # stored without registered fields: an unknown contract
            assert acme.save(unknown_ns, [(bytes([7]) * 32, _layers("u", 0))]) == [True]
        with SidecarClient(sock, "beta", staging_bytes=1 << 20) as beta:
            kb = _save(beta, R1_BETA, "b1")

        rows = _json(cli(tmp_path, sock, "--dev", "ls", "--namespaces", "--json"))
        by_ns = {r["namespace"]: r for r in rows}
        assert set(by_ns) == {c.fingerprint().hex() for c in (R1, R2, R1_BETA)} | {unknown_ns.hex()}
        r1_row = by_ns[R1.fingerprint().hex()]
        assert r1_row["contract"] == R1.to_dict() and r1_row["chunks"] == 3
        assert r1_row["bytes"] > 0 and r1_row["oldest_age_s"] >= 0
        assert by_ns[unknown_ns.hex()]["contract"] is None
        text = cli(tmp_path, sock, "--dev", "ls", "--namespaces")
        assert text.returncode == 0 and "llama-tiny@r2" in text.stdout
        assert "unknown contract" in text.stdout

        # dry run: the report, nothing removed
        dry = _json(
            cli(tmp_path, sock, "--dev", "invalidate", "--model-revision", "r1", "--dry-run",
                "--json")
        )  # fmt: skip
        assert dry["dry_run"] and dry["removed_namespaces"] == 2 and dry["removed_chunks"] == 6
        after = _json(cli(tmp_path, sock, "--dev", "ls", "--namespaces", "--json"))
        assert [(r["namespace"], r["chunks"]) for r in after] == [
            (r["namespace"], r["chunks"]) for r in rows
        ]
        # no answer at the prompt: nothing removed either
        r = cli(tmp_path, sock, "--dev", "invalidate", "--model-revision", "r1")
        assert r.returncode == ExitCode.ABORTED, r.stderr
        with SidecarClient(sock, "acme", staging_bytes=1 << 20) as acme:
            assert acme.lookup(k1) == 3

        rep = _json(
            cli(tmp_path, sock, "--dev", "invalidate", "--model-revision", "r1", "--yes", "--json")
        )
        assert not rep["dry_run"]
        assert {(n["tenant"], n["namespace"]) for n in rep["namespaces"]} == {
            ("acme", R1.fingerprint().hex()),
            ("beta", R1_BETA.fingerprint().hex()),
        }
        assert rep["removed_chunks"] == 6 and rep["removed_bytes"] > 0
        assert [u["namespace"] for u in rep["unknown_contract"]] == [unknown_ns.hex()]

        with SidecarClient(sock, "acme", staging_bytes=1 << 20) as acme:
            assert acme.lookup(k1) == 0
            # the other revision's chunks still load, byte for byte
            got = acme.load(k2)
            assert [g.ok for g in got] == [True] * 3
            assert [[bytes(v) for v in g.layers] for g in got] == [
                _layers("r2", i) for i in range(3)
            ]
            assert acme.lookup([bytes([7]) * 32]) == 1  # unknown contract: left
        with SidecarClient(sock, "beta", staging_bytes=1 << 20) as beta:
            assert beta.lookup(kb) == 0

        # matching nothing is exit 8, as a purge's (a typo?); the text report
        # still names the unknown namespaces it left
        for dry in ((), ("--dry-run",)):
            r = cli(tmp_path, sock, "--dev", "invalidate", "--chat-template-version", "v9",
                    "--yes", *dry)  # fmt: skip
            assert r.returncode == ExitCode.NOTHING, r.stderr
            assert "0 namespaces" in r.stdout and "unknown contract" in r.stdout
            assert (
                r.stderr.strip()
                .splitlines()[-1]
                .startswith(
                    f"nothing to do: no namespace in the sidecar on {sock} matches chat template "
                    "version 'v9'"
                )
            )

    audit = tmp_path / ".kvoffload/index/audit.jsonl"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    inval = [r for r in records if r.get("event") == "invalidate"]
    assert len(inval) >= 3  # two dry runs (the preview and --dry-run) count too
    done = [r for r in inval if r.get("dry_run") is False and r.get("chunks") == 6]
    assert len(done) == 1 and done[0]["uid"] == os.getuid()
    assert "salt" not in json.dumps(records)


@pytest.mark.parametrize(
    "args",
    [
        ("invalidate",),
        ("invalidate", "--model", "llama-tiny"),
        ("invalidate", "--tenant", "acme"),
        ("invalidate", "--model-revision", ""),
        ("invalidate", "--model-revision", "r1", "--tenant", "no tenant"),
        ("ls", "--namespaces", "--older-than", "1d"),
    ],
)
def test_bad_flags_are_one_line_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = cli(tmp_path, tmp_path / "none.sock", "--dev", *args)
    assert r.returncode == ExitCode.USAGE, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1, r.stderr


def test_a_mistyped_flag_is_exit_2_naming_the_right_one(tmp_path: Path) -> None:
    """click's own parsing (as for every command): exit 2, the suggestion, no traceback."""
    r = cli(tmp_path, tmp_path / "none.sock", "--dev", "invalidate", "--model-revison", "r1")
    assert r.returncode == ExitCode.USAGE
    assert "Traceback" not in r.stderr and "--model-revision" in r.stderr


# -- offline, on the store ---------------------------------------------------------


def _store(tmp: Path, kek_file: Path, name: str = "idx") -> Store:
    cfg = StoreConfig(root=tmp / "root", index_dir=tmp / name)
    return Store(cfg, Kek.from_file(kek_file), create=True)


def _put(store: Store, tenant: str, c: CompatContract, register: bool = True) -> list[bytes]:
    ns = c.fingerprint()
    if register:
        store.record_contract(tenant, ns, c.to_dict())
    keys = chunk_keys(c, store.tenant_salt(tenant), TOKENS)
    for i, k in enumerate(keys):
        assert store.put(tenant, ns, k, _layers(c.model_revision, i))
    return keys


def test_selectors_tenant_and_model_narrow_what_is_removed(tmp_path: Path, kek_file: Path) -> None:
    s = _store(tmp_path, kek_file)
    try:
        tok2 = make_contract(model_revision="llama-tiny@r2", tokenizer_hash="tok-new")
        tpl = make_contract(model_revision="other@r1", chat_template_version="v2")
        _put(s, "acme", R1)
        _put(s, "beta", R1_BETA)
        _put(s, "acme", tok2)
        _put(s, "acme", tpl)
        # another model's r1 is not "llama-tiny"'s r1
        rep = s.invalidate({"model_revision": "r1", "model": "llama-tiny"}, tenant="acme")
        assert [n["namespace"] for n in rep["namespaces"]] == [R1.fingerprint().hex()]
        assert s.namespace_usage("beta")  # --tenant acme left beta alone
        rep = s.invalidate({"tokenizer_hash": "tok-new"})
        assert [n["namespace"] for n in rep["namespaces"]] == [tok2.fingerprint().hex()]
        rep = s.invalidate({"chat_template_version": "v2"}, dry_run=True)
        assert rep["removed_chunks"] == 3 and s.namespace_usage("acme").get(tpl.fingerprint())
        # the full model@revision form matches too
        rep = s.invalidate({"model_revision": "other@r1"})
        assert rep["removed_namespaces"] == 1
        assert not s.namespace_usage("acme")
        with pytest.raises(ContractError):
            s.invalidate({"model": "llama-tiny"})  # model alone selects nothing
    finally:
        s.close()


def test_matching_rules() -> None:
    f = R1.to_dict()
    assert contract_matches(f, {"model_revision": "r1"})
    assert contract_matches(f, {"model_revision": "llama-tiny@r1"})
    assert not contract_matches(f, {"model_revision": "r"})
    assert not contract_matches(f, {"model_revision": "llama-tiny"})
    assert contract_matches(f, {"model_revision": "r1", "model": "llama-tiny"})
    assert not contract_matches(f, {"model_revision": "r1", "model": "llama"})
    assert contract_matches(f, {"tokenizer_hash": "tok-3f1c", "chat_template_version": "v1"})
    assert not contract_matches(f, {"tokenizer_hash": "tok-3f1c", "chat_template_version": "v2"})


def test_unverified_fields_are_never_used(tmp_path: Path, kek_file: Path) -> None:
    """A contract file whose fields do not hash to its name (planted, damaged) is an
    unknown contract: never matched, so never the reason for a purge."""
    s = _store(tmp_path, kek_file)
    try:
        _put(s, "acme", R2)
        with pytest.raises(ContractError, match="hash to namespace"):
            s.record_contract("acme", R2.fingerprint(), R1.to_dict())
        path = tmp_path / "root/contracts/acme" / (R2.fingerprint().hex() + ".json")
        assert json.loads(path.read_text()) == R2.to_dict()
        # plant r1's fields under r2's name
        path.chmod(0o600)
        path.write_text(json.dumps(R1.to_dict()))
        rep = s.invalidate({"model_revision": "r1"})
        assert rep["removed_namespaces"] == 0
        assert [u["namespace"] for u in rep["unknown_contract"]] == [R2.fingerprint().hex()]
        for junk in (
            b"{not json",
            json.dumps({**R2.to_dict(), "block_size": 10**400}).encode(),
            b"[" * 100_000 + b"]" * 100_000,
            b"[]",
        ):
            path.write_bytes(junk)
            assert s.contracts.get("acme", R2.fingerprint()) is None
        path.write_bytes(b"{not json")
        (row,) = s.namespaces_report("acme")
        assert row["contract"] is None and row["chunks"] == 3
    finally:
        s.close()


def test_a_root_without_contracts_opens_and_reports_unknown_and_an_index_rebuild_keeps_them(
    tmp_path: Path, kek_file: Path
) -> None:
    s = _store(tmp_path, kek_file)
    _put(s, "acme", R1, register=False)  # as a store written before revision 5
    _put(s, "acme", R2)
    s.close()
    assert not (tmp_path / "root/contracts/acme" / (R1.fingerprint().hex() + ".json")).exists()
    # a new index on the same root (rebuilt from the files): the contracts are in the root
    s = _store(tmp_path, kek_file, "idx-new")
    try:
        rows = {r["namespace"]: r for r in s.namespaces_report()}
        assert rows[R1.fingerprint().hex()]["contract"] is None
        assert rows[R2.fingerprint().hex()]["contract"] == R2.to_dict()
        rep = s.invalidate({"model_revision": "r2"})
        assert rep["removed_chunks"] == 3 and len(rep["unknown_contract"]) == 1
    finally:
        s.close()


def test_a_tenant_purge_removes_its_contracts(tmp_path: Path, kek_file: Path) -> None:
    s = _store(tmp_path, kek_file)
    try:
        _put(s, "acme", R1)
        s.purge_tenant("acme", wait=True)
        assert not (tmp_path / "root/contracts/acme").exists()
    finally:
        s.close()


def test_on_a_shared_root_an_invalidation_reaches_every_node(
    tmp_path: Path, kek_file: Path
) -> None:
    nodes = Nodes(tmp_path, kek_file)
    try:
        a, b = nodes.node("a"), nodes.node("b")
        # node b stores and registers r1; node a only knows it from the root and journal
        kb1 = _put(b, "acme", R1)
        kb2 = _put(b, "acme", R2)
        a.follow_journals()
        rep = a.invalidate({"model_revision": "r1"})
        assert rep["shared_root"] and rep["removed_chunks"] == 3
        b.follow_journals()
        assert b.lookup("acme", kb1) == 0
        assert b.lookup("acme", kb2) == 3
        assert b.get("acme", kb2[0]) == _layers("llama-tiny@r2", 0)
        for k in kb1:  # the files are gone from the shared root
            assert not any((tmp_path / "root/objects/acme").rglob(k.hex() + "*"))
    finally:
        nodes.close()


# -- the protocol: the server verifies before it records (§5.19) ---------------------


def test_the_server_records_only_fields_that_hash_to_the_namespace(
    sock_dir: Path, store: Any
) -> None:
    policy = Policy(grants=[Grant("uid", os.getuid(), frozenset({"acme"}), admin=True)])
    cfg = ServerConfig(socket_path=sock_dir / "kvo.sock", secret=b"\x5a" * 32, workers=2)
    st = ServerThread(store, policy, cfg)
    try:
        raw = Raw(st)
        raw.hello("acme")
        raw.register(16 * PAGE)
        ns = R2.fingerprint()
        spec = (p.ChunkSpec(bytes([1]) * 32, (100,)),)
        bad = raw.call(p.PrepareStore("acme", ns, spec, None, R1.to_dict()))
        assert isinstance(bad, p.ErrorReply) and bad.code is p.ErrorCode.BAD_REQUEST
        assert "hash to namespace" in bad.message
        assert store.contracts.get("acme", ns) is None
        for junk in (
            {"model_revision": 5},
            {**R2.to_dict(), "contract": 2},
            {"x": [1, {"y": None}]},
        ):
            r = raw.call(p.PrepareStore("acme", ns, spec, None, junk))
            assert isinstance(r, p.ErrorReply) and r.code is p.ErrorCode.BAD_REQUEST, junk
            assert r.message.startswith("contract: ")
        assert not (store.root / "contracts").exists()
        ok = raw.call(p.PrepareStore("acme", ns, spec, None, R2.to_dict()))
        assert isinstance(ok, p.PrepareStoreReply)
        assert store.contracts.get("acme", ns) == R2
        assert isinstance(raw.call(p.Abort(ok.handle)), p.Ack)
        rep = raw.call(p.Namespaces("acme"))
        assert isinstance(rep, p.NamespacesReply) and rep.report["namespaces"] == []
        inv = raw.call(p.Invalidate())  # no selector: the server refuses it too
        assert isinstance(inv, p.ErrorReply) and inv.code is p.ErrorCode.BAD_REQUEST
        raw.close()
    finally:
        st.stop()


def test_long_listings_come_in_pages_and_counts_stay_whole(
    sock_dir: Path, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More namespaces than a reply page: ``namespaces`` pages (the CLI's target
    follows ``more``), ``invalidate`` cuts its lists but counts everything."""
    from kvoffload.cli.admin import SidecarTarget
    from kvoffload.sidecar import admin

    monkeypatch.setattr(admin, "NAMESPACES_PAGE", 2)
    contracts = [make_contract(model_revision=f"m@r{i % 2}", lora_id=f"l{i}") for i in range(5)]
    for c in contracts:
        _put(store, "acme", c)
    policy = Policy(grants=[Grant("uid", os.getuid(), frozenset({"acme"}), admin=True)])
    cfg = ServerConfig(socket_path=sock_dir / "kvo.sock", secret=b"\x5a" * 32, workers=2)
    st = ServerThread(store, policy, cfg)
    try:
        target = SidecarTarget(sock_dir / "kvo.sock")
        rows = target.namespaces("acme")
        assert sorted(r["namespace"] for r in rows) == sorted(
            c.fingerprint().hex() for c in contracts
        )
        rep = target.invalidate({"model_revision": "r0"}, "acme", False)
        assert rep["removed_namespaces"] == rep["namespaces_total"] == 3
        assert len(rep["namespaces"]) == 2 and rep["removed_chunks"] == 9
        assert len(target.namespaces("acme")) == 2
    finally:
        st.stop()


def test_without_the_admin_right_invalidate_and_namespaces_are_forbidden(
    sock_dir: Path, store: Any
) -> None:
    keys = _put(store, "acme", R1)
    policy = Policy(grants=[Grant("uid", os.getuid(), frozenset({"acme"}), admin=False)])
    cfg = ServerConfig(socket_path=sock_dir / "kvo.sock", secret=b"\x5a" * 32, workers=2)
    st = ServerThread(store, policy, cfg)
    try:
        raw = Raw(st)
        raw.hello("acme")
        for req in (p.Invalidate(model_revision="r1"), p.Namespaces()):
            r = raw.call(req)
            assert isinstance(r, p.ErrorReply) and r.code is p.ErrorCode.FORBIDDEN
        raw.close()
        assert store.lookup("acme", keys) == 3
    finally:
        st.stop()
