"""`deepserve frontend`: the same FastAPI app as `deepserve serve`, over remote workers.

The backend is a `RemoteEngine` (router/remote_engine.py): a router over the workers given by
flags or a pool file, colocated or prefill/decode. The model card (`ModelCard` and the tokenizer)
comes from the workers, so the frontend loads no weights and cannot disagree with them on the
vocabulary. The socket opens only once a worker has answered with its card.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI

from deepserve.router.remote_engine import RemoteEngine, fetch_model_card
from deepserve.router.router import Router, RouterConfig
from deepserve.server.app import create_app
from deepserve.server.component_metrics import RouterCollector
from deepserve.server.config import ServerConfig
from deepserve.server.family import make_family
from deepserve.server.http_server import StartLine, run_in_loop, serve_http
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
        card, tokenizer = await fetch_model_card(router, config.startup_timeout_s)
    except BaseException:
        await router.close()
        raise
    if card.info.name != config.model:
        log.warning(
            "workers serve %r, the frontend was told --model %r", card.info.name, config.model
        )
    return RemoteEngine(router, card, tokenizer)


def build_frontend_app(engine: RemoteEngine, server: ServerConfig) -> FastAPI:
    """The app over a connected RemoteEngine (tests build it on their own loop)."""
    info, name = engine.card.info, server.served_model_name
    family = make_family(info.family, engine.tokenizer, name, info.chat_template, info.bos_token_id)
    # What the workers run: a frontend has no engine of its own to ask.
    metrics = ServerMetrics(name, server.role, engine.load, engine.card.batch_invariant)
    metrics.registry.register(RouterCollector(engine.router, metrics.labels))
    return create_app(engine, family, server, metrics)


async def serve_frontend(config: FrontendConfig) -> None:
    engine = await connect(config)
    app = build_frontend_app(engine, config.server)
    start = StartLine("frontend", engine.card.info.name, engine.card.kernels)
    try:
        host, port = config.server.host, config.server.port
        await serve_http(app, host, port, config.http, start=start)
    finally:
        await engine.shutdown()


def run_frontend(config: FrontendConfig) -> int:
    # The loop also runs the worker clients, so uvloop speeds up both HTTP exchanges of a request.
    run_in_loop(serve_frontend(config), config.loop)
    return 0
