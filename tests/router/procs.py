"""Real processes for the router tests: stand-in workers and ``kvoffload router`` itself."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    e["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Worker:
    """A stand-in worker process (tests/router/standin_worker.py)."""

    def __init__(
        self,
        name: str,
        module: str = "tests.router.standin_worker",
        args: tuple[str, ...] = (),
        start_timeout_s: float = 30,
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--name", name, *args],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line.strip():
            self.stop()
            raise RuntimeError(f"stand-in worker {name} did not start")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"

    def control(self, **settings: Any) -> None:
        status, _, _ = request(self.port, "POST", "/_control", settings)
        assert status == 200

    def received(self) -> list[dict[str, Any]]:
        _, _, body = request(self.port, "GET", "/_requests")
        got: list[dict[str, Any]] = json.loads(body)
        return got

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def request(
    port: int,
    method: str,
    path: str,
    body: object = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class RouterProc:
    def __init__(self, config: Path, log: Path) -> None:
        self.port = free_port()
        self._log = log.open("wb")
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvoffload.cli",
                "--config",
                str(config),
                "router",
                "--port",
                str(self.port),
            ],
            cwd=ROOT,
            env=env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, _ = request(self.port, "GET", "/health")
                if status in (200, 503):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router did not start: {log.read_text()}")
            time.sleep(0.1)

    def post(self, path: str, body: object, **headers: str) -> tuple[int, dict[str, str], bytes]:
        return request(self.port, "POST", path, body, headers)

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return request(self.port, "GET", path)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def write_config(path: Path, workers: list[Worker], extra: str = "", **router: str) -> Path:
    settings = {"health_interval": '"0.2s"', "metrics_interval": '"0.2s"', **router}
    lines = ["[router]"] + [f"{k} = {v}" for k, v in settings.items()]
    for w in workers:
        lines += ["[[workers]]", f'name = "{w.name}"', f'url = "{w.url}"', f'node = "n-{w.name}"']
    path.write_text("\n".join(lines) + "\n" + extra, encoding="utf-8")
    return path


@contextmanager
def cluster(
    tmp: Path, n: int = 2, extra: str = "", **router: str
) -> Iterator[tuple[RouterProc, list[Worker]]]:
    workers: list[Worker] = []
    proc: RouterProc | None = None
    try:
        for i in range(n):
            workers.append(Worker(f"w{i}"))
        cfg = write_config(tmp / "router.toml", workers, extra, **router)
        proc = RouterProc(cfg, tmp / "router.log")
        yield proc, workers
    finally:
        if proc is not None:
            proc.stop()
        for w in workers:
            w.stop()
