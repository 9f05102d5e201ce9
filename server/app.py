"""`create_app`: the FastAPI application for one backend, from explicit config objects.

Routes, error handlers (every error leaves as the protocol's error object with its status; bad
input never becomes a 5xx) and the front middleware. Building the backend and running uvicorn is
server/serve.py's job.
"""

from __future__ import annotations

import logging
import time

import deepseek_recipe as dr
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepserve.engine.contract import EngineClient
from deepserve.engine.errors import EngineError, InvalidRequestError
from deepserve.server import chat_routes, completions, tokenize_routes
from deepserve.server.config import ServerConfig
from deepserve.server.errors import HTTPError, error_response, message_of_conversion_error
from deepserve.server.family import ModelFamily
from deepserve.server.http_server import fastapi_app
from deepserve.server.metrics import CONTENT_TYPE, ServerMetrics
from deepserve.server.middleware import FrontMiddleware
from deepserve.server.protocols import CHAT, MESSAGES, RESPONSES
from deepserve.server.response_store import ResponseStore, ResponseStoreConfig
from deepserve.server.state import AppState, check_model

log = logging.getLogger(__name__)


def create_app(
    backend: EngineClient,
    family: ModelFamily,
    config: ServerConfig,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    metrics = metrics or ServerMetrics(config.served_model_name, config.role, backend.load)
    store = ResponseStore(ResponseStoreConfig(redis_url=config.response_store_url))
    state = AppState(backend, family, config, metrics, store)
    app = fastapi_app("deepserve")
    app.state.deepserve = state
    _add_routes(app, state)
    _add_error_handlers(app)
    app.add_middleware(
        FrontMiddleware,
        api_keys=config.api_keys,
        max_body_bytes=config.max_body_bytes,
        metrics=metrics,
    )
    return app


def _add_routes(app: FastAPI, state: AppState) -> None:
    created = int(time.time())

    async def chat(request: Request) -> Response:
        return await chat_routes.handle(request, CHAT, state)

    async def responses(request: Request) -> Response:
        return await chat_routes.handle(request, RESPONSES, state)

    async def messages(request: Request) -> Response:
        return await chat_routes.handle(request, MESSAGES, state)

    async def completion(request: Request) -> Response:
        return await completions.handle(request, state)

    async def count_tokens(request: Request) -> Response:
        return await chat_routes.count_tokens(request, state)

    async def tokenize(request: Request) -> Response:
        return await tokenize_routes.tokenize(request, state)

    async def detokenize(request: Request) -> Response:
        return await tokenize_routes.detokenize(request, state)

    # Plain Starlette routes: the handlers take the raw request and return a Response, so
    # FastAPI's per-request dependency solving and exit stack (~0.1 ms on a 2-core box) buy
    # nothing on the generation paths. Errors still pass through the app's handlers below.
    for path, endpoint in (
        ("/v1/chat/completions", chat),
        ("/v1/responses", responses),
        ("/v1/messages", messages),
        ("/v1/completions", completion),
        ("/v1/messages/count_tokens", count_tokens),
        ("/tokenize", tokenize),
        ("/detokenize", detokenize),
    ):
        app.add_route(path, endpoint, methods=["POST"])

    def card() -> dict:
        return {
            "id": state.config.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "deepserve",
            "max_model_len": state.max_model_len,
            "batch_invariant": state.metrics.batch_invariant,
            "kv_cache_dtype": state.backend.card.kv_cache_dtype,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    # OpenAI's "retrieve model" (`client.models.retrieve`); a served name may hold slashes
    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> dict:
        check_model({"model": model}, state.config.served_model_name)
        return card()

    # Both report a backend that cannot serve (a crashed engine, no worker left), so a
    # container's healthcheck or a load balancer stops sending it requests.
    @app.get("/health")
    async def health() -> Response:
        if (reason := state.backend.unavailable()) is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "batch_invariant": state.metrics.batch_invariant})

    @app.get("/ready")
    async def ready() -> Response:
        # The backend exists once the model is loaded; the app is only built after that.
        if (reason := state.backend.unavailable()) is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": state.config.served_model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def http_error(request: Request, e: HTTPError) -> Response:
        return error_response(request.url.path, e.status, e.message, e.param)

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, e: InvalidRequestError) -> Response:
        return error_response(request.url.path, 400, str(e))

    @app.exception_handler(dr.ConversionError)
    async def conversion(request: Request, e: dr.ConversionError) -> Response:
        return error_response(request.url.path, e.status_code, message_of_conversion_error(e.body))

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(request.url.path, 400, f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def starlette_http(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(request.url.path, e.status_code, str(e.detail))

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, e: EngineError) -> Response:
        log.error("engine error on %s: %s", request.url.path, e)
        return error_response(request.url.path, 503, f"the engine cannot serve requests: {e}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, "internal server error")
