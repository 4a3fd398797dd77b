"""Who reads the sidecar's KV-event feed (events-v1 §7.1), and what a policy change
does to what it announced (§7): a real ``kvoffload serve`` process, real ipc://
ZMQ sockets, subscribers in processes of their own under other uids.

- a member of the socket group with no grant reads nothing: neither the full
  feed nor any tenant's channel, live, replayed or as a snapshot;
- a peer granted one tenant reads that tenant's channel, nothing else;
- a reader (``[events] readers``) reads the full feed, every published tenant;
- no message carries the tenant's cache salt (the feed has no extra keys);
- a reload that turns a tenant's events off withdraws what was announced, for
  a consumer that stays live; a start does the same for a change made while
  the sidecar was down;
- a restart is announced at once (a first, empty batch of the new
  incarnation), so a consumer resyncs without waiting for a next save.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from kvoffload import protocol as p  # noqa: E402
from kvoffload.client import SidecarClient  # noqa: E402
from kvoffload.events.access import tenant_topic  # noqa: E402
from kvoffload.events.consumer import EventConsumer  # noqa: E402
from kvoffload.events.sources import SourceSpec  # noqa: E402
from kvoffload.events.wire import BlockStored, decode_batch, split_seq  # noqa: E402
from tests.sidecar_proc import DevSidecar, dev_sidecar, wait_until  # noqa: E402

NS = bytes(range(32))
LAYER = 32 << 10


def _group() -> tuple[str, int] | None:
    import grp

    for name in ("nogroup", "nobody"):
        try:
            return name, grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    return None


#: The socket group (an existing one: the sidecar resolves it by name); the
#: subscribers below join it, so the socket files alone keep none of them out.
SOCKET_GROUP = _group()
GROUP = SOCKET_GROUP[1] if SOCKET_GROUP else -1
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SOCKET_GROUP is None, reason="needs root and a nogroup group"
)
NO_GRANT, GRANTED, READER = 4_501, 4_502, 4_503
SALT = "s3cr3t-cache-salt-of-acme"


def _key(tenant: str, i: int) -> bytes:
    return tenant.encode().ljust(8, b".")[:8] + i.to_bytes(4, "big") + b"\x5a" * 20


def _blocks(tenant: str, i: int, *, salted: bool = True) -> p.EngineBlocks:
    hashes = tuple(_key(tenant, i)[:12] + bytes([j]) * 20 for j in range(4))
    # What the connector sends: vLLM's extra keys, the cache salt in the first block's.
    extra = ((SALT,), None, None, None) if salted else None
    return p.EngineBlocks(hashes, 16, parent=None, extra_keys=extra, group_idx=0)


def _save(sc: DevSidecar, tenant: str, i: int, **kw: Any) -> None:
    with SidecarClient(sc.socket_path, tenant, staging_bytes=1 << 20, timeout_s=30) as c:
        layers = [bytes([i % 251]) * LAYER]
        assert c.save(NS, [(_key(tenant, i), layers)], blocks=[_blocks(tenant, i, **kw)]) == [True]


def _endpoints(sc: DevSidecar) -> tuple[str, str]:
    base = sc.socket_path.parent
    return f"ipc://{base / 'kvevents.pub'}", f"ipc://{base / 'kvevents.replay'}"


def _policy(path: Path, *, acme_events: bool = True, granted: bool = True) -> None:
    path.write_text(
        "version = 1\n"
        f"[tenants.acme]\nevents = {'true' if acme_events else 'false'}\n"
        f'[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\nadmin = true\n'
        + (f'[[grants]]\nuid = {GRANTED}\ntenants = ["acme"]\n' if granted else "")
    )
    path.chmod(0o600)


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return tmp_path / "policy.toml"


@pytest.fixture
def sidecar(policy: Path) -> Iterator[DevSidecar]:
    _policy(policy)
    env = {
        "KVOFFLOAD_EVENTS_ENABLED": "1",
        "KVOFFLOAD_POLICY": str(policy),
        "KVOFFLOAD_SERVER_SOCKET_GROUP": SOCKET_GROUP[0] if SOCKET_GROUP else "",
        "KVOFFLOAD_EVENTS_READERS": f"uid:{READER}",
    }
    with dev_sidecar(env) as sc:
        # Other uids must reach the socket files (the files' 0660 + group decide).
        for d in (sc.workdir, sc.socket_path.parent):
            d.chmod(0o711)
        yield sc


# -- a subscriber in a process of its own, under another uid ------------------------------


def _listen(eps: tuple[str, str], tenants: list[str], ready: int, stop: int) -> dict[str, Any]:
    """In the child: ask for snapshots and replays, signal ready, then record the
    live feed until the parent closes ``stop``. Every message as hex frames."""
    ctx = zmq.Context()
    subs = {}
    for name, prefix in (("full", b""), ("tenants", b"kvoffload-tenant/")):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, prefix)
        s.connect(eps[0])
        subs[name] = s

    def ask(body: bytes, topic: bytes | None = None) -> list[list[str]] | None:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(eps[1])
        d.send_multipart([b"", body, *([topic] if topic else [])])
        got: list[list[str]] = []
        try:
            while d.poll(3000):
                parts = d.recv_multipart()[1:]
                if parts[0] == b"" and not parts[2]:
                    return got  # the end marker
                got.append([x.hex() for x in parts])
            return None  # no answer at all
        finally:
            d.close(linger=0)

    out: dict[str, Any] = {
        "full_snapshot": ask(b"snapshot/1"),
        "full_replay": ask((0).to_bytes(8, "big")),
    }
    for t in tenants:
        out[f"snapshot:{t}"] = ask(b"snapshot/1", tenant_topic(t))
    os.write(ready, b"R")
    live: dict[str, list[list[str]]] = {"full": [], "tenants": []}
    poller = zmq.Poller()
    for s in subs.values():
        poller.register(s, zmq.POLLIN)
    poller.register(stop, zmq.POLLIN)
    done = False
    while True:
        events = dict(poller.poll(300))
        for name, s in subs.items():
            while s in events and s.poll(0):
                live[name].append([x.hex() for x in s.recv_multipart()])
        if done and not events:
            break
        if stop in events:  # the parent is done: drain what is on its way, then stop
            done = True
            poller.unregister(stop)
    out["live"] = live
    for s in subs.values():
        s.close(linger=0)
    ctx.term()
    return out


class Child:
    """A forked process that drops to ``uid`` (in the socket group) and runs ``_listen``."""

    def __init__(self, uid: int, eps: tuple[str, str], tenants: list[str]) -> None:
        res_r, res_w = os.pipe()
        rdy_r, rdy_w = os.pipe()
        stop_r, stop_w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
            pid = os.fork()
        if pid == 0:  # the child: a ZMQ context of its own, never the parent's
            code = 1
            try:
                # Only its own pipes: another child's (inherited) would keep
                # that child's stop pipe from ever closing.
                keep = sorted((res_w, rdy_w, stop_r))
                for lo, hi in zip([3, *(k + 1 for k in keep)], [*keep, 1 << 16], strict=True):
                    os.closerange(lo, hi)
                os.setgroups([GROUP])
                os.setgid(GROUP)
                os.setuid(uid)
                result = _listen(eps, tenants, rdy_w, stop_r)
                with os.fdopen(res_w, "w") as f:
                    json.dump(result, f)
                code = 0
            finally:
                os._exit(code)
        for fd in (res_w, rdy_w, stop_r):
            os.close(fd)
        self.pid, self._res, self._rdy, self._stop = pid, res_r, rdy_r, stop_w

    def ready(self) -> None:
        assert os.read(self._rdy, 1) == b"R", "the subscriber died before it was ready"
        os.close(self._rdy)

    def result(self) -> dict[str, Any]:
        os.close(self._stop)
        with os.fdopen(self._res) as f:
            data = f.read()
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the subscriber failed"
        out: dict[str, Any] = json.loads(data)
        return out


def _hashes(messages: list[list[str]] | None) -> set[bytes]:
    """The hashes of the BlockStored events in messages ``[topic, seq, payload]``."""
    out: set[bytes] = set()
    for _topic, _seq, payload in messages or []:
        for ev in decode_batch(bytes.fromhex(payload)).events:
            if isinstance(ev, BlockStored):
                out.update(h for h in ev.block_hashes if isinstance(h, bytes))
    return out


def _topics(messages: list[list[str]]) -> set[bytes]:
    return {bytes.fromhex(m[0]) for m in messages}


def _all(tenant: str, ids: range) -> set[bytes]:
    return {h for i in ids for h in _blocks(tenant, i).hashes}


def _follow(consumer: EventConsumer, name: str, want: Callable[[set[Any]], bool]) -> None:
    def done() -> bool:
        consumer.poll(0.02)
        consumer.sync(name)
        with consumer.lock:
            return want(set(consumer.view(name).hashes("STORAGE", "LOCAL")))

    wait_until(done, f"the view of {name}")


def test_each_subscriber_reads_what_its_grant_allows_and_no_salt(sidecar: DevSidecar) -> None:
    eps = _endpoints(sidecar)
    for i in range(3):
        _save(sidecar, "acme", i)
        _save(sidecar, "beta", i)
    children = {uid: Child(uid, eps, ["acme", "beta"]) for uid in (NO_GRANT, GRANTED, READER)}
    for c in children.values():
        c.ready()
    # Live: one more chunk per tenant while they listen; the sidecar's own uid
    # (a reader, granted everything) sees both arrive on both kinds of stream.
    spec = SourceSpec("full", *eps, snapshots=True)
    with EventConsumer([spec], request_timeout_s=5, idle_check_s=0) as own:
        _save(sidecar, "acme", 10)
        _save(sidecar, "beta", 10)
        want = _all("acme", [0, 1, 2, 10]) | _all("beta", [0, 1, 2, 10])  # type: ignore[arg-type]
        _follow(own, "full", lambda held: held == want)
    got = {uid: c.result() for uid, c in children.items()}

    nothing = got[NO_GRANT]  # refused at the handshake: not even an end marker
    assert nothing["full_snapshot"] is None and nothing["full_replay"] is None
    assert nothing["snapshot:acme"] is None and nothing["snapshot:beta"] is None
    assert nothing["live"] == {"full": [], "tenants": []}

    acme = got[GRANTED]  # its tenant's channel, nothing else
    assert acme["full_snapshot"] == [] and acme["full_replay"] == []
    assert _hashes(acme["snapshot:acme"]) == _all("acme", range(3))
    assert acme["snapshot:beta"] == []
    assert acme["live"]["full"] == []
    assert _topics(acme["live"]["tenants"]) == {_topic_of(eps, sidecar, "acme")}
    assert _hashes(acme["live"]["tenants"]) == _all("acme", [10])  # type: ignore[arg-type]

    reader = got[READER]  # the full feed, every tenant; no channel (no grant)
    assert _hashes(reader["full_snapshot"]) == _all("acme", range(3)) | _all("beta", range(3))
    assert _hashes(reader["full_replay"]) == _all("acme", range(3)) | _all("beta", range(3))
    assert reader["snapshot:acme"] == [] and reader["snapshot:beta"] == []
    assert _hashes(reader["live"]["full"]) == _all("acme", [10]) | _all("beta", [10])  # type: ignore[arg-type]
    assert reader["live"]["tenants"] == []

    # The cache salt the connector sent with every save is in no message anyone got.
    salt = SALT.encode().hex()
    assert salt not in json.dumps(got)

    # The sidecar's own uid follows a tenant's channel with the reference consumer.
    topic = tenant_topic("acme").decode()
    chan = SourceSpec("acme", *eps, topic=topic, snapshots=True)
    with EventConsumer([chan], request_timeout_s=5, idle_check_s=0) as own:
        _follow(own, "acme", lambda held: held == _all("acme", [0, 1, 2, 10]))  # type: ignore[arg-type]
        _save(sidecar, "acme", 11)
        _save(sidecar, "beta", 11)
        _follow(own, "acme", lambda held: held == _all("acme", [0, 1, 2, 10, 11]))  # type: ignore[arg-type]


def _topic_of(eps: tuple[str, str], sc: DevSidecar, tenant: str) -> bytes:
    import socket

    return tenant_topic(tenant, f"kv@{socket.gethostname()}@kvoffload")


def test_a_reload_that_turns_events_off_withdraws_what_was_announced(
    sidecar: DevSidecar, policy: Path
) -> None:
    eps = _endpoints(sidecar)
    spec = SourceSpec("node", *eps, snapshots=True)
    with EventConsumer([spec], request_timeout_s=5, idle_check_s=0) as consumer:
        for i in range(5):
            _save(sidecar, "acme", i)
        _save(sidecar, "beta", 0)
        _follow(consumer, "node", lambda held: held == _all("acme", range(5)) | _all("beta", [0]))
        snapshots = consumer.status("node").recoveries["snapshot"]
        _policy(policy, acme_events=False)
        _reload(sidecar)
        # The live consumer is told: BlockRemoved for every chunk of acme, no resync.
        _follow(consumer, "node", lambda held: held == _all("beta", [0]))  # type: ignore[arg-type]
        assert consumer.status("node").recoveries["snapshot"] == snapshots
        # Saves of acme are not announced now, and its purge has nothing left to withdraw.
        _save(sidecar, "acme", 7)
        _save(sidecar, "beta", 1)
        _follow(consumer, "node", lambda held: held == _all("beta", range(2)))
        # Back on: what is saved from now on is announced again.
        _policy(policy, acme_events=True)
        _reload(sidecar)
        _save(sidecar, "acme", 8)
        _follow(consumer, "node", lambda held: held == _all("beta", range(2)) | _all("acme", [8]))  # type: ignore[arg-type]


def _generation(sc: DevSidecar) -> int:
    from kvoffload.client import fetch_stats

    return int(fetch_stats(sc.socket_path)["policy"]["generation"])


def _reload(sc: DevSidecar) -> None:
    """SIGHUP, and wait until the new policy is in force."""
    before = _generation(sc)
    os.kill(sc.proc.pid, signal.SIGHUP)
    wait_until(lambda: _generation(sc) > before, "the policy reloaded")


def test_a_start_withdraws_a_change_made_while_down_and_announces_itself(
    sidecar: DevSidecar, policy: Path
) -> None:
    eps = _endpoints(sidecar)
    spec = SourceSpec("node", *eps, snapshots=True)
    with EventConsumer([spec], request_timeout_s=5, idle_check_s=0) as consumer:
        for i in range(3):
            _save(sidecar, "acme", i)
        _save(sidecar, "beta", 0)
        _follow(consumer, "node", lambda held: held == _all("acme", range(3)) | _all("beta", [0]))
        before = consumer.status("node").incarnation
        assert before is not None
        os.kill(sidecar.proc.pid, signal.SIGKILL)
        sidecar.proc.wait()
        _policy(policy, acme_events=False)
        sidecar.proc.start().wait_ready()
        # Nothing is saved: the new incarnation's first batch alone tells the
        # consumer, which resyncs and no longer holds acme's hashes.
        _follow(consumer, "node", lambda held: held == _all("beta", [0]))  # type: ignore[arg-type]
        st = consumer.status("node")
        assert st.incarnation is not None and st.incarnation > before
        assert st.last_seq is not None and split_seq(st.last_seq)[1] >= 1


def test_a_reload_that_takes_a_grant_away_ends_that_peers_channel(
    sidecar: DevSidecar, policy: Path
) -> None:
    eps = _endpoints(sidecar)
    _save(sidecar, "acme", 1)
    child = Child(GRANTED, eps, ["acme"])
    child.ready()
    _policy(policy, granted=False)
    _reload(sidecar)
    _save(sidecar, "acme", 2)
    # The reader's view of the channel has chunk 2: it was published.
    chan = SourceSpec("acme", *eps, topic=tenant_topic("acme").decode(), snapshots=True)
    with EventConsumer([chan], request_timeout_s=5, idle_check_s=0) as own:
        _follow(own, "acme", lambda held: held == _all("acme", range(1, 3)))
    got = child.result()
    assert _hashes(got["snapshot:acme"]) == _all("acme", [1])  # granted then
    assert not _hashes(got["live"]["tenants"]) & _all("acme", [2])  # not any more


def _tail_as(sc: DevSidecar, uid: int, *args: str) -> tuple[int, str, str]:
    """``kvoffload events tail ARGS`` in a forked process under ``uid`` (in the socket
    group): (exit code, stdout, stderr). Forked, not exec'd: this interpreter's
    files need not be readable by that uid, and everything tail imports is
    imported here first."""
    import typer._adapters  # noqa: F401 - what typer imports to parse options, lazily
    import zmq.utils.monitor  # noqa: F401 - imported before the drop

    import kvoffload.cli
    import kvoffload.cli.events_cmds
    import kvoffload.events.access
    import kvoffload.sidecar.events

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 70
        try:
            # Not pytest's capture: the pipes, for the CLI's consoles too.
            sys.stdout = os.fdopen(out_w, "w")
            sys.stderr = os.fdopen(err_w, "w")
            os.chdir(sc.workdir)
            for k in [k for k in os.environ if k.startswith("KVOFFLOAD_")]:
                del os.environ[k]
            os.environ["KVOFFLOAD_SERVER_SOCKET"] = str(sc.socket_path)
            os.setgroups([GROUP])
            os.setgid(GROUP)
            os.setuid(uid)
            try:
                kvoffload.cli.main(["--dev", "events", "tail", *args])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with os.fdopen(out_r) as o, os.fdopen(err_r) as e:
        stdout, stderr = o.read(), e.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout, stderr


def test_events_tail_as_a_user_without_a_grant_is_one_line_and_with_one_its_channel(
    sidecar: DevSidecar,
) -> None:
    _save(sidecar, "acme", 1)
    _save(sidecar, "beta", 1)
    code, _out, err = _tail_as(sidecar, NO_GRANT, "--from", "0", "--count", "1", "--timeout", "5")
    assert code == 7, err
    assert "refused this user" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    args = ("--tenant", "acme", "--json", "--from", "0", "--timeout", "3")
    code, out, err = _tail_as(sidecar, GRANTED, *args)
    assert code == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert [bytes.fromhex(h) for r in recs for h in r["block_hashes"]] == list(
        _blocks("acme", 1).hashes
    )
