"""The query of death (top_k = 2^63 or 2^64-1 at the default temperature, on every generating route)
is served by `deepserve serve` and, through a frontend, by a cluster of real worker processes,
after which every worker still serves; a request that fails on a worker for its own content is
not tried on another; a server or worker whose engine stopped answers 503 on its health routes;
workers publish no API docs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import router_cluster as rc
from fastapi.testclient import TestClient
from server_harness import running_server, smollm_engine

from deepserve.disagg import protocol as P
from deepserve.disagg.client import WorkerClient
from deepserve.disagg.errors import WorkerRejectedError
from deepserve.disagg.flow import GenerationFlow
from deepserve.engine.async_engine import AsyncEngine
from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.loader import LoadedModel
from deepserve.engine.sampling_params import SamplingParams
from deepserve.router.router import Router, RouterConfig
from deepserve.server.worker import WorkerConfig, build_worker_app

__all__ = ["smollm_engine"]
# The largest top_k values admission lets through (int64; 2^63 and up are a 400 there, see
# tests/test_server_hostile_bodies.py): they reach the sampler, which must clamp them.
DEATH = [2**63 - 1, 2**62]
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def body_for(route: str, model: str, top_k: int) -> dict:
    """A default-temperature request with the hostile top_k, in the route's own shape."""
    base = {"model": model, "top_k": top_k, "max_tokens": 4}
    if route == "/v1/completions":
        return {**base, "prompt": "Say something."}
    if route == "/v1/responses":
        return {"model": model, "top_k": top_k, "max_output_tokens": 4, "input": "Say something."}
    return {**base, "messages": [{"role": "user", "content": "Say something."}]}


def send_all_deaths(url: str, model: str, extra: dict | None = None) -> list[int]:
    statuses = []
    for route in ROUTES:
        for top_k in DEATH:
            body = {**body_for(route, model, top_k), **(extra or {})}
            statuses.append(httpx.post(url + route, json=body, timeout=120).status_code)
    return statuses


# ---- deepserve serve ------------------------------------------------------------------------


def test_query_of_death_is_served_by_serve_and_the_engine_lives(smollm_engine):
    with running_server(smollm_engine, "smollm2-135m") as srv:
        assert send_all_deaths(srv.base_url, srv.model) == [200] * 8
        normal = {**body_for(ROUTES[0], srv.model, 0), "temperature": 0}
        assert httpx.post(srv.base_url + ROUTES[0], json=normal, timeout=120).status_code == 200
        for path in ("/health", "/ready"):
            assert httpx.get(srv.base_url + path, timeout=5).status_code == 200


def test_stopped_engine_makes_health_and_ready_answer_503(smollm_engine):
    e = smollm_engine
    loaded = LoadedModel(e.engine.model, e.tokenizer, e.model_info)
    engine = AsyncEngine(EngineConfig(num_kv_blocks=16, num_threads=1), loaded)
    with running_server(engine, "smollm2-135m") as srv:
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
        asyncio.run(engine.shutdown())
        for path in ("/health", "/ready"):
            r = httpx.get(srv.base_url + path, timeout=5)
            assert r.status_code == 503 and "not running" in r.json()["reason"]


def test_worker_with_a_stopped_engine_fails_its_probes_and_publishes_no_docs(smollm_engine):
    e = smollm_engine
    loaded = LoadedModel(e.engine.model, e.tokenizer, e.model_info)
    engine = AsyncEngine(EngineConfig(num_kv_blocks=16, num_threads=1), loaded)
    app = build_worker_app(engine, WorkerConfig("mixed", rc.TOKEN, "w-dead"))
    http = TestClient(app)  # no lifespan: nothing to publish, the engine is stopped by hand
    auth = {"authorization": f"Bearer {rc.TOKEN}"}
    assert http.get(P.HEALTH_PATH, headers=auth).status_code == 200
    asyncio.run(engine.shutdown())
    assert http.get(P.HEALTH_PATH, headers=auth).status_code == 503
    assert http.get(P.LOAD_PATH, headers=auth).status_code == 503
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(path).status_code == 404
        assert http.get(path, headers=auth).status_code == 404


# ---- frontend + 1 prefill + 2 decode workers ---------------------------------------------------

MODEL = "tiny-deepseek"


@pytest.fixture(scope="module")
def cluster(make_redis_server):
    redis = make_redis_server()
    prefill = rc.worker("prefill", MODEL, redis.url)
    decode = [rc.worker("decode", MODEL, redis.url) for _ in range(2)]
    rc.start_all(prefill, *decode)
    front = rc.frontend(
        MODEL,
        prefill=[prefill],
        decode=decode,
        redis_url=redis.url,
        extra=("--policy", "round_robin"),
    )
    rc.start_all(front)
    yield front, [prefill, *decode]
    rc.stop_all(front, prefill, *decode)


async def generate_on(w: rc.Proc, req: P.GenerateRequest) -> list[P.StreamEvent]:
    client = WorkerClient(w.url, rc.TOKEN)
    try:
        return [ev async for ev in client.generate(req)]
    finally:
        await client.close()


def test_query_of_death_through_the_frontend_leaves_every_worker_serving(cluster):
    front, workers = cluster
    no_thinking = {"thinking": {"type": "disabled"}}
    statuses = send_all_deaths(front.url, MODEL)
    statuses += [
        httpx.post(
            front.url + ROUTES[0], json={**body_for(ROUTES[0], MODEL, k), **no_thinking}
        ).status_code
        for k in DEATH
    ]
    assert statuses == [200] * 10
    for i, w in enumerate(workers):
        assert httpx.get(w.url + P.HEALTH_PATH, headers=w.headers, timeout=5).status_code == 200
        req = P.GenerateRequest(f"after-{i}", [5, 6, 7, 8], {"max_tokens": 3, "temperature": 0})
        events = asyncio.run(generate_on(w, req))
        assert events[-1].finished and events[-1].error is None


def test_request_failing_on_a_worker_for_its_content_is_not_retried(cluster):
    _, workers = cluster
    prefill, decode = workers[0], workers[1:]

    async def run() -> Router:
        urls = {"prefill": (prefill.url,), "decode": tuple(w.url for w in decode)}
        router = Router(RouterConfig(workers=urls, internal_token=rc.TOKEN))
        await router.health.probe_all()
        flow = GenerationFlow(router, 4096)
        # A float stop token id passes validation but breaks the sampler's suppression of stop
        # tokens under min_tokens: the engine fails this request alone.
        bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(3.5,))
        with pytest.raises(WorkerRejectedError):
            async for _ in flow.stream("content-fault", [5, 6, 7, 8, 9], bad):
                pass
        await router.close()
        return router

    router = asyncio.run(run())
    assert sum(router.stats.decisions.values()) == 1  # one worker tried, none retried
    assert not router.stats.retries
    assert all(w.healthy and w.consecutive_failures == 0 for w in router.pool.workers())
