"""The `deepserve worker` app: one `WorkerEngine` (engine/contract.py) behind the internal token-id
API (disagg/protocol.py).

Routes: generate (NDJSON stream of `StreamEvent`s), abort, load, health, model card, and Prometheus
/metrics. Every /internal route needs the shared secret; /metrics is left open so Prometheus can
scrape it (it holds counters only, and the worker binds 127.0.0.1 unless told otherwise), and so
are GET /health and /ready for orchestrators' probes (they say only that the worker is up and which
kernels it runs).

A worker also publishes its device cache's block events (stored/removed keys with their token ids)
on Redis pub/sub, which is how a cache-aware router learns who holds which prefix. In prefill mode
it waits until the prompt's full blocks are in the shared tier before it answers (writing again
any the store lost since, e.g. to a Redis restart), so the decode worker finds them; if that wait
times out the decode worker simply recomputes.

Not here: routing (router/) and the prefill/decode sequence (disagg/flow.py); protocol conversion
for clients (server/app.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from deepserve.disagg import protocol
from deepserve.disagg.background import BackgroundTask
from deepserve.disagg.dataclass_json import from_json, to_json
from deepserve.disagg.metrics import TransferMetrics
from deepserve.engine.admission import AdmittedRequest
from deepserve.engine.block_manager import BlockRemoved, BlockStored
from deepserve.engine.contract import WorkerEngine
from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.outputs import RequestOutput
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.component_metrics import EngineCollector
from deepserve.server.disconnect import ClientDisconnected, until_disconnect
from deepserve.server.http_server import StartLine, fastapi_app, run_in_loop, serve_http
from deepserve.server.metrics import CONTENT_TYPE, ServerMetrics
from deepserve.server.state import json_object

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # "prefill" | "decode" | "mixed"
    internal_token: str
    worker_id: str  # name used in published KV events; host:port by default
    kv_events_url: str | None = None  # redis:// for block-event pub/sub; None: no events
    event_interval_s: float = 0.02
    kv_flush_timeout_s: float = 5.0  # prefill: longest wait for blocks to reach the shared tier


class Worker:
    """State shared by the routes: the engine, config, counters, and the event publisher."""

    def __init__(self, engine: WorkerEngine, config: WorkerConfig) -> None:
        self.engine = engine
        self.config = config
        self.card = engine.card
        self.metrics = ServerMetrics(
            self.card.info.name, config.role, engine.load, self.card.batch_invariant
        )
        self.metrics.registry.register(EngineCollector(engine.stats, self.metrics.labels))
        self.transfer = TransferMetrics(self.metrics.registry, self.metrics.labels)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.publisher = BackgroundTask(self._publish_events, "kv-events")

    # ---- generate -----------------------------------------------------------------------------

    def admit(self, req: protocol.GenerateRequest) -> AdmittedRequest:
        """Admit before streaming, so a bad request is a 400 and never a broken stream."""
        try:
            params = from_json(SamplingParams, req.sampling)
        except (TypeError, ValueError, AttributeError) as e:
            raise InvalidRequestError(f"bad sampling parameters: {e}") from e
        admitted = self.engine.admit(req.prompt_token_ids, params, req.resume_token_ids)
        if admitted.grammar is not None:
            self.metrics.structured_request(params.structured.kind)
            self.metrics.grammar_compile.observe(admitted.grammar.compile_seconds)
        return admitted

    async def stream(
        self, req: protocol.GenerateRequest, admitted: AdmittedRequest
    ) -> AsyncIterator[dict]:
        """The request's events as JSON objects; the last one is `finished` (an error too).
        Read it to its end: each event is counted in the metrics after it was handed over."""
        first = True
        try:
            outputs = self.engine.generate(req.request_id, admitted)
            async for out in outputs:
                keys: list[str] = []
                if out.finished and req.mode == "prefill":
                    keys = await self._hand_off(req.prompt_token_ids, admitted.params.cache_salt)
                yield protocol.StreamEvent.from_output(out, keys).to_json()
                # Counted once the event is on its way: the router waits for it, not for this.
                if first:
                    self._count_prompt(out)
                    self._count_received(req, out)
                    first = False
                self._count_generated(out)
        except InvalidRequestError as e:  # raced validation, or the request failed on its own
            yield _error_event(req.request_id, str(e), rejected=True)
        except Exception as e:  # the stream must end with a reason, never silently
            log.exception("request %s failed", req.request_id)
            yield _error_event(req.request_id, f"{type(e).__name__}: {e}")

    def _count_prompt(self, out: RequestOutput) -> None:
        self.prompt_tokens += out.prompt_tokens
        self.cached_tokens += out.cached_tokens
        self.metrics.prompt_tokens.inc(out.prompt_tokens)
        self.metrics.cached_tokens.inc(out.cached_tokens)
        self.metrics.cached_prompt_tokens(out.cached_tokens_by_tier)
        if out.queue_time is not None:
            self.metrics.queue_time.observe(out.queue_time)

    def _count_received(self, req: protocol.GenerateRequest, out: RequestOutput) -> None:
        """Decode side of a PD hand-off: how many of the handed blocks were found here."""
        if req.mode != "decode" or not req.kv_keys:
            return
        size = self.card.block_size
        from_store = out.cached_tokens_by_tier.get("store", 0) // size
        self.transfer.received(
            len(req.kv_keys), out.cached_tokens // size, from_store, self.card.kv_block_bytes
        )

    def _count_generated(self, out: RequestOutput) -> None:
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            if c.finish_reason is not None:
                self.metrics.request_finished(c.finish_reason)

    async def _hand_off(self, prompt: list[int], cache_salt: str | None) -> list[str]:
        """Prefill mode: the keys of the prompt's blocks once they are in the shared tier (empty
        when there is no shared tier or the wait timed out)."""
        timeout = self.config.kv_flush_timeout_s
        hand_off = await self.engine.hand_off_prompt(prompt, timeout, cache_salt)
        if hand_off is None:  # no shared tier
            return []
        self.transfer.sent(
            hand_off.seconds, hand_off.num_blocks, self.card.kv_block_bytes, hand_off.flushed
        )
        if not hand_off.flushed:
            log.warning("KV blocks not in the shared tier after %.1fs", timeout)
        return hand_off.keys

    # ---- load / health --------------------------------------------------------------------------

    def load(self) -> protocol.WorkerLoad:
        load = self.engine.load()
        return protocol.WorkerLoad(
            role=self.config.role,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_usage,
            num_blocks=load.num_blocks,
            num_free_blocks=load.num_free_blocks,
            cache_hit_tokens=self.cached_tokens,
            prompt_tokens=self.prompt_tokens,
        )

    def health(self) -> protocol.WorkerHealth:
        return protocol.WorkerHealth(
            status="ok",
            role=self.config.role,
            model=self.card.info.name,
            worker_id=self.config.worker_id,
            block_size=self.card.block_size,
        )

    def model_card(self) -> dict:
        return {"card": to_json(self.card), "tokenizer": self.engine.tokenizer.to_str()}

    # ---- KV block events ------------------------------------------------------------------------

    def start_events(self) -> None:
        if self.config.kv_events_url:
            self.publisher.start()

    async def _publish_events(self) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import RedisClusterException

        from deepserve.kvcache.redis_url import async_client, is_cluster_url

        url = self.config.kv_events_url
        client = async_client(url, socket_timeout=1, socket_connect_timeout=1)
        # On a cluster, SPUBLISH reaches only the channel's shard, not every node over the bus.
        publish = client.spublish if is_cluster_url(url) else client.publish
        # A (re)started worker holds nothing: routers must forget what they knew of it.
        pending = [protocol.BlockEvent("cleared")]
        try:
            while True:
                pending += [_block_event(e) for e in self.engine.take_block_events()]
                if pending:
                    batch = protocol.EventBatch(self.config.worker_id, pending)
                    try:
                        await publish(protocol.KV_EVENTS_CHANNEL, json.dumps(batch.to_json()))
                    except (OSError, aioredis.RedisError, RedisClusterException) as e:
                        # Dropped events only make routing less sticky, never wrong.
                        log.warning("could not publish %d KV events: %s", len(pending), e)
                    pending = []
                await asyncio.sleep(self.config.event_interval_s)
        finally:
            await client.aclose()


def _block_event(e: BlockStored | BlockRemoved) -> protocol.BlockEvent:
    if isinstance(e, BlockStored):
        parent = e.parent_key.hex() if e.parent_key is not None else None
        return protocol.BlockEvent("stored", e.key.hex(), parent, list(e.token_ids))
    return protocol.BlockEvent("removed", e.key.hex())


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _error_event(request_id: str, message: str, rejected: bool = False) -> dict:
    event = protocol.StreamEvent(request_id, [], finished=True, error=message, rejected=rejected)
    return event.to_json()


async def _json_body(request: Request) -> dict:
    return json_object(await request.body())


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ValueError("the client left before sending the whole body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status)


class RequireSecret:
    """Pure ASGI check of the shared secret on /internal/* (BaseHTTPMiddleware would add a task
    and a queue to every streamed response, which is the hot path here)."""

    def __init__(self, app, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/internal/"):
            given = dict(scope["headers"]).get(protocol.AUTH_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.expected):
                await _error(401, "missing or wrong internal token")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GenerateRoute:
    """POST /internal/generate as pure ASGI: the NDJSON stream of one request's events.

    The router's hot path, so it skips FastAPI's routing and `StreamingResponse`, which starts
    an anyio task group and a disconnect-listener task per request, and it writes so as to wake
    the router less: the headers go out with the first event, not before the engine starts,
    and the finished event goes out in one write with the body's end. The router therefore
    waits for the headers as long as for a first event (disagg/client.py). A client that leaves
    still stops the request (`_stream`)."""

    def __init__(self, app, worker: Worker) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != protocol.GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _error(405, "generate takes POST")(scope, receive, send)
            return
        try:
            with self.worker.engine.arriving():
                req = protocol.GenerateRequest.from_json(json_object(await _read_body(receive)))
                admitted = self.worker.admit(req)
        except (InvalidRequestError, TypeError, ValueError) as e:
            await _error(400, str(e))(scope, receive, send)
            return
        await _stream(self.worker.stream(req, admitted), receive, send)


_NDJSON_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/x-ndjson")],
}


async def _stream(events: AsyncIterator[dict], receive, send) -> None:
    """Send `events` as NDJSON lines. If the client disconnects first, the sending is cancelled
    and the events closed, and closing the engine's generator aborts the request."""
    with contextlib.suppress(ClientDisconnected):
        await until_disconnect(receive, _send_lines(events, send))


async def _send_lines(events: AsyncIterator[dict], send) -> None:
    finished = False
    async with contextlib.aclosing(events):
        # Headers with the first event: no write and no wake-up of the router while the engine
        # works (sending them once the request was queued cost the router hop ~2.8 ms, see
        # benchmarks/RESULTS.md).
        event = await anext(events, None)
        await send(_NDJSON_START)
        while event is not None:
            if not finished:
                finished = event["finished"]
                body = _line(event)
                await send({"type": "http.response.body", "body": body, "more_body": not finished})
            event = await anext(events, None)  # to the end: the stream counts after sending
        if not finished:  # the client then reports a stream that ended early
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_worker_app(engine: WorkerEngine, config: WorkerConfig) -> FastAPI:
    worker = Worker(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start_events()
        try:
            yield
        finally:
            await worker.publisher.stop()
            await engine.shutdown()

    app = fastapi_app("deepserve worker", lifespan)  # the secret guards /internal/*
    app.state.worker = worker
    expected = f"Bearer {config.internal_token}".encode()

    # Generate first, so the secret is checked before it (the last one added runs first).
    app.add_middleware(GenerateRoute, worker=worker)
    app.add_middleware(RequireSecret, expected=expected)

    @app.post(protocol.ABORT_PATH)
    async def abort(request: Request):
        try:
            body = await _json_body(request)
        except ValueError as e:
            return _error(400, str(e))
        if not isinstance(body.get("request_id"), str):
            return _error(400, "request_id must be a string")
        await engine.abort(body["request_id"])
        return {"ok": True}

    # A worker whose engine died answers 503 here, so the router's probes eject it.
    @app.get(protocol.LOAD_PATH)
    async def load():
        if (reason := engine.unavailable()) is not None:
            return _error(503, reason)
        return worker.load().to_json()

    @app.get(protocol.HEALTH_PATH)
    async def health():
        if (reason := engine.unavailable()) is not None:
            return _error(503, reason)
        return worker.health().to_json()

    # Open probes for orchestrators: they reveal no more than that the worker serves, and how.
    @app.get("/health")
    async def open_health():
        if engine.unavailable() is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", "kernels": worker.card.kernels}

    @app.get("/ready")
    async def ready():
        # The app is built once the engine has loaded: answering means requests can be served.
        if engine.unavailable() is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ready"}

    @app.get(protocol.MODEL_PATH)
    async def model():
        return worker.model_card()

    @app.get(protocol.METRICS_PATH)
    async def metrics():
        return PlainTextResponse(worker.metrics.render(), media_type=CONTENT_TYPE)

    return app


def run_worker(
    engine_config,
    config: WorkerConfig,
    host: str,
    port: int,
    loop: str = "auto",
    http: str = "auto",
) -> int:
    """Load the engine, then serve the internal API until SIGINT/SIGTERM."""
    from deepserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(engine_config)
    app = build_worker_app(engine, config)
    start = StartLine(config.role, engine.card.info.name, engine.card.kernels)
    # Routers call it directly: no proxy headers, one ASGI layer less per request.
    run_in_loop(serve_http(app, host, port, http, proxy_headers=False, start=start), loop)
    return 0
