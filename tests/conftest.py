"""Shared pytest fixtures. Keep it additive: each fixture documents what it gives.

- `redis_server` (session): a real redis-server on a free loopback port, started once and stopped
  after the session; `.url`, `.port`, `.client()`, and `.stop()` / `.start()` (same port) for fault
  tests, which must leave it running.
- `make_redis_server` (session): a factory for extra private redis-servers (stopped at the end).
- `redis_url` (function): the shared server's URL after FLUSHALL, so each test starts empty.
- `private_state_home` (session, autouse): $XDG_STATE_HOME set to a temporary directory, so a CLI
  that generates the machine's KV secret (server/state_dir.py) never writes into the real home.
- `smollm_engine` (session): server_harness's SmolLM2 AsyncEngine, one for every module that uses
  it without importing its own (an imported fixture is a module's own, loaded once per module).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
from server_harness import smollm_engine

__all__ = ["smollm_engine"]


@pytest.fixture(scope="session", autouse=True)
def private_state_home(tmp_path_factory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))
    yield
    mp.undo()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process with no persistence, bound to 127.0.0.1 only."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or _free_port()
        self.extra_args = extra_args
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="deepserve-redis-")
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> None:
        assert self._proc is None, "already running"
        self._proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir,
                "--enable-debug-command", "yes",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def _answers_ping(self) -> bool:
        """Any RESP reply counts (a server with requirepass answers -NOAUTH, which is fine)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64)[:1] in (b"+", b"-")
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self._proc is not None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="session")
def make_redis_server() -> Iterator:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make services installs it)")
    servers: list[RedisServer] = []

    def make(extra_args: tuple[str, ...] = ()) -> RedisServer:
        server = RedisServer(extra_args=extra_args)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_server(make_redis_server) -> RedisServer:
    return make_redis_server()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if not redis_server.running:  # a fault test that failed half-way left it stopped
        redis_server.start()
    redis_server.client().flushall()
    return redis_server.url
