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
    engine: AsyncEngine, served_name: str, api_key: str | None = None, **server_config
) -> Iterator[RunningServer]:
    """`server_config`: further ServerConfig fields (api_keys, cache_salt_by_api_key, ...)."""
    port = free_port()
    if api_key is not None:
        server_config.setdefault("api_keys", (api_key,))
    config = ServerConfig(served_model_name=served_name, port=port, **server_config)
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


def sdk_client(base_url: str, timeout: float = 300) -> OpenAI:
    """The official openai SDK on a test server: no retries, so a failure shows on first try."""
    return OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


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


def _serve_in_thread(make_server) -> tuple[uvicorn.Server, threading.Thread]:
    """Run `await make_server()` (which builds its app on the thread's own loop) and serve it."""
    holder: list[uvicorn.Server] = []

    async def main() -> None:
        server, cleanup = await make_server()
        holder.append(server)
        try:
            await server.serve()
        finally:
            await cleanup()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not (holder and holder[0].started):
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return holder[0], thread


def _uvicorn(app, port: int) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )


@contextlib.contextmanager
def running_worker(engine: AsyncEngine, role: str, token: str) -> Iterator[str]:
    """A `deepserve worker` app over `engine` (shared, not shut down here); yields its URL."""
    from deepserve.server.worker import WorkerConfig, build_worker_app

    port = free_port()
    app = build_worker_app(engine, WorkerConfig(role, token, f"127.0.0.1:{port}"))

    async def make():
        async def nothing() -> None:
            return None

        return _uvicorn(app, port), nothing

    server, thread = _serve_in_thread(make)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def running_frontend(
    workers: dict[str, tuple[str, ...]],
    served_name: str,
    token: str,
    response_store_url: str | None = None,
) -> Iterator[RunningServer]:
    """A `deepserve frontend` over the given workers (role -> URLs), in-process."""
    from deepserve.router.router import RouterConfig
    from deepserve.server.frontend import FrontendConfig, build_frontend_app, connect

    port = free_port()
    config = FrontendConfig(
        RouterConfig(workers=workers, internal_token=token),
        ServerConfig(
            served_model_name=served_name, port=port, response_store_url=response_store_url
        ),
        served_name,
        startup_timeout_s=30,
    )
    apps = []

    async def make():
        engine = await connect(config)
        apps.append(build_frontend_app(engine, config.server))
        return _uvicorn(apps[0], port), engine.shutdown

    server, thread = _serve_in_thread(make)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", None, apps[0], served_name)
    finally:
        server.should_exit = True
        thread.join(10)
