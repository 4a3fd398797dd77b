"""``kvoffload events tail``: the admin's view of a running sidecar's KV-event feed.

It reads the same sockets a router does (docs/spec/events-v1.md), so it needs
the same rights: the ipc:// socket files are mode 0660, group ``[server]
socket_group``, and then the sidecar checks the user (§7.1): the full feed for
a reader (root, the sidecar's uid, ``[events] readers``), ``--tenant T`` for a
user the policy grants T.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .app import JsonOpt, app, config, out, socket_group_hint, state
from .exits import _CliUsageError, _SidecarUnreachable

#: How long a ``stats`` call for the hints may take.
STATS_TIMEOUT_S = 2.0
#: How often an idle tail asks the sidecar why nothing shows.
HINT_INTERVAL_S = 1.0

events_app = typer.Typer(help="KV events of the running sidecar.", no_args_is_help=True)
app.add_typer(events_app, name="events")


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def event_record(seq: int, ts: float, event: Any) -> dict[str, Any]:
    """One decoded event as a JSON-ready map (hashes as hex when they are bytes)."""
    import msgspec

    from ..events.wire import UnknownEvent, split_seq

    incarnation, counter = split_seq(seq)
    rec: dict[str, Any] = {"seq": seq, "incarnation": incarnation, "counter": counter, "ts": ts}
    if isinstance(event, UnknownEvent):
        rec["type"] = event.type
        return rec
    rec["type"] = type(event).__name__
    for name, value in msgspec.structs.asdict(event).items():
        if value is not None and value != ():
            rec[name] = _plain(value)
    return rec


def _feed_state(socket_path: Path) -> dict[str, Any] | None:
    """The sidecar's ``events`` stats (events-v1 §9), or None if no sidecar answers."""
    from ..client import fetch_stats
    from ..errors import ProtocolError, TransportError

    try:
        stats = fetch_stats(socket_path, timeout_s=STATS_TIMEOUT_S)
    except (TransportError, ProtocolError, OSError):
        return None
    events = stats.get("events")
    return events if isinstance(events, dict) else {}


def _check_endpoint(endpoint: str, socket_path: Path, dev: bool) -> None:
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint.removeprefix("ipc://"))
    serve = f"`kvoffload{' --dev' if dev else ''} serve --events`"
    if not path.exists():
        feed = _feed_state(socket_path)
        if feed is None:
            raise _SidecarUnreachable(
                f"no sidecar answered on {socket_path} and no KV-event socket is at {path}: "
                f"start one with {serve}"
            )
        if feed.get("enabled") is False:
            raise _SidecarUnreachable(
                f"the sidecar on {socket_path} publishes no KV events: start it with "
                f"{serve} (or [events] enabled = true, KVOFFLOAD_EVENTS_ENABLED=1)"
            )
        raise _SidecarUnreachable(
            f"no KV-event socket at {path}: the sidecar on {socket_path} publishes "
            f"elsewhere ([events] endpoint): pass the same config to `events tail`"
        )
    if not os.access(path, os.R_OK | os.W_OK):
        raise _SidecarUnreachable(
            f"permission denied on {path}: {socket_group_hint(path)} to read its events"
        )


class _SilenceHints:
    """Why nothing shows (events-v1 §7): chunks stored without engine block hashes, or of
    tenants with ``events = false``, are never announced. While the tail is idle it
    compares the sidecar's counters (admins see them) with those at its start and
    says so once, on stderr."""

    KEYS = (
        (
            "stored_without_hashes",
            "carried no engine block hashes, so they are not announced (events-v1 §7): "
            "the vLLM connector sends them with its saves; `kvoffload demo` and "
            "SidecarClient.save without blocks do not",
        ),
        (
            "stored_tenant_events_off",
            "belong to tenants with events = false in the policy: never announced",
        ),
    )

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.base = self._counts()
        self.said: set[str] = set()
        self.next_check = 0.0

    def _counts(self) -> dict[str, int]:
        feed = _feed_state(self.socket_path) or {}
        return {k: int(feed[k]) for k, _ in self.KEYS if isinstance(feed.get(k), int)}

    def check(self, *, now: bool = False) -> None:
        t = time.monotonic()
        if (t < self.next_check and not now) or len(self.said) == len(self.KEYS):
            return
        self.next_check = t + HINT_INTERVAL_S
        counts = self._counts()
        for key, why in self.KEYS:
            n = counts.get(key, 0) - self.base.get(key, 0)
            if n > 0 and key not in self.said:
                self.said.add(key)
                print(f"note: {n} chunk(s) stored since this tail started {why}", file=sys.stderr)


@events_app.command("tail")
def tail(
    as_json: JsonOpt = False,
    from_seq: Annotated[
        int | None,
        typer.Option(
            "--from",
            metavar="SEQ",
            help="Replay from this seq first (the durable buffer), then follow.",
        ),
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", "-n", metavar="N", help="Stop after this many events.")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", metavar="SECONDS", help="Stop after this many seconds without an event."
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            metavar="TENANT",
            help="Follow this tenant's channel instead of the full feed.",
        ),
    ] = None,
) -> None:
    """Print the sidecar's KV events as they are published (one line each).

    The feed is on only where the sidecar runs with `kvoffload serve --events`
    ([events] enabled = true). Only chunks saved with engine block hashes are
    announced (events-v1 §7: the vLLM connector sends them; `kvoffload demo`
    and a plain SidecarClient.save do not): while none arrive, a note on stderr
    says when the sidecar stored chunks it does not announce, and why.
    """
    import zmq

    from ..contract import TENANT_RE
    from ..events.access import tenant_topic
    from ..sidecar.events import default_endpoints

    if tenant is not None and not TENANT_RE.fullmatch(tenant):
        raise _CliUsageError(f"--tenant: {tenant!r} is not a tenant id")
    topic = tenant_topic(tenant) if tenant is not None else b""

    if from_seq is not None and from_seq < 0:
        raise _CliUsageError("--from takes a seq ≥ 0")
    if count is not None and count <= 0:
        raise _CliUsageError("--count takes a number ≥ 1")
    cfg = config()
    pub_default, replay_default = default_endpoints(cfg.socket_path)
    endpoint = cfg.events_endpoint or pub_default
    replay = cfg.events_replay_endpoint or replay_default
    _check_endpoint(endpoint, cfg.socket_path, cfg.dev)
    hints = _SilenceHints(cfg.socket_path)
    show = _Shower(as_json, count)

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    sub.connect(endpoint)
    last_seq: int | None = None
    try:
        _check_admitted(monitor)
        # Said once the feed admitted us: a refused user gets its one line only.
        print(f"following the KV events on {endpoint} (Ctrl-C stops)", file=sys.stderr)
        if from_seq is not None:
            _check_endpoint(replay, cfg.socket_path, cfg.dev)
            last_seq, done = _replay(ctx, replay, from_seq, topic, show)
            if done:
                return
        _follow(sub, show, hints, timeout, last_seq)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()


class _Shower:
    """Prints each event of a batch; True once ``count`` events were shown."""

    def __init__(self, as_json: bool, count: int | None) -> None:
        self.as_json = as_json
        self.count = count
        self.shown = 0
        self.last_event = time.monotonic()

    def __call__(self, seq: int, payload: bytes) -> bool:
        from ..errors import EventDecodeError
        from ..events.wire import decode_batch

        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            print(f"seq {seq}: malformed batch: {exc}", file=sys.stderr)
            return False
        for ev in batch.events:
            _print_record(event_record(seq, batch.ts, ev), self.as_json)
            self.shown += 1
            self.last_event = time.monotonic()
            if self.count is not None and self.shown >= self.count:
                return True
        sys.stdout.flush()
        return False


def _follow(
    sub: Any, show: _Shower, hints: _SilenceHints, timeout: float | None, last_seq: int | None
) -> None:
    """The live feed, after any replay, until ``show`` has enough or ``timeout``."""
    from ..errors import EventDecodeError
    from ..events.wire import unpack_frames

    while True:
        if state.interrupted:  # its KeyboardInterrupt may have been dropped in a finalizer
            raise KeyboardInterrupt
        if timeout is not None and time.monotonic() - show.last_event > timeout:
            hints.check(now=True)
            return
        if not sub.poll(200):
            hints.check()
            continue
        try:
            frame = unpack_frames(sub.recv_multipart())
        except EventDecodeError as exc:
            print(f"malformed message: {exc}", file=sys.stderr)
            continue
        if last_seq is not None and frame.seq <= last_seq:
            continue  # already shown by the replay
        if show(frame.seq, frame.payload):
            return


def _print_record(rec: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(rec, sort_keys=True) + "\n")
        return
    hashes = rec.get("block_hashes", [])
    short = ",".join(str(h)[:12] for h in hashes[:4])
    more = f"+{len(hashes) - 4}" if len(hashes) > 4 else ""
    out.print(
        f"{rec['seq']} inc {rec['incarnation']} {rec['type']} "
        f"{rec.get('medium', '')} {rec.get('locality', '')} "
        f"[{len(hashes)}] {short}{more}",
        highlight=False,
    )


def _replay(
    ctx: Any, replay: str, from_seq: int, topic: bytes, show: Any
) -> tuple[int | None, bool]:
    """Show the buffered batches from ``from_seq``: (the last seq shown, whether
    ``show`` had enough)."""
    import zmq

    from ..errors import EventDecodeError
    from ..events.access import request_frames
    from ..events.wire import encode_replay_request, is_end_marker, unpack_frames

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(replay)
    dealer.send_multipart(request_frames(encode_replay_request(from_seq), topic))
    last_seq: int | None = None
    try:
        while True:
            parts = dealer.recv_multipart()
            frame = unpack_frames(parts[1:] if parts and parts[0] == b"" else parts)
            if is_end_marker(frame):
                return last_seq, False
            last_seq = frame.seq
            if show(frame.seq, frame.payload):
                return last_seq, True
    except zmq.Again as exc:
        raise _SidecarUnreachable(f"the replay socket {replay} did not answer") from exc
    except EventDecodeError as exc:
        raise _SidecarUnreachable(f"the replay socket sent a malformed message: {exc}") from exc
    finally:
        dealer.close(linger=0)


def _check_admitted(monitor: Any, wait_s: float = 5.0) -> None:
    """The sidecar refuses, at the handshake, a user who may read nothing (§7.1):
    say so in one line instead of waiting for events that never come."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    if not monitor.poll(int(wait_s * 1000)):
        return  # no answer yet (an old sidecar, a slow one): follow anyway
    event = recv_monitor_message(monitor)
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        raise _SidecarUnreachable(
            "the sidecar refused this user: it may read no KV-event feed (events-v1 §7.1: "
            "the full feed is for [events] readers, a tenant's channel for users its "
            "policy grants that tenant; --tenant T)"
        )
