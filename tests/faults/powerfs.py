"""A FUSE file system that can lose power (the fault suite's power-loss family).

It keeps everything in memory and remembers, beside each file's bytes and each
directory's entries, what the last ``fsync`` made durable: a file's bytes at
its last fsync, a directory's entries at its last fsync. At power loss it
writes out only that durable state — files never fsync'd are empty, names
never fsync'd into their directory are gone, with whatever was below them —
which is what POSIX allows a device to keep. No syncfs: a plain FUSE mount is
never told of one, so ``batch`` durability is checked for safety only.

Speaks the kernel's FUSE protocol on ``/dev/fuse`` directly (no library):
one request at a time, no caching (entry and attribute timeouts 0).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

IN_HDR = struct.Struct("<IIQQIIIHH")
OUT_HDR = struct.Struct("<IiQ")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY = struct.Struct("<QQQQII")
MAX_WRITE = 1 << 17
MUTATING = {4, 8, 9, 10, 11, 12, 13, 16, 20, 30, 35, 43, 45}


@dataclass
class Node:
    ino: int
    mode: int
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""
    entries: dict[str, int] = field(default_factory=dict)
    durable_entries: dict[str, int] = field(default_factory=dict)
    nlink: int = 1
    mtime: float = field(default_factory=time.time)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class PowerFS:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {1: Node(1, stat.S_IFDIR | 0o755, nlink=2)}
        self.next_ino = 2
        self.mutations = 0

    # -- the durable state ----------------------------------------------------

    def dump(self, out: Path) -> None:
        """Write what survives a power loss under ``out``."""
        out.mkdir(parents=True, exist_ok=True)

        def walk(node: Node, where: Path) -> None:
            for name, ino in node.durable_entries.items():
                child = self.nodes.get(ino)
                if child is None:
                    continue
                p = where / name
                if child.is_dir:
                    p.mkdir(exist_ok=True)
                    os.chmod(p, child.mode & 0o7777)
                    walk(child, p)
                else:
                    p.write_bytes(child.durable)
                    os.chmod(p, child.mode & 0o7777)

        walk(self.nodes[1], out)

    # -- helpers ----------------------------------------------------------------

    def attr(self, n: Node) -> bytes:
        size = len(n.data) if not n.is_dir else 4096
        t = int(n.mtime)
        return ATTR.pack(
            n.ino, size, (size + 511) // 512, t, t, t, 0, 0, 0, n.mode, n.nlink, 0, 0, 0, 4096, 0
        )

    def entry(self, n: Node) -> bytes:
        return ENTRY.pack(n.ino, 0, 0, 0, 0, 0) + self.attr(n)

    def new(self, mode: int) -> Node:
        n = Node(self.next_ino, mode, nlink=2 if stat.S_ISDIR(mode) else 1)
        self.nodes[n.ino] = n
        self.next_ino += 1
        return n

    def unlink(self, parent: Node, name: str) -> None:
        ino = parent.entries.pop(name)
        n = self.nodes[ino]
        n.nlink -= 1  # the inode stays while the durable tree may name it

    # -- requests ----------------------------------------------------------------

    def handle(self, op: int, nodeid: int, body: bytes) -> bytes | int | None:
        n = self.nodes.get(nodeid)
        if op == 26:  # INIT
            _major, _minor, readahead, _flags = struct.unpack_from("<IIII", body)
            return struct.pack(
                "<IIIIHHIIHHIIH22x", 7, 31, readahead, 0, 16, 12, MAX_WRITE, 1, 32, 0, 0, 0, 0
            )
        if n is None:
            return -errno.ENOENT
        if op == 1:  # LOOKUP
            name = body.split(b"\0")[0].decode()
            ino = n.entries.get(name)
            return -errno.ENOENT if ino is None else self.entry(self.nodes[ino])
        if op in (2, 42):  # FORGET, BATCH_FORGET
            return None
        if op == 3:  # GETATTR
            return struct.pack("<QII", 0, 0, 0) + self.attr(n)
        if op == 4:  # SETATTR
            valid = struct.unpack_from("<I", body)[0]
            size = struct.unpack_from("<Q", body, 16)[0]
            mode = struct.unpack_from("<I", body, 68)[0]
            if valid & 8:  # size
                del n.data[size:]
                n.data.extend(bytes(size - len(n.data)))
            if valid & 1:
                n.mode = (n.mode & ~0o7777) | (mode & 0o7777)
            n.mtime = time.time()
            return struct.pack("<QII", 0, 0, 0) + self.attr(n)
        if op == 9:  # MKDIR
            mode, umask = struct.unpack_from("<II", body)
            name = body[8:].split(b"\0")[0].decode()
            if name in n.entries:
                return -errno.EEXIST
            c = self.new(stat.S_IFDIR | (mode & ~umask & 0o7777))
            n.entries[name] = c.ino
            return self.entry(c)
        if op in (35, 8):  # CREATE, MKNOD
            if op == 35:
                _flags, mode, umask, _of = struct.unpack_from("<IIII", body)
                name = body[16:].split(b"\0")[0].decode()
            else:
                mode, _rdev, umask, _p = struct.unpack_from("<IIII", body)
                name = body[16:].split(b"\0")[0].decode()
            if name in n.entries:
                return -errno.EEXIST
            c = self.new(stat.S_IFREG | (mode & ~umask & 0o7777))
            n.entries[name] = c.ino
            return self.entry(c) + (struct.pack("<QIi", 0, 0, 0) if op == 35 else b"")
        if op in (10, 11):  # UNLINK, RMDIR
            name = body.split(b"\0")[0].decode()
            if name not in n.entries:
                return -errno.ENOENT
            if op == 11 and self.nodes[n.entries[name]].entries:
                return -errno.ENOTEMPTY
            self.unlink(n, name)
            return b""
        if op in (12, 45):  # RENAME, RENAME2
            newdir = struct.unpack_from("<Q", body)[0]
            rest = body[8 if op == 12 else 16 :]
            old, new = (x.decode() for x in rest.split(b"\0")[:2])
            flags = struct.unpack_from("<I", body, 8)[0] if op == 45 else 0
            dst = self.nodes[newdir]
            if old not in n.entries:
                return -errno.ENOENT
            if flags & 1 and new in dst.entries:  # RENAME_NOREPLACE
                return -errno.EEXIST
            if new in dst.entries:
                self.unlink(dst, new)
            dst.entries[new] = n.entries.pop(old)
            return b""
        if op == 13:  # LINK
            old = self.nodes[struct.unpack_from("<Q", body)[0]]
            name = body[8:].split(b"\0")[0].decode()
            if name in n.entries:
                return -errno.EEXIST
            n.entries[name] = old.ino
            old.nlink += 1
            return self.entry(old)
        if op in (14, 27):  # OPEN, OPENDIR
            return struct.pack("<QIi", 0, 0, 0)
        if op == 15:  # READ
            _fh, off, size = struct.unpack_from("<QQI", body)
            return bytes(n.data[off : off + size])
        if op == 16:  # WRITE
            _fh, off, size = struct.unpack_from("<QQI", body)
            data = body[40 : 40 + size]
            if len(n.data) < off:
                n.data.extend(bytes(off - len(n.data)))
            n.data[off : off + len(data)] = data
            n.mtime = time.time()
            return struct.pack("<II", len(data), 0)
        if op == 43:  # FALLOCATE
            _fh, off, length, _mode = struct.unpack_from("<QQQI", body)
            if len(n.data) < off + length:
                n.data.extend(bytes(off + length - len(n.data)))
            return b""
        if op == 20:  # FSYNC
            n.durable = bytes(n.data)
            return b""
        if op == 30:  # FSYNCDIR
            n.durable_entries = dict(n.entries)
            return b""
        if op in (18, 29, 25, 34):  # RELEASE, RELEASEDIR, FLUSH, ACCESS
            return b""
        if op == 17:  # STATFS
            return struct.pack(
                "<QQQQQIIII24x", 1 << 20, 1 << 19, 1 << 19, 1 << 20, 1 << 19, 4096, 255, 4096, 0
            )
        if op == 28:  # READDIR
            _fh, off, size = struct.unpack_from("<QQI", body)
            names = [(".", n.ino), ("..", 1), *n.entries.items()]
            out = b""
            for i in range(off, len(names)):
                name, ino = names[i]
                raw = name.encode()
                kind = (self.nodes[ino].mode >> 12) if ino in self.nodes else 0
                ent = struct.pack("<QQII", ino, i + 1, len(raw), kind) + raw
                ent += bytes(-len(ent) % 8)
                if len(out) + len(ent) > size:
                    break
                out += ent
            return out
        return -errno.ENOSYS


def serve(fd: int, cut_after: int, out: Path) -> None:
    """Serve until the ``cut_after``-th mutating request (or SIGUSR1): then lose
    power (write the durable state to ``out``) and stop answering."""
    fs = PowerFS()
    cut = False

    def on_usr1(_sig: int, _frame: object) -> None:
        nonlocal cut
        cut = True

    signal.signal(signal.SIGUSR1, on_usr1)
    while not cut:
        try:
            req = os.read(fd, MAX_WRITE + 8192)
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR):  # an interrupted request
                continue
            break  # ENODEV: unmounted
        length, op, unique, nodeid, *_ = IN_HDR.unpack_from(req)
        body = req[IN_HDR.size : length]
        if op in MUTATING:
            fs.mutations += 1
            if fs.mutations >= cut_after:
                break  # the power goes before this request is done
        try:
            res = fs.handle(op, nodeid, body)
        except Exception:
            res = -errno.EIO
        if res is None:
            continue
        if isinstance(res, int):
            msg = OUT_HDR.pack(OUT_HDR.size, res, unique)
        else:
            msg = OUT_HDR.pack(OUT_HDR.size + len(res), 0, unique) + res
        with contextlib.suppress(OSError):  # the request was interrupted meanwhile
            os.write(fd, msg)
    fs.dump(out)
