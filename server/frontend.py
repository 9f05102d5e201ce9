"""`deepserve frontend`: the same FastAPI app as `deepserve serve`, over remote workers.

The backend is a `RemoteEngine` (disagg/remote_engine.py): a router over the workers given by
flags or a pool file, colocated or prefill/decode. The model card (ModelInfo and the tokenizer)
comes from the workers, so the frontend loads no weights and cannot disagree with them on the
vocabulary. The socket opens only once a worker has answered with its card.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from tokenizers import Tokenizer

from deepserve.disagg.remote_engine import RemoteEngine, fetch_model_card
from deepserve.engine.admission import EngineLimits
from deepserve.engine.loader import ModelInfo
from deepserve.router.router import Router, RouterConfig
from deepserve.server.app import create_app
from deepserve.server.component_metrics import RouterCollector
from deepserve.server.config import ServerConfig
from deepserve.server.family import make_family
from deepserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    router: RouterConfig
    server: ServerConfig
    model: str  # what --model named; checked against the workers' card
    startup_timeout_s: float = 600.0
    loop: str = "auto"  # uvicorn's names: auto | asyncio | uvloop
    http: str = "auto"  # auto | h11 | httptools


async def connect(config: FrontendConfig) -> RemoteEngine:
    router = Router(config.router)
    await router.start()
    try:
        card = await fetch_model_card(router, config.startup_timeout_s)
    except BaseException:
        await router.close()
        raise
    info = ModelInfo(**card["info"])
    if info.name != config.model:
        log.warning("workers serve %r, the frontend was told --model %r", info.name, config.model)
    limits = EngineLimits(**card["limits"])
    return RemoteEngine(router, info, Tokenizer.from_str(card["tokenizer"]), limits)


def build_frontend_app(engine: RemoteEngine, server: ServerConfig) -> FastAPI:
    """The app over a connected RemoteEngine (tests build it on their own loop)."""
    info, name = engine.model_info, server.served_model_name
    family = make_family(info.family, engine.tokenizer, name, info.chat_template)
    metrics = ServerMetrics(name, server.role, engine.load)
    metrics.registry.register(RouterCollector(engine.router, metrics.labels))
    return create_app(engine, family, server, metrics)


async def serve_frontend(config: FrontendConfig) -> None:
    engine = await connect(config)
    app = build_frontend_app(engine, config.server)
    uv = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        http=config.http,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    try:
        await uvicorn.Server(uv).serve()
    finally:
        await engine.shutdown()


def run_frontend(config: FrontendConfig) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else one line per worker call
    # The loop also runs the worker clients, so uvloop speeds up both HTTP exchanges of a request.
    with asyncio.Runner(loop_factory=loop_factory(config.loop)) as runner:
        runner.run(serve_frontend(config))
    return 0


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
