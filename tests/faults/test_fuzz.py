"""Protocol fuzzing (issue 11, the fault suite), with hypothesis.

Seeds: every request frame of ``tests/data/frames/frames.json`` and the corpus
``tests/data/fuzz/seeds.json`` (frames that found holes; add new finds there).
Mutations: bit flips, byte inserts and deletions, truncation, splices, and
structure-aware ones on the msgpack map (a field dropped, added, or replaced by
an arbitrary value). Bounded: derandomized and a fixed number of examples in CI
(``KVOFFLOAD_FAULTS=full``: random and ten times as many).

1. The frame decoder and request parser alone: anything but ProtocolError out
   of them is a failure.
2. A real server on a real store over a real socket: every mutated sequence
   after a valid hello, ended by ``bye``; a reply must come for each request or
   the connection close with an error frame, never ``INTERNAL`` (an unexpected
   exception in a verb), never a hang; the server answers a fresh client after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import protocol as p
from kvoffload.protocol import CLIENT_MAGIC, SERVER_MAGIC, ErrorCode
from kvoffload.staging import PAGE, StagingBuffer
from tests.helpers.server import Raw, ServerThread, grants, sock_path
from tests.helpers.stores import make_store

from .conftest import FULL, family

DATA = Path(__file__).resolve().parents[1] / "data"


def _frames(path: Path) -> dict[str, bytes]:
    return {k: bytes.fromhex(v) for k, v in json.loads(path.read_text())["frames"].items()}


def _is_request(frame: bytes) -> bool:
    try:
        (msg,) = [f.msg for f in p.FrameDecoder().feed(frame)]
        p.parse_request(msg)
        return True
    except p.ProtocolError:
        return False


SEEDS = [f for f in _frames(DATA / "frames" / "frames.json").values() if _is_request(f)]
SEEDS += list(_frames(DATA / "fuzz" / "seeds.json").values())
assert len(SEEDS) > 20

SETTINGS = settings(
    max_examples=3000 if FULL else 250,
    derandomize=not FULL,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats()
    | st.text(max_size=80) | st.binary(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    frame = draw(st.sampled_from(SEEDS))
    body = frame[4:]
    kind = draw(
        st.sampled_from(["bits", "insert", "delete", "truncate", "splice", "field", "drop", "add"])
    )
    if kind in ("field", "drop", "add"):
        msg = msgpack.unpackb(body, raw=False)
        keys = sorted(msg)
        if kind == "field":
            msg[draw(st.sampled_from(keys))] = draw(values)
        elif kind == "drop":
            msg.pop(draw(st.sampled_from(keys)))
        else:
            msg[draw(st.text(max_size=12))] = draw(values)
        with contextlib.suppress(OverflowError, ValueError, TypeError):
            body = msgpack.packb(msg, use_bin_type=True)
    else:
        b = bytearray(body)
        n = draw(st.integers(1, 8))
        for _ in range(n):
            if not b:
                break
            i = draw(st.integers(0, len(b) - 1))
            if kind == "bits":
                b[i] ^= 1 << draw(st.integers(0, 7))
            elif kind == "insert":
                b[i:i] = draw(st.binary(min_size=1, max_size=8))
            elif kind == "delete":
                del b[i : i + draw(st.integers(1, 8))]
            elif kind == "truncate":
                del b[i:]
            else:
                other = draw(st.sampled_from(SEEDS))[4:]
                b[i:] = other[draw(st.integers(0, len(other))) :]
        body = bytes(b)
    return len(body).to_bytes(4, "little") + body


def test_fuzz_decoder_and_parser() -> None:
    fam = family("fuzz/decoder")

    @SETTINGS
    @given(frames=st.lists(mutated(), min_size=1, max_size=4))
    def run(frames: list[bytes]) -> None:
        dec = p.FrameDecoder()
        ok, detail = True, ""
        try:
            for f in dec.feed(b"".join(frames)):
                with contextlib.suppress(p.ProtocolError):
                    p.parse_request(f.msg)
            dec.raise_if_failed()
        except p.ProtocolError:
            pass
        except Exception as exc:  # anything else is a bug of the decoder
            ok, detail = False, f"{type(exc).__name__}: {exc} on {b''.join(frames).hex()[:200]}"
        fam.case("frames", ok, detail)

    run()
    fam.check()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kvoffload.sidecar.config import ServerConfig

    d = tmp_path_factory.mktemp("fuzz")
    (d / "kek").write_bytes(os.urandom(32))
    store = make_store(d / "store", d / "kek", durability="none")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    config = ServerConfig(socket_path=sock_dir / "kvo.sock", secret=b"\x5a" * 32, workers=4)
    st_ = ServerThread(store, grants("acme", admin=True), config)
    yield st_
    st_.stop()
    store.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def _session(server: ServerThread, frames: list[bytes]) -> str | None:
    """Send hello, the frames, then bye; None if the server held up."""
    hello = p.encode_frame(p.request_message(1, p.Hello(1, 1, "fuzz", ("acme", "other"))))
    reg = p.encode_frame({**p.request_message(2, p.RegisterStaging(16 * PAGE)), "fds": 1})
    bye = p.encode_frame(p.request_message(2**32 - 1, p.Bye()))
    staging = StagingBuffer(16 * PAGE)  # so that the write and read verbs get past it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(os.fspath(sock_path(server)))
        data = b""
        try:
            s.sendall(CLIENT_MAGIC + hello)
            socket.send_fds(s, [reg], [staging.fd])
            s.sendall(b"".join(frames) + bye)
            while chunk := s.recv(1 << 16):
                data += chunk
        except TimeoutError:
            return "no reply and no close within 20 s (a hang)"
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on a fatal frame before all was sent
    staging.close()
    if not data.startswith(SERVER_MAGIC):
        return "no server magic"
    try:
        replies = p.FrameDecoder().feed(data[len(SERVER_MAGIC) :])
    except p.ProtocolError as exc:
        return f"undecodable reply stream: {exc}"
    for f in replies:
        _rid, reply = p.parse_reply(f.msg)
        if isinstance(reply, p.ErrorReply) and reply.code is ErrorCode.INTERNAL:
            return f"INTERNAL: {reply.message} after {b''.join(frames).hex()[:300]}"
    return None


def _alive(server: ServerThread) -> bool:
    raw = Raw(server)
    try:
        raw.hello()
        return raw.call(p.Lookup("acme", (b"\x01" * 32,))) is not None
    finally:
        raw.close()


def test_fuzz_live_server(live: ServerThread) -> None:
    fam = family("fuzz/live-server")
    budget = settings(SETTINGS, max_examples=1500 if FULL else 100)

    @budget
    @given(frames=st.lists(mutated(), min_size=1, max_size=5))
    def run(frames: list[bytes]) -> None:
        failure = _session(live, frames)
        fam.case("session", failure is None, failure or "")

    run()
    fam.case("alive after all sessions", _alive(live))
    fam.check()
