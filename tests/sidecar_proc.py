"""Run the sidecar daemon and its clients as real processes (for test_sidecar_process.py).

Imported by the tests, this module starts processes and waits for them.
Run as a script (``python sidecar_proc.py COMMAND JSON``), it *is* a client
process: it talks to the sidecar with ``SidecarClient`` (or raw frames) and
prints one JSON object per line on stdout.

Chunk contents are a pure function of (tenant, seed, index, size class), so
a process that saves and another that loads agree on the expected bytes
without exchanging any. Contents depend on the tenant, keys do not: the same
key in two tenants holds different data, which catches a tenant mix-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvoffload.errors import SidecarStartError
from kvoffload.testing import SidecarProcess, cli_argv

HERE = Path(__file__).resolve()
PAGE = 4096
NS = hashlib.sha256(b"kvoffload process tests: namespace").digest()
#: Largest layer of each size class; no layer size is a multiple of PAGE.
SIZES = {"small": 24_000, "big": 300_000}
READY_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------
# Deterministic data


def chunk_key(seed: str, i: int) -> bytes:
    return hashlib.sha256(f"kvo-key/{seed}/{i}".encode()).digest()


def chunk_layers(tenant: str, seed: str, i: int, size: str = "small") -> list[bytes]:
    r = random.Random(f"kvo-shape/{seed}/{i}/{size}")
    sizes = []
    for _ in range(2 + r.randrange(4)):  # 2..5 layers
        n = r.randrange(100, SIZES[size])
        sizes.append(n + 1 if n % PAGE == 0 else n)
    return [
        random.Random(f"kvo-data/{tenant}/{seed}/{i}/{layer}").randbytes(n)
        for layer, n in enumerate(sizes)
    ]


def object_relpath(tenant: str, key: bytes) -> str:
    from kvoffload.layouts import v1

    return v1.object_relpath(tenant, key)


# ---------------------------------------------------------------------------
# Parent side: processes


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without anything that would configure the sidecar."""
    from kvoffload.testing import sidecar_env

    return sidecar_env({"PYTHONDONTWRITEBYTECODE": "1", **(extra or {})})


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition (synchronisation, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


class Sidecar(SidecarProcess):
    """One ``kvoffload serve`` process (:class:`kvoffload.testing.SidecarProcess`), its
    output in ``workdir/<log_name>.log``; failures to start or stop are test failures."""

    def __init__(
        self,
        workdir: Path,
        socket_path: Path,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
        log_name: str = "sidecar",
        log_path: Path | None = None,
        tie_to_parent: bool = False,
    ) -> None:
        super().__init__(
            workdir,
            socket_path,
            argv,
            env={"PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
            pass_fds=pass_fds,
            log_path=log_path or workdir / f"{log_name}.log",
            tie_to_parent=tie_to_parent,
        )

    @classmethod
    def serve_argv(cls, *args: str) -> list[str]:
        return cli_argv(*args)

    def start(self) -> Sidecar:
        super().start()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll the socket until the daemon answers ``stats`` (bounded)."""
        try:
            return super().wait_ready(timeout_s)
        except SidecarStartError as exc:
            raise AssertionError(f"sidecar not ready: {exc}") from None

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return super().wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"sidecar still running after {timeout_s:.0f} s:\n{self.log_text()}"
            ) from None

    def wait_idle(self, what: str = "connections closed and nothing reserved") -> dict[str, Any]:
        """Until only our stats connection is open and no store space is reserved."""
        last: dict[str, Any] = {}

        def idle() -> bool:
            last.update(self.stats())
            return bool(last["server"]["connections"] == 1 and last["reserved_bytes"] == 0)

        wait_until(idle, what)
        return last


class Child:
    """A client process running this module; its stdout JSON lines are read by a thread."""

    def __init__(
        self,
        command: str,
        args: dict[str, Any],
        *,
        user: int | None = None,
        group: int | None = None,
        stdin: bool = False,
        script: Path = HERE,
    ) -> None:
        if user is not None:
            # The interpreter may live where other uids cannot exec it (under
            # /root): start as root, import, then drop to the uid (see main()).
            args = {**args, "as_user": [user, user if group is None else group]}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), command, json.dumps(args)],
            cwd="/",
            env=clean_env(),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._stderr: list[bytes] = []
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at EOF: no ResourceWarning
            for line in self.proc.stdout:
                with contextlib.suppress(ValueError):
                    self.messages.put(json.loads(line))
        self.messages.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self._stderr.append(line)

    def _close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def next(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """The next JSON line; None once stdout is closed."""
        try:
            msg = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"child {self.pid} said nothing for {timeout_s:.0f} s; stderr:\n{self.stderr}"
            ) from None
        if msg is None:
            self.messages.put(None)  # stay at EOF
        else:
            self.seen.append(msg)
        return msg

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.next(max(0.1, deadline - time.monotonic()))
            if msg is None:
                raise AssertionError(f"child {self.pid} exited first; stderr:\n{self.stderr}")
            if pred(msg):
                return msg
            if time.monotonic() > deadline:
                raise AssertionError(f"child {self.pid}: awaited message never came")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout_s: float = 90.0) -> list[dict[str, Any]]:
        """Wait for exit 0 and return every JSON line it printed."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"child {self.pid} still running; stderr:\n{self.stderr}"
            ) from None
        self._close_stdin()
        for t in self._threads:
            t.join(10)
        while self.next(5) is not None:
            pass
        assert rc == 0, f"child {self.pid} exited {rc}; stderr:\n{self.stderr}"
        return self.seen

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        self._close_stdin()
        for t in self._threads:
            t.join(10)
        while self.next(5) is not None:
            pass


@dataclasses.dataclass(frozen=True)
class DevSidecar:
    """A ``kvoffload --dev serve`` process in ``workdir`` (embedded store under
    ``workdir/.kvoffload``); see :func:`dev_sidecar`."""

    proc: Sidecar

    @property
    def workdir(self) -> Path:
        return self.proc.workdir

    @property
    def socket_path(self) -> Path:
        return self.proc.socket_path

    @property
    def store_root(self) -> Path:
        return self.workdir / ".kvoffload" / "store"

    def objects(self, tenant: str) -> list[Path]:
        """The tenant's chunk objects on disk (docs/spec/layout-v1.md §2)."""
        from kvoffload.layouts import v1

        return sorted((self.store_root / "objects" / tenant).rglob(f"*{v1.OBJECT_SUFFIX}"))

    def object_path(self, tenant: str, key: bytes) -> Path:
        return self.store_root / object_relpath(tenant, key)

    def tmp_files(self) -> list[Path]:
        """Writers' temporary files anywhere under objects/."""
        from kvoffload.layouts import v1

        return sorted((self.store_root / "objects").rglob(f"{v1.TMP_PREFIX}*"))

    def stats(self) -> dict[str, Any]:
        return self.proc.stats()

    def salt(self, tenant: str) -> bytes:
        from kvoffload.client import SidecarClient

        with SidecarClient(self.socket_path, tenant, staging_bytes=1 << 20) as c:
            salt = c.salt
        assert salt is not None, "sidecar unreachable"
        return salt

    def keys(self, contract: Mapping[str, Any], tokens: Sequence[int]) -> list[bytes]:
        """Chunk keys of ``tokens`` under a recorded contract, derived independently
        of the connector (the library's ``chunk_keys``, no extra keys)."""
        from kvoffload.contract import CompatContract
        from kvoffload.keys import chunk_keys

        c = CompatContract.from_dict(contract)
        return chunk_keys(c, self.salt(c.tenant_namespace), tokens)

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        from kvoffload.client import SidecarClient

        with SidecarClient(self.socket_path, tenant, staging_bytes=1 << 20) as c:
            return c.lookup(keys)

    def load_ok(self, tenant: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether each chunk loads (the sidecar verifies every byte before it says so)."""
        from kvoffload.client import SidecarClient

        with SidecarClient(self.socket_path, tenant, staging_bytes=4 << 20) as c:
            return [r.ok for r in c.load(keys)]


@contextlib.contextmanager
def dev_sidecar(env: Mapping[str, str] | None = None) -> Iterator[DevSidecar]:
    """Start a dev sidecar in a short /tmp folder (AF_UNIX paths are limited to
    107 bytes) with :func:`kvoffload.testing.dev_sidecar`; stop it (SIGTERM, then
    SIGKILL) and remove the folder after."""
    from kvoffload import testing

    workdir = Path(tempfile.mkdtemp(prefix="kvo-e2e-", dir="/tmp"))
    try:
        with testing.dev_sidecar(
            workdir,
            env=dict(env or {}),
            log_path=workdir / "sidecar.log",
            process_class=Sidecar,
        ) as running:
            assert isinstance(running.process, Sidecar)
            yield DevSidecar(running.process)
    except SidecarStartError as exc:
        raise AssertionError(f"dev sidecar did not start: {exc}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclasses.dataclass
class SharedNode:
    """One node's sidecar on a store root shared with other nodes (``[store]
    shared``): its own index, socket and config under ``workdir``."""

    name: str
    workdir: Path
    config: Path
    proc: Sidecar | None = None

    @property
    def socket_path(self) -> Path:
        return self.workdir / "kvo.sock"

    def start(self) -> None:
        self.proc = Sidecar(
            self.workdir,
            self.socket_path,
            Sidecar.serve_argv("--config", str(self.config), "serve"),
        )
        self.proc.start().wait_ready()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def stats(self) -> dict[str, Any]:
        assert self.proc is not None
        return self.proc.stats()


@contextlib.contextmanager
def shared_root_sidecars(
    base: Path, roots: Sequence[Path], *, journal_poll: str = "100ms"
) -> Iterator[list[SharedNode]]:
    """One sidecar per root path (the same root, through one client per node or
    one directory), all ``shared = true``, one KEK, a policy granting this uid
    every tenant. ``base`` must be short (socket paths); started in order."""
    kek = base / "kek"
    kek.write_bytes(os.urandom(32))
    kek.chmod(0o600)
    policy = base / "policy.toml"
    policy.write_text(f'version = 1\n\n[[grants]]\nuid = {os.getuid()}\ntenants = ["*"]\n')
    nodes: list[SharedNode] = []
    try:
        for i, root in enumerate(roots):
            name = chr(ord("a") + i)
            wd = base / name
            wd.mkdir()
            cfg = wd / "kvoffload.toml"
            cfg.write_text(
                f'[store]\nroot = "{root}"\nindex_dir = "{wd}/index"\ndurability = "batch"\n'
                f'shared = true\njournal_poll = "{journal_poll}"\n\n'
                f'[server]\nsocket = "{wd}/kvo.sock"\n\n'
                f'[security]\nkek_file = "{kek}"\npolicy = "{policy}"\n'
            )
            node = SharedNode(name, wd, cfg)
            nodes.append(node)
            node.start()
        yield nodes
    finally:
        for n in nodes:
            with contextlib.suppress(Exception):
                n.stop()


class Procs:
    """Every process a test starts; the fixture kills what is still running."""

    def __init__(self) -> None:
        self.sidecars: list[Sidecar] = []
        self.children: list[Child] = []

    def sidecar(self, *args: Any, **kwargs: Any) -> Sidecar:
        s = Sidecar(*args, **kwargs)
        self.sidecars.append(s)
        return s

    def child(self, command: str, args: dict[str, Any], **kwargs: Any) -> Child:
        c = Child(command, args, **kwargs)
        self.children.append(c)
        return c

    def steps(self, socket_path: Path, steps: list[dict[str, Any]], **kwargs: Any) -> list[Any]:
        """Run client steps in a fresh process; each step's value, warnings in ``.warnings``."""
        c = self.child("steps", {"socket": str(socket_path), "steps": steps}, **kwargs)
        out = c.finish()
        assert len(out) == 1, out
        return list(out[0]["results"])

    def close(self) -> None:
        for c in self.children:
            c.kill()
        for s in self.sidecars:
            s.kill()


# ---------------------------------------------------------------------------
# Child side


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _capture() -> Iterator[_Captured]:
    h = _Captured()
    root = logging.getLogger()
    root.addHandler(h)
    try:
        yield h
    finally:
        root.removeHandler(h)


def _client(socket_path: str, tenant: str, staging: int = 1 << 20, direct: bool = False) -> Any:
    from kvoffload.client import SidecarClient

    return SidecarClient(socket_path, tenant, staging_bytes=staging, timeout_s=30, direct=direct)


def _classify(
    tenant: str, seed: str, idx: Sequence[int], got: Sequence[Any], size: str
) -> list[str]:
    out = []
    for i, g in zip(idx, got, strict=True):
        if not g.ok:
            out.append("miss")
        elif [bytes(v) for v in g.layers] == chunk_layers(tenant, seed, i, size):
            out.append("ok")
        else:
            out.append("bad")
    return out


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=repr) + "\n")
    sys.stdout.flush()


def cmd_steps(a: dict[str, Any]) -> None:
    """Each step on a fresh connection: salt, save, load, lookup, stats."""
    from kvoffload.client import fetch_stats

    sock = a["socket"]
    results = []
    for st in a["steps"]:
        op = st["op"]
        value: Any = None
        with _capture() as cap:
            if op == "stats":
                value = fetch_stats(sock)
            else:
                tenant, seed = st["tenant"], st.get("seed", "")
                size = st.get("size", "small")
                idx = st.get("indices", [])
                keys = [chunk_key(seed, i) for i in idx]
                with _client(sock, tenant, direct=st.get("direct", False)) as c:
                    if op == "uses_direct":
                        value = c.uses_direct()
                    elif op == "salt":
                        salt = c.salt
                        value = None if salt is None else salt.hex()
                    elif op == "save":
                        chunks = [
                            (k, chunk_layers(tenant, seed, i, size))
                            for k, i in zip(keys, idx, strict=True)
                        ]
                        value = c.save(NS, chunks)
                    elif op == "load":
                        value = _classify(tenant, seed, idx, c.load(keys), size)
                    elif op == "lookup":
                        value = c.lookup(keys)
                    else:
                        raise ValueError(op)
        results.append({"op": op, "value": value, "warnings": cap.messages})
    _emit({"results": results})


def cmd_try_open(a: dict[str, Any]) -> None:
    """Try to open each path for reading and for writing; print the errno names (or "ok")."""
    import errno

    out = {}
    for path in a["paths"]:
        res = []
        for flags in (os.O_RDONLY, os.O_WRONLY):
            try:
                os.close(os.open(path, flags))
                res.append("ok")
            except OSError as exc:
                res.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
        out[path] = res
    _emit(out)


def cmd_stream(a: dict[str, Any]) -> None:
    """Save batches of chunks one after the other until a save fails or ``count`` are done."""
    tenant, seed, batch, size = a["tenant"], a["seed"], a["batch"], a.get("size", "small")
    with _client(a["socket"], tenant, a.get("staging", 1 << 20)) as c:
        i = 0
        while i < a.get("count", 1 << 30):
            idx = list(range(i, i + batch))
            _emit({"start": idx})
            chunks = [(chunk_key(seed, j), chunk_layers(tenant, seed, j, size)) for j in idx]
            res = c.save(NS, chunks)
            if not all(res):
                _emit({"fail": idx, "res": res})
                return
            _emit({"ok": idx})
            i += batch


def _raw_caller(socket_path: str) -> Callable[..., Any]:
    """``call(request, fds=())``: one request, its reply, on a bare protocol connection."""
    from kvoffload import protocol as p
    from kvoffload.transport import UnixTransport

    t = UnixTransport.connect(socket_path, timeout_s=30)
    next_id = 1

    def call(req: p.Request, fds: Sequence[int] = ()) -> p.Reply:
        nonlocal next_id
        rid, next_id = next_id, next_id + 1
        t.send(p.request_message(rid, req), fds)
        got, reply = p.parse_reply(t.recv().msg)
        assert got == rid, (got, rid)
        return reply

    return call


def cmd_raw(a: dict[str, Any]) -> None:
    """prepare_store by hand, fill the regions, then wait for orders on stdin."""
    from kvoffload import protocol as p
    from kvoffload.staging import StagingBuffer

    tenant, seed, idx = a["tenant"], a["seed"], a["indices"]
    call = _raw_caller(a["socket"])

    hello = call(p.Hello(1, 1, "raw-client", (tenant,)))
    assert isinstance(hello, p.HelloReply), hello
    buf = StagingBuffer(a.get("staging", 1 << 20))
    assert call(p.RegisterStaging(buf.size), [buf.fd]) == p.Ack(p.Op.REGISTER_STAGING)
    data = [chunk_layers(tenant, seed, i) for i in idx]
    specs = tuple(
        p.ChunkSpec(chunk_key(seed, i), tuple(len(x) for x in layers))
        for i, layers in zip(idx, data, strict=True)
    )
    prep = call(p.PrepareStore(tenant, NS, specs))
    assert isinstance(prep, p.PrepareStoreReply), prep
    for slot, layers in zip(prep.chunks, data, strict=True):
        if slot.status is p.StoreStatus.WRITE:
            packed = b"".join(layers)
            buf.view[slot.offset : slot.offset + len(packed)] = packed
    _emit({"handle": prep.handle, "statuses": [s.status.value for s in prep.chunks]})
    for line in sys.stdin:
        order = line.strip()
        if order == "complete":
            reply = call(p.CompleteStore(prep.handle))
            if isinstance(reply, p.ErrorReply):
                _emit({"code": int(reply.code)})
            else:
                assert isinstance(reply, p.CompleteStoreReply), reply
                _emit({"code": 0, "stored": list(reply.stored)})
        elif order == "exit":
            break


def cmd_lease(a: dict[str, Any]) -> None:
    """lease_store by hand, write what ``fill`` says, then wait for orders on stdin.

    ``fill``: "good" (the real object), "zeros" (nothing written), "flip" (the
    real object with one layer byte flipped), "wrongkey" (a valid object of
    another key), "truncate" / "extend" (the real object, then the file
    resized). Orders: "complete" (prints ``stored``), "abort", "exit".
    """
    from kvoffload import protocol as p
    from kvoffload.client import direct
    from kvoffload.layouts import v1

    tenant, seed, idx, fill = a["tenant"], a["seed"], a["indices"], a.get("fill", "good")
    call = _raw_caller(a["socket"])

    hello = call(p.Hello(1, 1, "lease-client", (tenant,)))
    assert isinstance(hello, p.HelloReply), hello
    if a.get("mode") == "load":
        got = call(p.LeaseLoad(tenant, tuple(chunk_key(seed, i) for i in idx)))
        if isinstance(got, p.ErrorReply):
            _emit({"code": int(got.code), "message": got.message})
            return
        assert isinstance(got, p.LeaseLoadReply), got
        _emit({"handle": got.handle, "found": got.found, "stop": got.stop.name})
        for line in sys.stdin:
            if line.strip() == "complete":
                done = call(p.CompleteLoad(got.handle))
                _emit({"code": int(getattr(done, "code", 0))})
            elif line.strip() == "exit":
                break
        return
    data = [chunk_layers(tenant, seed, i) for i in idx]
    specs = tuple(
        p.ChunkSpec(chunk_key(seed, i), tuple(len(x) for x in layers))
        for i, layers in zip(idx, data, strict=True)
    )
    prep = call(p.LeaseStore(tenant, NS, specs))
    if isinstance(prep, p.ErrorReply):
        _emit({"code": int(prep.code), "message": prep.message})
        return
    assert isinstance(prep, p.LeaseStoreReply), prep
    io = direct.PosixDirectIO()
    for slot, spec, layers in zip(prep.chunks, specs, data, strict=True):
        if slot.status is not p.StoreStatus.WRITE or fill == "zeros":
            continue
        key = spec.key if fill != "wrongkey" else bytes(32)
        header = v1.plain_header_block(
            tenant=tenant,
            namespace=NS,
            chunk_key=key,
            lengths=spec.layers,
            checks=direct.checks_of(layers),
        )
        if fill == "flip":
            layers = [bytes([layers[0][0] ^ 1]) + layers[0][1:], *layers[1:]]
        io.write_object(slot.path, header, layers, slot.offsets)
        if fill in ("truncate", "extend"):
            with open(slot.path, "r+b") as f:
                f.truncate(slot.size - 4096 if fill == "truncate" else slot.size + 4096)
    _emit(
        {
            "handle": prep.handle,
            "statuses": [s.status.value for s in prep.chunks],
            "paths": [s.path for s in prep.chunks],
        }
    )
    for line in sys.stdin:
        order = line.strip()
        if order == "complete":
            reply = call(p.CompleteStore(prep.handle))
            if isinstance(reply, p.ErrorReply):
                _emit({"code": int(reply.code)})
            else:
                assert isinstance(reply, p.CompleteStoreReply), reply
                _emit({"code": 0, "stored": list(reply.stored)})
        elif order == "abort":
            _emit({"code": int(getattr(call(p.Abort(prep.handle)), "code", 0))})
        elif order == "exit":
            break


MIXED_OPS = ("save_shared", "save_own", "load_shared", "load_own", "lookup", "touch")


def cmd_mixed(a: dict[str, Any]) -> None:
    """Random saves, loads and lookups on keys shared by every worker and on its own."""
    tenant, w, shared = a["tenant"], a["worker"], a["shared"]
    rng = random.Random(f"mixed/{w}")
    own_seed = f"own-{w}"
    counts: Counter[str] = Counter()
    saved_shared: set[int] = set()
    saved_own: list[int] = []

    def lay(seed: str, i: int) -> list[bytes]:
        return chunk_layers(tenant, seed, i)

    def leading(idx: Sequence[int]) -> int:
        n = 0
        while n < len(idx) and idx[n] in saved_shared:
            n += 1
        return n

    def check_load(seed: str, idx: Sequence[int], must: int) -> None:
        got = c.load([chunk_key(seed, i) for i in idx])
        verdicts = _classify(tenant, seed, idx, got, "small")
        n_ok = 0
        while n_ok < len(verdicts) and verdicts[n_ok] != "miss":
            n_ok += 1
        counts["not_prefix"] += sum(v != "miss" for v in verdicts[n_ok:])
        counts["bad"] += verdicts.count("bad")
        counts["hit"] += verdicts.count("ok")
        counts["miss"] += verdicts.count("miss")
        counts["lost"] += n_ok < must

    with _client(a["socket"], tenant, staging=256 << 10) as c, _capture() as cap:
        for _ in range(a["rounds"]):
            op = rng.choice(MIXED_OPS)
            counts[op] += 1
            if op == "save_shared":
                idx = rng.sample(range(shared), rng.randint(1, 4))
                res = c.save(NS, [(chunk_key("shared", i), lay("shared", i)) for i in idx])
                counts["save_failed"] += not all(res)
                saved_shared.update(i for i, ok in zip(idx, res, strict=True) if ok)
            elif op == "save_own":
                idx = list(range(len(saved_own), len(saved_own) + rng.randint(1, 3)))
                res = c.save(NS, [(chunk_key(own_seed, i), lay(own_seed, i)) for i in idx])
                counts["save_failed"] += not all(res)
                saved_own.extend(i for i, ok in zip(idx, res, strict=True) if ok)
            elif op == "load_shared":
                idx = rng.sample(range(shared), rng.randint(1, 5))
                check_load("shared", idx, leading(idx))
            elif op == "load_own":
                idx = rng.sample(saved_own, min(len(saved_own), 4)) if saved_own else [10_000]
                check_load(own_seed, idx, len(idx) if saved_own else 0)
            elif op == "lookup":
                own_keys = [chunk_key(own_seed, i) for i in saved_own] or [chunk_key("x", 0)]
                counts["lookup_short"] += c.lookup(own_keys) != len(saved_own)
                idx = rng.sample(range(shared), 6)
                counts["lookup_short"] += c.lookup([chunk_key("shared", i) for i in idx]) < leading(
                    idx
                )
            else:
                c.touch([chunk_key("shared", i) for i in rng.sample(range(shared), 3)])
        warnings = cap.messages
    _emit(
        {
            "counts": dict(counts),
            "shared": sorted(saved_shared),
            "own": len(saved_own),
            "warnings": warnings,
        }
    )


COMMANDS = {
    "steps": cmd_steps,
    "stream": cmd_stream,
    "raw": cmd_raw,
    "lease": cmd_lease,
    "try_open": cmd_try_open,
    "mixed": cmd_mixed,
}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = json.loads(sys.argv[2])
    if "as_user" in args:
        import kvoffload.client
        import kvoffload.gpu_probe  # noqa: F401 - everything is imported before the drop

        uid, gid = args["as_user"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        assert (os.getuid(), os.geteuid(), os.getgid(), os.getgroups()) == (uid, uid, gid, [])
    COMMANDS[sys.argv[1]](args)


if __name__ == "__main__":
    main()
