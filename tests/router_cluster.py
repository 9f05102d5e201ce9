"""Test helper (not a test): real `deepserve worker` and `deepserve frontend` processes on loopback.

Each process runs in its own session with its log in a temporary file (printed when it fails to
come up), can be SIGKILLed and restarted on the same port, and is always stopped at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLI = [sys.executable, "-m", "deepserve.server.cli"]
TOKEN = "test-internal-token"
START_TIMEOUT_S = 240.0


_ISSUED: set[int] = set()  # ports handed out by this test process


def free_port() -> int:
    """A port free now and never handed out before by this process. The kernel may give the
    same free port to two calls before either process binds it: the second worker then fails to
    start while its health checks reach the first one, and a test talks to the wrong worker."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    health_path: str
    headers: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Proc:
        fd, path = tempfile.mkstemp(prefix=f"deepserve-{self.name}-", suffix=".log")
        self.log = Path(path)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.argv, stdout=fd, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        os.close(fd)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                r = httpx.get(self.url + self.health_path, headers=self.headers, timeout=2)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])


def worker(
    role: str,
    model: str,
    redis_url: str | None,
    *extra: str,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Proc:
    port = port or free_port()
    argv = [*CLI, "worker", "--role", role, "--model", model, "--host", host, "--port", str(port)]
    argv += ["--internal-token", TOKEN, "--num-threads", "1", *extra]
    if redis_url:
        argv += ["--kv-store", redis_url]
    headers = {"authorization": f"Bearer {TOKEN}"}
    return Proc(name or f"{role}-{host}:{port}", argv, port, "/internal/health", headers, host=host)


def frontend(
    model: str,
    *,
    workers: list[Proc] = (),
    prefill: list[Proc] = (),
    decode: list[Proc] = (),
    redis_url: str | None = None,
    extra: tuple[str, ...] = (),
) -> Proc:
    port = free_port()
    argv = [*CLI, "frontend", "--model", model, "--port", str(port), "--internal-token", TOKEN]
    for flag, group in (("--workers", workers), ("--prefill", prefill), ("--decode", decode)):
        if group:
            argv += [flag, *(w.url for w in group)]
    if redis_url:
        argv += ["--kv-store", redis_url]
    return Proc(f"frontend-{port}", [*argv, *extra], port, "/health")


def start_all(*procs: Proc) -> None:
    """Start every process first and then wait, so model loads overlap."""
    for p in procs:
        p.start()
    for p in procs:
        p.wait_ready()


def stop_all(*procs: Proc) -> None:
    for p in procs:
        p.stop()


def load(w: Proc) -> dict:
    r = httpx.get(w.url + "/internal/load", headers=w.headers, timeout=5)
    # A worker whose engine died answers 503 with the reason: show it, and the worker's log.
    assert r.status_code == 200, f"{w.name}: {r.status_code} {r.text}\n{w.tail()}"
    return r.json()


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
