"""The hash-chained audit log (docs/spec/audit-v1.md): every removed, edited or
reordered line, at every position and across rotations, and a cut tail, is
detected; concurrent writers keep one chain; floods are coalesced and bounded.

Real files, real fcntl locks, real processes for the concurrent writers and
for ``kvoffload audit``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.cli.exits import ExitCode
from kvoffload.errors import AuditFormatError, StoreIOError
from kvoffload.store.audit import (
    ACTIVE,
    HEAD,
    AuditLog,
    canonical,
    log_files,
    record_hash,
    rotated_files,
    verify,
)
from kvoffload.testing import cli_argv
from tests.helpers.paths import REPO

SRC = REPO / "src"


def write_log(d: Path, n: int, *, max_bytes: int = 4096, keep: int = 8) -> AuditLog:
    log = AuditLog(d / ACTIVE, max_bytes=max_bytes, keep=keep)
    for i in range(n):
        log("purge_tenant", {"tenant": f"t{i % 5}", "chunks": i, "note": "x" * 40})
    return log


def lines_of(d: Path) -> list[tuple[Path, int]]:
    """Every (file, line index) of the log, oldest first."""
    out = []
    for p in log_files(d):
        out += [(p, i) for i in range(len(p.read_bytes().splitlines()))]
    return out


def rewrite(path: Path, edit: Callable[[list[bytes]], list[bytes]]) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(edit(lines)))


def cli(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        cli_argv("--root", str(d / "root"), "--index-dir", str(d), "audit", *args),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


# -- the chain ------------------------------------------------------------------


def test_a_log_across_rotations_verifies_and_links_files(tmp_path: Path) -> None:
    write_log(tmp_path, 60)
    rot = rotated_files(tmp_path)
    assert len(rot) >= 3, "the test needs several rotated files"
    rep = verify(tmp_path)
    assert rep.intact, rep.problems
    assert [r["seq"] for r in rep.records] == list(range(1, 61))
    # The first line of each file links to the last line of the file before.
    files = log_files(tmp_path)
    for before, after in itertools.pairwise(files):
        last = json.loads(before.read_bytes().splitlines()[-1])
        first = json.loads(after.read_bytes().splitlines()[0])
        assert first["prev"] == last["hash"] and first["seq"] == last["seq"] + 1
    for r in rep.records:
        assert r["hash"] == record_hash(r)
    # The line is the canonical form of the record.
    first_line = files[0].read_bytes().splitlines()[0]
    assert first_line == canonical(json.loads(first_line))


@pytest.mark.parametrize("kind", ["delete", "edit", "swap"])
def test_every_single_line_tampered_with_is_detected(tmp_path: Path, kind: str) -> None:
    write_log(tmp_path / "orig", 40)
    positions = lines_of(tmp_path / "orig")
    assert len({p for p, _ in positions}) >= 3
    for n, (path, i) in enumerate(positions):
        if kind == "swap" and n == len(positions) - 1:
            continue
        d = tmp_path / f"case{n}"
        subprocess.run(["cp", "-a", str(tmp_path / "orig"), str(d)], check=True)
        target = d / path.name

        def edit(lines: list[bytes], i: int = i) -> list[bytes]:
            if kind == "delete":
                return lines[:i] + lines[i + 1 :]
            if kind == "edit":
                rec = json.loads(lines[i])
                rec["chunks"] = rec.get("chunks", 0) + 1  # a changed detail, hash kept
                return [*lines[:i], canonical(rec) + b"\n", *lines[i + 1 :]]
            if i + 1 < len(lines):
                return [*lines[:i], lines[i + 1], lines[i], *lines[i + 2 :]]
            return lines

        if kind == "swap" and i + 1 >= len(target.read_bytes().splitlines()):
            # The last line of a file swaps with the first of the next file.
            files = log_files(d)
            nxt = files[files.index(target) + 1]
            a, b = target.read_bytes().splitlines(True), nxt.read_bytes().splitlines(True)
            a[-1], b[0] = b[0], a[-1]
            target.write_bytes(b"".join(a))
            nxt.write_bytes(b"".join(b))
        else:
            rewrite(target, edit)
        rep = verify(d)
        assert not rep.intact, f"{kind} of {path.name}:{i + 1} went unnoticed"
        assert rep.problems[0].file.endswith(".jsonl") or rep.problems[0].file.endswith(HEAD)


def test_a_cut_tail_is_detected_even_with_the_lines_whole(tmp_path: Path) -> None:
    write_log(tmp_path, 10, max_bytes=1 << 20)
    rewrite(tmp_path / ACTIVE, lambda lines: lines[:-1])
    rep = verify(tmp_path)
    assert not rep.intact
    assert "cut from the tail" in rep.problems[0].reason
    assert rep.problems[0].file.endswith(ACTIVE) and rep.problems[0].line == 9
    # A writer coming afterwards links to the anchor, so the gap stays visible.
    AuditLog(tmp_path / ACTIVE)("admin", {"verb": "fsck"})
    rep = verify(tmp_path)
    assert not rep.intact and "seq 11 where 10 was expected" in rep.problems[0].reason


def test_a_removed_rotated_file_and_a_removed_anchor_are_detected(tmp_path: Path) -> None:
    write_log(tmp_path / "a", 60)
    oldest = rotated_files(tmp_path / "a")[0][1]
    oldest.unlink()
    rep = verify(tmp_path / "a")
    assert not rep.intact and "seq" in rep.problems[0].reason
    write_log(tmp_path / "b", 60)
    middle = rotated_files(tmp_path / "b")[1][1]
    middle.unlink()
    assert not verify(tmp_path / "b").intact
    write_log(tmp_path / "c", 5)
    (tmp_path / "c" / HEAD).unlink()
    rep = verify(tmp_path / "c")
    assert not rep.intact and "anchor is missing" in rep.problems[0].reason
    # A writer finding no anchor says so in the chain: still reported.
    AuditLog(tmp_path / "c" / ACTIVE)("admin", {"verb": "ls"})
    rep = verify(tmp_path / "c")
    assert not rep.intact and "anchor was lost" in rep.problems[0].reason


def test_crash_leftovers_are_recovered_not_reported(tmp_path: Path) -> None:
    log = write_log(tmp_path, 5, max_bytes=1 << 20)
    head = (tmp_path / HEAD).read_bytes()
    log("admin", {"verb": "inspect"})
    # A crash between the append and the anchor update: the anchor is one behind.
    (tmp_path / HEAD).write_bytes(head)
    rep = verify(tmp_path)
    assert rep.intact and any("one record behind" in n for n in rep.notes)
    # A crash in the middle of a write: a partial last line.
    with (tmp_path / ACTIVE).open("ab") as f:
        f.write(b'{"event": "adm')
    rep = verify(tmp_path)
    assert rep.intact and any("partial last line" in n for n in rep.notes)
    log("admin", {"verb": "ls"})  # the next writer cuts the partial line and goes on
    rep = verify(tmp_path)
    assert rep.intact and rep.notes == [], rep.notes
    assert [r["seq"] for r in rep.records] == list(range(1, 8))


def test_rotation_bounds_the_disk_and_pruning_is_not_tampering(tmp_path: Path) -> None:
    log = write_log(tmp_path, 300, max_bytes=4096, keep=2)
    files = log_files(tmp_path)
    assert len(files) == 3
    assert sum(p.stat().st_size for p in files) <= 3 * 4096
    rep = verify(tmp_path)
    assert rep.intact, rep.problems
    assert rep.records[-1]["seq"] == 300 and rep.records[0]["seq"] > 1
    assert any("rotated away" in n for n in rep.notes)
    log("admin", {"verb": "fsck"})
    assert verify(tmp_path).intact


def test_refused_access_floods_are_coalesced(tmp_path: Path) -> None:
    now = [1000.0]
    log = AuditLog(tmp_path / ACTIVE, clock=lambda: now[0])
    peer = {"uid": 1234, "gid": 1234, "pid": 99, "verb": "hello", "result": "refused"}
    written = [log.record("refused_access", {**peer, "tenant": "victim"}) for _ in range(1000)]
    assert written.count(True) == 1
    log.record("refused_access", {**peer, "tenant": "other"})  # another key: its own line
    now[0] += 61
    assert log.record("refused_access", {**peer, "tenant": "victim"})
    recs = verify(tmp_path).records
    assert [r.get("coalesced") for r in recs if r["tenant"] == "victim"] == [None, 999]
    assert len(recs) == 3


def test_secrets_and_reserved_names_are_refused(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / ACTIVE)
    for bad in ("salt", "key", "token", "seq", "hash"):
        with pytest.raises(ValueError, match=bad):
            log("admin", {bad: "x"})
    assert not (tmp_path / ACTIVE).exists()


def test_an_unknown_version_is_refused(tmp_path: Path) -> None:
    write_log(tmp_path, 3, max_bytes=1 << 20)
    rewrite(tmp_path / ACTIVE, lambda ls: [ls[0].replace(b'"v": 1', b'"v": 2'), *ls[1:]])
    with pytest.raises(AuditFormatError, match="version 2"):
        verify(tmp_path)
    r = cli(tmp_path, "--verify")
    assert r.returncode == ExitCode.ERROR and r.stderr.count("\n") == 1, r.stderr
    assert "version 2" in r.stderr and "Traceback" not in r.stderr


def test_a_damaged_anchor_stops_the_writer_with_one_error(tmp_path: Path) -> None:
    log = write_log(tmp_path, 3, max_bytes=1 << 20)
    (tmp_path / HEAD).write_bytes(b"garbage")
    with pytest.raises(StoreIOError, match="anchor"):
        log("admin", {"verb": "ls"})


# -- concurrent writers -------------------------------------------------------------

_WRITER = """
import sys
from collections.abc import Callable
from pathlib import Path
from kvoffload.store.audit import AuditLog
log = AuditLog(Path(sys.argv[1]), max_bytes=8192, keep=1000)
for i in range(int(sys.argv[2])):
    log("admin", {"verb": "writer", "writer": sys.argv[3], "i": i})
"""


def test_concurrent_writer_processes_keep_one_chain(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path / ACTIVE), "150", str(w)], env=env
        )
        for w in range(3)
    ]
    assert all(p.wait(timeout=240) == 0 for p in procs)
    rep = verify(tmp_path)
    assert rep.intact, rep.problems
    assert len(rep.records) == 450
    assert len(rotated_files(tmp_path)) >= 2
    for w in range(3):  # each writer's records, in its own order
        mine = [r["i"] for r in rep.records if r["writer"] == str(w)]
        assert mine == list(range(150))


# -- the command ------------------------------------------------------------------


def test_audit_command_verifies_and_names_the_broken_line(tmp_path: Path) -> None:
    write_log(tmp_path, 30)
    r = cli(tmp_path, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["intact"] and len(data["records"]) == 30
    r = cli(tmp_path, "--tenant", "t1", "--json")
    assert {rec["tenant"] for rec in json.loads(r.stdout)["records"]} == {"t1"}
    r = cli(tmp_path, "--since", "1h", "--json")
    assert len(json.loads(r.stdout)["records"]) == 30
    r = cli(tmp_path, "--since", "2999-01-01T00:00:00", "--json")
    assert json.loads(r.stdout)["records"] == []
    r = cli(tmp_path, "--since", "yesterday-ish")
    assert r.returncode == ExitCode.USAGE and "--since" in r.stderr

    second = log_files(tmp_path)[1]
    rewrite(second, lambda ls: ls[:2] + ls[3:])
    r = cli(tmp_path, "--verify")
    assert r.returncode == ExitCode.AUDIT_BROKEN, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("audit: ") and f"{second}:3:" in line
    # Without --verify: the records, and a warning, exit 0.
    r = cli(tmp_path)
    assert r.returncode == 0 and "warning: the hash chain is broken" in r.stderr


def test_audit_command_on_a_directory_without_a_log(tmp_path: Path) -> None:
    # Reading an empty place is fine; verifying it is not: nothing shows the
    # chain intact (a removed log, or the wrong --index-dir). One line, exit 9.
    r = cli(tmp_path)
    assert r.returncode == 0 and "no audit log" in r.stdout
    r = cli(tmp_path, "--verify")
    assert r.returncode == ExitCode.AUDIT_BROKEN, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("audit: no audit log in ") and str(tmp_path) in line, line
    assert "Traceback" not in r.stderr and r.stdout == ""
    r = cli(tmp_path, "--verify", "--json")
    assert r.returncode == ExitCode.AUDIT_BROKEN
    data = json.loads(r.stdout)
    assert data["present"] is False and data["intact"] is False
    # The whole log removed, anchor and all, after it held records: the same.
    write_log(tmp_path, 30)
    assert cli(tmp_path, "--verify").returncode == 0
    for p in [*log_files(tmp_path), tmp_path / HEAD]:
        p.unlink()
    assert cli(tmp_path, "--verify").returncode == ExitCode.AUDIT_BROKEN


def test_a_deleted_oldest_file_stays_reported_after_later_rotations(tmp_path: Path) -> None:
    """The anchor's oldest seq advances only past files the writer pruned itself:
    deleting the oldest rotated file is not hidden by the next rotations, with
    or without pruning (issue 28 item 8)."""
    log = write_log(tmp_path, 60, keep=3)
    assert verify(tmp_path).intact
    oldest = rotated_files(tmp_path)[0]
    oldest[1].unlink()
    assert not verify(tmp_path).intact
    seen = {s for s, _p in rotated_files(tmp_path)}
    # Rotate several more times: first with no pruning due (one file is
    # missing), then pruning the files after the gap.
    for i in range(400):
        log("purge_tenant", {"tenant": "t0", "chunks": i, "note": "y" * 40})
        seen |= {s for s, _p in rotated_files(tmp_path)}
        rep = verify(tmp_path)
        assert not rep.intact, f"the deletion was hidden after {i + 1} more records"
        assert "missing records" in rep.problems[0].reason, rep.problems[0]
    assert len(seen) >= 8, "the test needs rotations that prune"
    r = cli(tmp_path, "--verify")
    assert r.returncode == ExitCode.AUDIT_BROKEN, (r.stdout, r.stderr)


def test_pruning_by_the_writer_advances_the_anchor_exactly(tmp_path: Path) -> None:
    """keep=2 over many rotations: the chain verifies after every record, its
    first record is the anchor's oldest, and the note says what was pruned."""
    log = write_log(tmp_path, 5, keep=2)
    for i in range(200):
        log("admin", {"verb": "ls", "n": i})
        rep = verify(tmp_path)
        assert rep.intact, (i, rep.problems)
    assert rep.records[0]["seq"] > 1
    assert any(f"before seq {rep.records[0]['seq']} were rotated away" in n for n in rep.notes)


def test_an_older_unchained_log_is_moved_aside_and_a_chain_starts(tmp_path: Path) -> None:
    old = b'{"event": "purge_tenant", "tenant": "acme", "ts": 1.0}\n'
    (tmp_path / ACTIVE).write_bytes(old)
    AuditLog(tmp_path / ACTIVE)("admin", {"verb": "fsck"})
    (legacy,) = tmp_path.glob("audit.legacy-*.jsonl")
    assert legacy.read_bytes() == old
    rep = verify(tmp_path)
    assert rep.intact and [r["seq"] for r in rep.records] == [1]


def test_a_peer_probing_many_tenants_is_coalesced_too(tmp_path: Path) -> None:
    now = [1000.0]
    log = AuditLog(tmp_path / ACTIVE, clock=lambda: now[0])
    peer = {"uid": 77, "gid": 77, "pid": 5, "verb": "hello", "result": "refused"}
    for i in range(2000):
        log.record("refused_access", {**peer, "tenant": f"guess-{i}"})
    recs = verify(tmp_path).records
    assert len(recs) == 17  # 16 named tenants, then one line for the rest
    assert recs[-1]["tenant"] == "*"
    now[0] += 61
    log.record("refused_access", {**peer, "tenant": "guess-5000"})
    recs = verify(tmp_path).records
    assert recs[-1]["tenant"] == "guess-5000"
    other = {**peer, "uid": 78}
    assert log.record("refused_access", {**other, "tenant": "guess-1"})  # its own budget


def test_a_sidecar_rotating_after_the_oldest_file_was_deleted_keeps_it_reported() -> None:
    """Issue 28 item 8 through a real sidecar: rotated files deleted by hand stay
    a break (exit 9) after the sidecar itself rotates, and prunes, further."""
    from kvoffload import protocol as p
    from kvoffload.transport import UnixTransport
    from tests.sidecar_proc import dev_sidecar

    env = {"KVOFFLOAD_AUDIT_MAX_BYTES": "4KiB", "KVOFFLOAD_AUDIT_KEEP": "3"}
    with (
        dev_sidecar(env) as sc,
        contextlib.closing(UnixTransport.connect(sc.socket_path, timeout_s=30)) as t,
    ):
        index = sc.workdir / ".kvoffload" / "index"
        ids = itertools.count(1)

        def call(req: p.Request) -> p.Reply:
            rid = next(ids)
            t.send(p.request_message(rid, req))
            got, reply = p.parse_reply(t.recv().msg)
            assert got == rid
            return reply

        assert isinstance(call(p.Hello(1, 1, "audit-test", ())), p.HelloReply)

        def admin_records(n: int) -> None:
            for _ in range(n):  # each an "admin" audit record (audit-v1 §3)
                assert isinstance(call(p.DropCache()), p.DropCacheReply)

        def verify_exit() -> int:
            r = subprocess.run(
                cli_argv("--dev", "audit", "--verify"),
                cwd=sc.workdir,
                capture_output=True,
                text=True,
                timeout=120,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            )
            assert "Traceback" not in r.stderr
            return r.returncode

        while len(rotated_files(index)) < 3:
            admin_records(10)
        assert verify_exit() == 0
        rotated_files(index)[0][1].unlink()
        assert verify_exit() == ExitCode.AUDIT_BROKEN
        names = {s for s, _p in rotated_files(index)}
        while len(names) < 8:  # the sidecar rotates (and prunes) several times more
            admin_records(10)
            names |= {s for s, _p in rotated_files(index)}
            assert verify_exit() == ExitCode.AUDIT_BROKEN
