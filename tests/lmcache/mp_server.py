"""LMCache's real multi-process server as a process, and a worker that drives it.

The worker is LMCache's own: ``lmcache bench server``'s client
(``ServerBenchClient``) registers CPU KV caches over POSIX shared memory
(``lmcache_driven``, the path a GPU worker takes with CUDA IPC); stores,
lookups and retrieves go over LMCache's ZMQ request protocol with keys that
carry a ``cache_salt``, as vLLM's LMCache connector sends them. Only the LMCache
venv runs this (tests/lmcache is its tier).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHAPE = "(2,256,16,8,128):float16:4"  # 4 layers; 64 KiB per layer and 16-token block
TOKENS = 1024  # 4 chunks of 256 tokens: 4 MiB objects
PLUGIN = {
    "type": "plugin",
    "module_path": "kvoffload.integrations.lmcache.adapter",
    "class_name": "KVOffloadL2Adapter",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plugin_spec(**params: Any) -> str:
    return json.dumps({**PLUGIN, "adapter_params": params})


@dataclass
class MPServer:
    """``python -m lmcache.v1.multiprocess.server`` with the given ``--l2-adapter``s;
    L2 store policy ``skip_l1``: once in L2 a chunk leaves L1, so every later hit
    comes through the adapter."""

    workdir: Path
    l2_adapters: Sequence[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: Its metrics port: a free one, so that two servers can run at once.
    metrics_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"lmcache-{self.port}.log"

    def start(self) -> MPServer:
        argv = [sys.executable, "-m", "lmcache.v1.multiprocess.server",
                "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", "256",
                "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
                "--l2-store-policy", "skip_l1",
                "--prometheus-port", str(self.metrics_port)]  # fmt: skip
        for a in self.l2_adapters:
            argv += ["--l2-adapter", a]
        env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="INFO")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 180
        while "cache server is running..." not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(f"LMCache server exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"LMCache server not up in 180 s:\n{self.log()}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: its KeyboardInterrupt path closes the adapters
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Worker:
    """One simulated engine worker of LMCache's own bench client, with salted keys."""

    def __init__(self, url: str, instance_base: int = 1000) -> None:
        import lmcache.cli.commands.bench.server_bench.helpers as h
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        h._INSTANCE_ID_BASE = instance_base  # one registration per instance id and server
        self._h = h
        cfg = BenchConfig(
            rpc_url=url, http_url="", mode="cpu", transfer_mode="lmcache_driven", tp_size=1,
            use_mla=False, num_tokens=TOKENS, kvcache_shape_spec=SHAPE, num_blocks=256,
            block_size=16,
        )  # fmt: skip
        self.client = ServerBenchClient(cfg, log=lambda _m: None)
        self.client.start()
        self.worker = self.client._workers[0]
        self._n = 0

    @property
    def kv(self) -> dict[str, Any]:
        return self.worker.kv_caches

    def _key(self, seq: int, salt: str, start: int, end: int, rid: str = "") -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        self._n += 1
        self._last_rid = rid or f"r{self._n}"
        return IPCCacheServerKey(
            model_name=self._h._MODEL_NAME, world_size=1, num_kv_readers=1,
            worker_id=0, token_ids=self._h._build_token_ids(seq, TOKENS), start=start,
            end=end, request_id=self._last_rid, cache_salt=salt,
        )  # fmt: skip

    def blocks(self, seq: int) -> tuple[int, int]:
        """(first block, block count) of sequence ``seq``'s full chunks."""
        nb = TOKENS // 16
        return (seq * nb) % max(256 - nb, 1), nb

    def fill(self, seq: int, value_seed: int) -> dict[str, Any]:
        """Random KV in ``seq``'s blocks; returns a copy of those blocks per layer."""
        import torch

        b0, nb = self.blocks(seq)
        g = torch.Generator().manual_seed(value_seed)
        out = {}
        for name, t in self.kv.items():
            part = t[:, b0 : b0 + nb]
            part.copy_(torch.randn(part.shape, generator=g).to(t.dtype))
            out[name] = part.clone()
        return out

    def zero(self, seq: int) -> None:
        b0, nb = self.blocks(seq)
        for t in self.kv.values():
            t[:, b0 : b0 + nb].zero_()

    def equal(self, seq: int, ref: dict[str, Any]) -> bool:
        import torch

        b0, nb = self.blocks(seq)
        return all(torch.equal(t[:, b0 : b0 + nb], ref[n]) for n, t in self.kv.items())

    def _lookup(self, key: Any) -> int:
        req = self.client._req_client
        assert self._h._send_lookup(req, key), "LOOKUP timed out"
        return int(self._h._poll_prefetch_status(req, key.request_id, 400) or 0)

    def _submit(self, op: str, seq: int, key: Any) -> bool:
        b0, nb = self.blocks(seq)
        tc = self.worker.transfer_context
        ev = tc.create_recorded_event()
        ids = [list(range(b0, b0 + nb))]
        if op == "store":
            fut = tc.submit_store(key.request_id, key, self.kv, ids, ev, 16)
        else:
            fut = tc.submit_retrieve(key.request_id, key, self.kv, ids, ev, 16,
                                     skip_first_n_tokens=0)  # fmt: skip
        reply = self._h._wait_for_result(fut, retain_refs=(ev,))
        return reply is not self._h._TIMEOUT and bool(reply)

    def store(self, seq: int, salt: str = "") -> bool:
        """A cold request: lookup (a miss expected), then store its chunks, as vLLM does."""
        key = self._key(seq, salt, 0, TOKENS)
        self._lookup(key)
        ok = self._submit("store", seq, key)
        self._h._send_end_session(self.client._req_client, key.request_id)
        return ok

    def lookup(self, seq: int, salt: str = "") -> int:
        """The chunks LMCache reports as hits for ``seq`` (L2 prefetched into L1)."""
        key = self._key(seq, salt, 0, TOKENS)
        hit = self._lookup(key)
        self._h._send_end_session(self.client._req_client, key.request_id)
        return hit

    def fetch(self, seq: int, salt: str = "") -> tuple[int, bool]:
        """A warm request: lookup, then retrieve its hits into the KV cache."""
        key = self._key(seq, salt, 0, TOKENS)
        hit = self._lookup(key)
        ok = False
        if hit:
            rkey = self._key(seq, salt, 0, hit * 256, rid=key.request_id)
            ok = self._submit("retrieve", seq, rkey)
        self._h._send_end_session(self.client._req_client, key.request_id)
        return hit, ok

    def clear_l1(self) -> None:
        """Empty LMCache's L1 (its ``clear`` request): the next hit must come from L2."""
        fut = self.client._req_client.clear(False)
        assert self._h._wait_for_result(fut) is not self._h._TIMEOUT, "CLEAR timed out"

    def close(self) -> None:
        self.client.close()
