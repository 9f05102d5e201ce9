"""A real `deepserve` HTTP server for tests: one AsyncEngine, uvicorn on a free loopback port in a
background thread, torn down at the end. Tests talk to it with the official SDKs over TCP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from openai import OpenAI

from deepserve.engine.async_engine import AsyncEngine
from deepserve.engine.config import EngineConfig
from deepserve.server.config import ServerConfig
from deepserve.server.serve import build_app


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngine
    app: object
    model: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    engine: AsyncEngine, served_name: str, api_key: str | None = None
) -> Iterator[RunningServer]:
    port = free_port()
    config = ServerConfig(served_model_name=served_name, port=port, api_key=api_key)
    app = build_app(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, app, served_name)
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def engine_for(model: str, **overrides) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(**{"model": model, "num_threads": 1, **overrides}))
    try:
        yield engine
    finally:
        asyncio.run(engine.shutdown())


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def smollm_engine() -> Iterator[AsyncEngine]:
    """One SmolLM2 engine shared by every server test module (loading it takes ~20 s)."""
    with engine_for("smollm2-135m") as engine:
        yield engine


@pytest.fixture(scope="module")
def server(smollm_engine) -> Iterator[RunningServer]:
    """A server on a free port over the shared SmolLM2 engine, one per test module."""
    with running_server(smollm_engine, "smollm2-135m") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
