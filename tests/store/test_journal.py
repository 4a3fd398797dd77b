"""Node journals of a shared store root (shared-root-v1.md §1-3), on real files."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from kvoffload.errors import JournalError
from kvoffload.store.shared.journal import (
    HEADER_SIZE,
    JournalFollower,
    JournalRecord,
    JournalWriter,
    Op,
    Reason,
    decode_records,
    encode_record,
    load_or_create_node_id,
    node_dir,
)

NS = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def stores(n: int, start: int = 0, tenant: str = "acme") -> list[JournalRecord]:
    return [JournalRecord.store(tenant, key(i), NS, 4096 + i) for i in range(start, start + n)]


def writer(root: Path, node: str, **kw: object) -> JournalWriter:
    w = JournalWriter(root, node, **kw)  # type: ignore[arg-type]
    w.open()
    return w


A = "a" * 32
B = "b" * 32


def test_every_op_round_trips() -> None:
    recs = [
        JournalRecord.store(
            "acme", key(1), NS, 123, payload=100, key_epoch=3, num_layers=32, expires_ns=99
        ),
        JournalRecord.touch("acme", key(1)),
        JournalRecord.remove("acme", key(1), Reason.EVICTED, lease_epoch=7),
        JournalRecord.purge_tenant("t.b-c_d"),
        JournalRecord.purge_namespace("acme", NS),
    ]
    data = b"".join(encode_record(r) for r in recs)
    out, end = decode_records(data)
    assert out == recs
    assert end == len(data)


def test_encode_refuses_malformed_records() -> None:
    with pytest.raises(ValueError):
        encode_record(JournalRecord(Op.STORE, "acme", 0, b"short", NS))
    with pytest.raises(ValueError):
        encode_record(JournalRecord(Op.TOUCH, "", 0, key(1)))
    with pytest.raises(ValueError):
        encode_record(JournalRecord(Op.PURGE_NAMESPACE, "acme", 0))


def test_decode_stops_before_an_incomplete_tail() -> None:
    data = b"".join(encode_record(r) for r in stores(3))
    for cut in range(1, len(encode_record(stores(1)[0]))):
        out, end = decode_records(data[:-cut])
        assert len(out) == 2
        assert end == len(data) - len(encode_record(stores(1, 2)[0]))


def test_decode_refuses_an_oversized_length() -> None:
    with pytest.raises(JournalError, match="over the limit"):
        decode_records(struct.pack("<II", 1 << 20, 0) + b"x" * 16)


def test_follower_sees_another_nodes_records_in_order(tmp_path: Path) -> None:
    wa = writer(tmp_path, A)
    wb = writer(tmp_path, B)
    wa.append(stores(3))
    wb.append(stores(2, 100))
    f = JournalFollower(tmp_path, own_node_id=A)
    got = f.poll()
    assert [(n, r.key) for n, r in got] == [(B, key(100)), (B, key(101))]
    assert f.poll() == []
    wb.append([JournalRecord.remove("acme", key(100), Reason.EXPIRED)])
    ((node, rec),) = f.poll()
    assert node == B and rec.op is Op.REMOVE and rec.reason is Reason.EXPIRED


def test_a_torn_tail_is_waited_for_then_read(tmp_path: Path) -> None:
    wb = writer(tmp_path, B, durable=False)
    wb.append(stores(1))
    f = JournalFollower(tmp_path, own_node_id=A)
    assert len(f.poll()) == 1
    # Half a record, as a reader may see it mid-write.
    frame = encode_record(stores(1, 7)[0])
    seg = node_dir(tmp_path, B) / "seg-00000000000000000001.kvj"
    with open(seg, "ab") as fh:
        fh.write(frame[:10])
    assert f.poll() == []
    with open(seg, "ab") as fh:
        fh.write(frame[10:])
    ((_, rec),) = f.poll()
    assert rec.key == key(7)
    assert f.stats.damaged_segments == 0


def test_damage_in_an_older_segment_skips_its_rest_and_goes_on(tmp_path: Path) -> None:
    wb = writer(tmp_path, B, durable=False)
    wb.append(stores(4))
    seg1 = node_dir(tmp_path, B) / "seg-00000000000000000001.kvj"
    # Flip a byte inside the third record's body.
    rec_len = len(encode_record(stores(1)[0]))
    raw = bytearray(seg1.read_bytes())
    raw[HEADER_SIZE + 2 * rec_len + 20] ^= 0xFF
    seg1.write_bytes(bytes(raw))
    wb.close()
    wb2 = writer(tmp_path, B, durable=False)  # a restart starts segment 2
    wb2.append(stores(2, 50))
    f = JournalFollower(tmp_path, own_node_id=A)
    keys = [r.key for _, r in f.poll()]
    keys += [r.key for _, r in f.poll()]  # the mismatch is confirmed on the next poll
    assert keys == [key(0), key(1), key(50), key(51)]
    assert f.stats.damaged_segments == 1
    assert "checksum mismatch" in f.stats.messages[0]


def test_a_crc_mismatch_in_the_newest_segment_is_retried_not_skipped(tmp_path: Path) -> None:
    # Some filesystems show a file's new size before its data: zeros first.
    wb = writer(tmp_path, B, durable=False)
    frame = encode_record(stores(1, 3)[0])
    seg = node_dir(tmp_path, B) / "seg-00000000000000000001.kvj"
    with open(seg, "ab") as fh:
        fh.write(frame[:8] + bytes(len(frame) - 8))
    f = JournalFollower(tmp_path, own_node_id=A)
    assert f.poll() == []
    assert f.poll() == []
    with open(seg, "r+b") as fh:
        fh.seek(HEADER_SIZE)
        fh.write(frame)
    ((_, rec),) = f.poll()
    assert rec.key == key(3)
    assert f.stats.damaged_segments == 0
    wb.close()


def test_unknown_journal_version_skips_that_node_only(tmp_path: Path) -> None:
    wb = writer(tmp_path, B, durable=False)
    wb.append(stores(2))
    c = "c" * 32
    wc = writer(tmp_path, c, durable=False)
    wc.append(stores(1, 9))
    seg = node_dir(tmp_path, B) / "seg-00000000000000000001.kvj"
    raw = bytearray(seg.read_bytes())
    raw[4:6] = (2).to_bytes(2, "little")
    raw[28:32] = zlib.crc32(bytes(raw[:28])).to_bytes(4, "little")
    seg.write_bytes(bytes(raw))
    f = JournalFollower(tmp_path, own_node_id=A)
    got = f.poll()
    assert [(n, r.key) for n, r in got] == [(c, key(9))]
    assert f.stats.skipped_nodes == 1
    assert "journal version 2 is not supported" in f.stats.messages[0]


def test_rotation_and_compaction_are_followed(tmp_path: Path) -> None:
    wb = writer(tmp_path, B, durable=False, segment_bytes=HEADER_SIZE + 300)
    f = JournalFollower(tmp_path, own_node_id=A)
    wb.append(stores(2))
    wb.append(stores(2, 2))
    wb.append(stores(2, 4))
    assert [r.key for _, r in f.poll()] == [key(i) for i in range(6)]
    assert len(os.listdir(node_dir(tmp_path, B))) > 2
    # Removals the follower never read, then compaction to what is live.
    wb.append([JournalRecord.remove("acme", key(i), Reason.EVICTED) for i in range(4)])
    late = JournalFollower(tmp_path, own_node_id=A)
    late.restore({B: (1, HEADER_SIZE)})
    wb.compact(stores(2, 4))
    wb.append(stores(1, 6))
    got = [(r.op, r.key) for _, r in late.poll()]
    assert got == [(Op.STORE, key(4)), (Op.STORE, key(5)), (Op.STORE, key(6))]
    # The follower that was current also converges: it re-reads the checkpoint.
    again = [(r.op, r.key) for _, r in f.poll()]
    assert (Op.STORE, key(6)) == again[-1]


def test_positions_survive_a_follower_restart(tmp_path: Path) -> None:
    wb = writer(tmp_path, B, durable=False)
    wb.append(stores(3))
    f = JournalFollower(tmp_path, own_node_id=A)
    assert len(f.poll()) == 3
    saved = f.positions()
    wb.append(stores(1, 3))
    f2 = JournalFollower(tmp_path, own_node_id=A)
    f2.restore(saved)
    assert [r.key for _, r in f2.poll()] == [key(3)]


def test_a_restart_never_appends_to_the_old_segment(tmp_path: Path) -> None:
    w = writer(tmp_path, B, durable=False)
    w.append(stores(1))
    w.close()
    w2 = writer(tmp_path, B, durable=False)
    assert w2.segment == 2
    assert w2.incarnation != w.incarnation


def test_node_id_is_stable_and_garbage_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    nid = load_or_create_node_id(state)
    assert load_or_create_node_id(state) == nid
    assert oct((state / "node-id").stat().st_mode & 0o777) == "0o600"
    (state / "node-id").write_text("not-an-id\n")
    with pytest.raises(JournalError, match="does not hold a node id"):
        load_or_create_node_id(state)


def test_writer_refuses_a_bad_node_id(tmp_path: Path) -> None:
    with pytest.raises(JournalError):
        JournalWriter(tmp_path, "../etc")


def test_journal_files_are_private_under_umask_0022(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        w = writer(tmp_path, B, durable=False)
        w.append(stores(1))
    finally:
        os.umask(old)
    d = node_dir(tmp_path, B)
    assert d.stat().st_mode & 0o077 == 0
    for p in d.iterdir():
        assert p.stat().st_mode & 0o077 == 0, p
