"""Running an ASGI app under uvicorn, the same way for `serve`, `frontend` and `worker`.

One place for the uvicorn settings (graceful shutdown bound, no access log), the FastAPI settings
every app shares, the event loop choice: "auto" takes uvloop and httptools when installed (a
routed request crosses two HTTP stacks, so their per-request cost counts twice), and the one line
each process logs once it listens. Logging itself is set up by the CLI (server/cli.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

LOOPS = ("auto", "asyncio", "uvloop")
HTTP_PARSERS = ("auto", "h11", "httptools")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartLine:
    """What a process says once it listens, so its log (`docker compose logs`) tells which process
    it is and what it runs."""

    role: str  # serve | prefill | decode | mixed | frontend
    model: str
    kernels: str  # kernels/registry.py kernels_in_use: native | torch (a frontend: its workers')

    def text(self, host: str, port: int) -> str:
        return (
            f"deepserve started: role={self.role} model={self.model} kernels={self.kernels} "
            f"listening on http://{host}:{port}"
        )


class _Server(uvicorn.Server):
    """uvicorn's server, logging the start line once its sockets are bound (not before: a port in
    use ends the start with uvicorn's own error instead)."""

    def __init__(self, config: uvicorn.Config, start: StartLine | None) -> None:
        super().__init__(config)
        self.start = start

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.start is not None:
            log.info(self.start.text(self.config.host, self.config.port))


def fastapi_app(title: str, lifespan: Any = None) -> FastAPI:
    """A FastAPI app as every deepserve process builds it. No /docs, /redoc or /openapi.json:
    nothing is published to whoever can reach the port. FastAPI's native OpenTelemetry is off:
    the apps export their own Prometheus metrics, and its per-request check for a configured
    provider (environment reads, provider lookups) was ~5% of the event loop's time per chat
    request."""
    return FastAPI(
        title=title,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )


async def serve_http(
    app: Any,
    host: str,
    port: int,
    http: str = "auto",
    log_level: str = "warning",
    proxy_headers: bool = True,
    start: StartLine | None = None,
) -> None:
    """Serve `app` on the running loop until SIGINT/SIGTERM; log `start` once listening."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http,
        log_level=log_level,
        access_log=False,
        proxy_headers=proxy_headers,
        timeout_graceful_shutdown=5,
    )
    await _Server(config, start).serve()


def run_in_loop(main: Coroutine[Any, Any, None], loop: str = "auto") -> None:
    """Run `main` on a new event loop of the kind uvicorn's `--loop` names."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(main)


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvicorn's loop choice for a loop we create ourselves (None: asyncio's default)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return None
    return uvloop.new_event_loop
