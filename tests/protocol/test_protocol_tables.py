"""The op → class tables of protocol v1 are made from the message classes.

``REQUEST_TYPES`` and ``REPLY_TYPES`` are both built by ``fields.op_table``
from a union of classes (``Request``, ``ResultReply``). These tests hold the
derivation to it: every message class of the package that names an op is the
one its table gives for that op (so a class added outside its union, or two
classes claiming one op, fail here), and every request op is answered by
exactly one of a reply class or an ``Ack``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from kvoffload import protocol as p
from kvoffload.protocol.fields import ReplyMessage, op_table
from kvoffload.protocol.requests import RequestMessage


def _classes(base: type, module_prefix: str) -> list[type]:
    """The subclasses of ``base`` (at any depth) defined under ``module_prefix``
    that name an op: the ones a table must reach."""
    out: list[type] = []
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "DECODES_AS_BASE", False):
            continue  # an encoding of its base (LoadPlan): the table gives the base
        if cls.__module__.startswith(module_prefix) and getattr(cls, "OP", None) is not None:
            out.append(cls)
    return out


def _unreachable(base: type, table: dict[p.Op, Any], module_prefix: str) -> list[str]:
    """One line per class the table does not give for its op."""
    faults = []
    for cls in _classes(base, module_prefix):
        got = table.get(cls.OP)
        if got is not cls:
            owner = "nothing" if got is None else got.__name__
            faults.append(f"{cls.__name__}: op {cls.OP.value!r} gives {owner}")
    return sorted(faults)


def test_every_request_class_is_the_one_its_op_gives() -> None:
    classes = _classes(RequestMessage, "kvoffload.")
    assert len(classes) == len(p.REQUEST_TYPES)  # the walk sees them all
    assert _unreachable(RequestMessage, p.REQUEST_TYPES, "kvoffload.") == []


def test_every_reply_class_is_the_one_its_op_gives() -> None:
    classes = _classes(ReplyMessage, "kvoffload.")
    assert len(classes) == len(p.REPLY_TYPES)
    assert _unreachable(ReplyMessage, p.REPLY_TYPES, "kvoffload.") == []


def test_the_check_names_a_class_left_out_and_one_claiming_a_taken_op() -> None:
    # Deliberate violations, under a local base so that the real check above
    # never sees them: the check must report both.
    class _Local(ReplyMessage, frozen=True):
        pass

    class LeftOut(_Local, frozen=True):  # an op no reply class answers
        OP: ClassVar[p.Op] = p.Op.ABORT

    class Rival(_Local, frozen=True):  # an op StatsReply already answers
        OP: ClassVar[p.Op] = p.Op.STATS

    assert _unreachable(_Local, p.REPLY_TYPES, __name__) == [
        "LeftOut: op 'abort' gives nothing",
        "Rival: op 'stats' gives StatsReply",
    ]
    del LeftOut, Rival


def test_op_table_refuses_two_classes_claiming_one_op() -> None:
    class Twin(ReplyMessage, frozen=True):
        OP: ClassVar[p.Op] = p.Op.STATS

    with pytest.raises(TypeError, match="StatsReply and Twin both claim op 'stats'"):
        op_table(p.StatsReply | Twin)


def test_op_table_refuses_a_class_without_an_op() -> None:
    with pytest.raises(TypeError, match="Ack names no op"):
        op_table(p.StatsReply | p.Ack)


def test_every_request_op_has_one_answer() -> None:
    for op in p.REQUEST_TYPES:
        assert (op in p.REPLY_TYPES) != (op in p.ACK_OPS), op
    # A reply with result keys answers a request, or is load_progress's interim frame.
    assert set(p.REPLY_TYPES) - set(p.REQUEST_TYPES) == {p.Op.LOAD_PROGRESS}
    assert set(p.REQUEST_TYPES) >= p.ACK_OPS
    # Every op is a request but the server's own frames.
    assert set(p.Op) - set(p.REQUEST_TYPES) == {p.Op.LOAD_PROGRESS, p.Op.ERROR}


def test_the_tables_are_the_ones_the_codec_reads() -> None:
    msg = p.reply_message(7, p.DropCacheReply(3, held_bytes=4096))
    assert p.parse_reply(msg) == (7, p.DropCacheReply(3, held_bytes=4096))
    req = p.StoreBatch("acme", b"\x11" * 32, (p.StoreChunk(b"\x22" * 32, (5,), offset=0),))
    wire = p.request_message(9, req)
    assert wire["op"] == "store"  # the class is renamed, the verb is not
    assert p.parse_request(wire) == (9, req)
