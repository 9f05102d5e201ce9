"""`deepserve serve`: load one engine in-process, build the app around it, run uvicorn.

The engine loads before the socket opens, so /health answering means requests can be served.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from deepserve.engine.config import EngineConfig
from deepserve.server.app import create_app
from deepserve.server.component_metrics import EngineCollector
from deepserve.server.config import ServerConfig
from deepserve.server.family import make_family
from deepserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def build_app(engine, server_config: ServerConfig):
    """The app for an already-built AsyncEngine (tests use this with their own engine)."""
    info = engine.model_info
    family = make_family(
        info.family, engine.tokenizer, server_config.served_model_name, info.chat_template
    )
    metrics = ServerMetrics(
        server_config.served_model_name,
        server_config.role,
        engine.load,
        batch_invariant=getattr(engine.config, "batch_invariant", False),
    )
    if hasattr(engine, "engine"):  # a real AsyncEngine (tests may hand in a stand-in)
        metrics.registry.register(EngineCollector(engine.engine, metrics.labels))
    return create_app(engine, family, server_config, metrics)


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    from deepserve.engine.async_engine import AsyncEngine

    engine = await asyncio.to_thread(AsyncEngine, engine_config)
    app = build_app(engine, server_config)
    uv = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    log.info(
        "serving %s on %s:%d",
        server_config.served_model_name,
        server_config.host,
        server_config.port,
    )
    try:
        await uvicorn.Server(uv).serve()
    finally:
        await engine.shutdown()


def run_serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(engine_config, server_config))
    return 0
