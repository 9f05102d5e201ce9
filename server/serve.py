"""`deepserve serve`: load one engine in-process, build the app around it, run uvicorn.

The engine loads before the socket opens, so /health answering means requests can be served.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from deepserve.engine.config import EngineConfig
from deepserve.engine.contract import EngineClient
from deepserve.server.app import create_app
from deepserve.server.component_metrics import EngineCollector
from deepserve.server.config import ServerConfig
from deepserve.server.family import make_family
from deepserve.server.http_server import StartLine, run_in_loop, serve_http
from deepserve.server.metrics import ServerMetrics


def build_app(engine: EngineClient, server_config: ServerConfig) -> FastAPI:
    """The app for an already-built AsyncEngine (tests use this with their own engine)."""
    card = engine.card
    name = server_config.served_model_name
    family = make_family(
        card.info.family, engine.tokenizer, name, card.info.chat_template, card.info.bos_token_id
    )
    metrics = ServerMetrics(name, server_config.role, engine.load, card.batch_invariant)
    metrics.registry.register(EngineCollector(engine.stats, metrics.labels))
    return create_app(engine, family, server_config, metrics)


async def serve(
    engine_config: EngineConfig, server_config: ServerConfig, http: str = "auto"
) -> None:
    from deepserve.engine.async_engine import AsyncEngine

    engine = await asyncio.to_thread(AsyncEngine, engine_config)
    app = build_app(engine, server_config)
    start = StartLine("serve", engine.card.info.name, engine.card.kernels)
    try:
        host, port = server_config.host, server_config.port
        await serve_http(app, host, port, http, log_level="info", start=start)
    finally:
        await engine.shutdown()


def run_serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    loop: str = "auto",
    http: str = "auto",
) -> int:
    run_in_loop(serve(engine_config, server_config, http), loop)
    return 0
