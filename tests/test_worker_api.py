"""`deepserve worker` as a real process: the internal API, its secret, aborts, KV events and the
prefill mode's write-through to a real redis-server."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import router_cluster as rc

from deepserve.disagg import protocol as P
from deepserve.disagg.client import WorkerClient
from deepserve.disagg.errors import WorkerRejectedError

MODEL = "tiny-deepseek"
PROMPT = list(range(1000, 1040))  # 2 full blocks of 16 + 8 tokens


@pytest.fixture(scope="module")
def redis(make_redis_server):
    return make_redis_server()


@pytest.fixture(scope="module")
def worker(redis):
    w = rc.worker("mixed", MODEL, redis.url)
    rc.start_all(w)
    yield w
    rc.stop_all(w)


def run(coro):
    return asyncio.run(coro)


async def generate(w: rc.Proc, req: P.GenerateRequest) -> list[P.StreamEvent]:
    client = WorkerClient(w.url, rc.TOKEN)
    try:
        return [ev async for ev in client.generate(req)]
    finally:
        await client.close()


def tokens(events: list[P.StreamEvent]) -> list[int]:
    return [t for ev in events for o in ev.outputs for t in o["token_ids"]]


def test_internal_routes_refuse_calls_without_the_secret(worker):
    for path in (P.HEALTH_PATH, P.LOAD_PATH, P.MODEL_PATH):
        assert httpx.get(worker.url + path, timeout=5).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.get(worker.url + path, headers=wrong, timeout=5).status_code == 401
    r = httpx.post(worker.url + P.GENERATE_PATH, json={}, timeout=5)
    assert r.status_code == 401


def test_health_and_ready_are_open_and_reveal_only_status_and_kernels(worker):
    health = httpx.get(worker.url + "/health", timeout=5)
    ready = httpx.get(worker.url + "/ready", timeout=5)
    assert health.status_code == 200 and ready.status_code == 200
    assert set(health.json()) == {"status", "kernels"}
    assert health.json()["kernels"] in {"native", "torch"}
    assert ready.json() == {"status": "ready"}


def test_generate_streams_tokens_then_reports_the_prompt_as_cached(worker):
    sampling = {"max_tokens": 5, "temperature": 0.0, "logprobs": 0}
    first = run(generate(worker, P.GenerateRequest("g1", PROMPT, sampling)))
    again = run(generate(worker, P.GenerateRequest("g2", PROMPT, sampling)))
    assert len(tokens(first)) == 5 and tokens(first) == tokens(again)
    assert first[-1].finished and first[-1].outputs[-1]["finish_reason"] == "length"
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == 32
    assert all(o["logprobs"] for ev in first for o in ev.outputs)


def test_bad_request_is_a_400_with_the_engines_message(worker):
    req = P.GenerateRequest("bad", [10**9], {"max_tokens": 2})
    with pytest.raises(WorkerRejectedError, match="outside the vocabulary"):
        run(generate(worker, req))
    r = httpx.post(
        worker.url + P.GENERATE_PATH, content=b"not json", headers=worker.headers, timeout=5
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_abort_mid_stream_frees_every_kv_block(worker):
    async def scenario():
        client = WorkerClient(worker.url, rc.TOKEN)
        req = P.GenerateRequest("long", PROMPT, {"max_tokens": 2000, "ignore_eos": True})
        seen, aborted = 0, False
        async for ev in client.generate(req):
            seen += len(ev.outputs[0]["token_ids"]) if ev.outputs else 0
            if seen >= 3 and not aborted:
                assert rc.load(worker)["kv_usage"] > 0
                await client.abort("long")
                aborted = True
            if ev.finished:
                await client.close()
                return ev.outputs[-1]["finish_reason"]

    assert run(scenario()) == "abort"
    assert rc.wait_for(lambda: rc.load(worker)["kv_usage"] == 0, 5)


def test_client_leaving_mid_stream_frees_every_kv_block(worker):
    body = P.GenerateRequest("left", PROMPT, {"max_tokens": 2000, "ignore_eos": True}).to_json()
    url, headers = worker.url + P.GENERATE_PATH, worker.headers
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert rc.load(worker)["kv_usage"] > 0
    # The connection is closed: the worker alone must notice and abort the request.
    assert rc.wait_for(lambda: rc.load(worker)["kv_usage"] == 0, 5)
    after = run(generate(worker, P.GenerateRequest("after", PROMPT, {"max_tokens": 2})))
    assert len(tokens(after)) == 2


def test_finished_event_arrives_with_the_end_of_the_body(worker):
    # One write for both: the router reads the last token and the body's end with one wake-up.
    body = json.dumps(P.GenerateRequest("one", PROMPT, {"max_tokens": 1}).to_json()).encode()
    head = (
        f"POST {P.GENERATE_PATH} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {rc.TOKEN}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", worker.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while b'"finished":true' not in received:
            chunk = sock.recv(65536)
            assert chunk, "the worker closed the connection"
            received += chunk
        assert received.endswith(b"\r\n0\r\n\r\n")


def test_prefill_mode_answers_after_its_blocks_are_in_the_shared_tier(worker, redis):
    prompt = list(range(2000, 2050))  # 3 full blocks
    events = run(generate(worker, P.GenerateRequest("p1", prompt, {"max_tokens": 1}, "prefill")))
    keys = events[-1].kv_keys
    assert len(keys) == 3
    stored = redis.client().exists(*[f"dskv:{k}" for k in keys])
    assert stored == 3


def test_worker_publishes_its_block_events_on_redis(worker, redis):
    pubsub = redis.client().pubsub()
    pubsub.subscribe(P.KV_EVENTS_CHANNEL)
    pubsub.get_message(timeout=5)  # the subscribe confirmation
    prompt = list(range(3000, 3033))
    blocks = [prompt[:16], prompt[16:32]]
    run(generate(worker, P.GenerateRequest("ev", prompt, {"max_tokens": 1})))
    # Earlier tests' events may still be in flight on the channel: keep only this prompt's.
    stored: list[P.BlockEvent] = []
    deadline = time.monotonic() + 10
    while len(stored) < 2 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg and msg["type"] == "message":
            batch = P.EventBatch.from_json(json.loads(msg["data"]))
            stored.extend(e for e in batch.events if e.kind == "stored" and e.token_ids in blocks)
    assert [e.token_ids for e in stored] == blocks
    assert stored[0].parent is None and stored[1].parent == stored[0].key
