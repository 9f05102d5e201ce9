"""Redis losing its data under a running prefill/decode pair: after a FLUSHALL or a restart of
the redis-server (empty, same port), the next hand-off of a repeated prompt, which is a device
prefix hit on the prefill worker, still lands every block in Redis, the decode worker loads them
all from there and recomputes none of the prompt, and every worker's store circuit breaker reads
closed again without waiting for traffic. Real worker processes (tiny-deepseek) driven over
their internal API, and a real redis-server."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import router_cluster as rc
from prometheus_client.parser import text_string_to_metric_families

from deepserve.disagg import protocol as P
from deepserve.disagg.client import WorkerClient

pytestmark = pytest.mark.redis

MODEL = "tiny-deepseek"
BLOCK = 16
FROM_REDIS = {"device": 0, "store": 3 * BLOCK}  # the decode worker recomputes none of the prompt
RECOVERY_S = 30  # the bound: served from Redis again within 30 s of it coming back


class Pair:
    def __init__(self, redis, prefill: rc.Proc, decode1: rc.Proc, decode2: rc.Proc) -> None:
        self.redis = redis
        self.prefill = prefill
        self.decode1 = decode1
        self.decode2 = decode2

    @property
    def workers(self) -> list[rc.Proc]:
        return [self.prefill, self.decode1, self.decode2]


@pytest.fixture(scope="module")
def pair(make_redis_server):
    redis = make_redis_server()
    # The decode workers must not share their KV with the prefill worker except through Redis.
    workers = [rc.worker(role, MODEL, redis.url) for role in ("prefill", "decode", "decode")]
    rc.start_all(*workers)
    yield Pair(redis, *workers)
    rc.stop_all(*workers)


def prompt(tag: int) -> list[int]:
    """3 full blocks and 2 tokens: the decode worker may take all 3 blocks from a tier."""
    return [1000 + 97 * tag + i for i in range(3 * BLOCK + 2)]


async def _events(w: rc.Proc, req: P.GenerateRequest) -> list[P.StreamEvent]:
    client = WorkerClient(w.url, rc.TOKEN)
    try:
        return [ev async for ev in client.generate(req)]
    finally:
        await client.close()


def hand_off(pair: Pair, rid: str, ids: list[int]) -> list[str]:
    """The prefill worker's part: its answer names the blocks it put in the shared tier."""
    req = P.GenerateRequest(rid, ids, {"max_tokens": 1, "temperature": 0.0}, "prefill")
    keys = asyncio.run(_events(pair.prefill, req))[-1].kv_keys
    assert len(keys) == 3
    return keys


def decode(w: rc.Proc, rid: str, ids: list[int], keys: list[str]) -> dict[str, int]:
    """The decode worker's part; the prompt tokens it found cached, per tier."""
    req = P.GenerateRequest(rid, ids, {"max_tokens": 2, "temperature": 0.0}, "decode", kv_keys=keys)
    return asyncio.run(_events(w, req))[0].cached_tokens_by_tier


def in_redis(pair: Pair, keys: list[str]) -> int:
    return pair.redis.client().exists(*[f"dskv:{k}" for k in keys])


def store_metric(w: rc.Proc, name: str) -> float:
    text = httpx.get(w.url + "/metrics", headers=w.headers, timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == f"deepserve:{name}" and s.labels.get("tier") == "store"
    )


def breaker_open(w: rc.Proc) -> bool:
    return store_metric(w, "kv_store_circuit_open") > 0


def test_after_flushall_a_repeated_prompts_hand_off_is_served_from_redis_again(pair):
    ids = prompt(1)
    keys = hand_off(pair, "flush-1", ids)
    assert decode(pair.decode1, "flush-1", ids, keys) == FROM_REDIS
    pair.redis.client().flushall()

    keys = hand_off(pair, "flush-2", ids)  # a device prefix hit on the prefill worker
    assert in_redis(pair, keys) == 3
    hits = store_metric(pair.decode2, "kv_tier_hits_total")
    assert decode(pair.decode2, "flush-2", ids, keys) == FROM_REDIS  # none recomputed
    assert store_metric(pair.decode2, "kv_tier_hits_total") == hits + 3
    assert store_metric(pair.prefill, "kv_store_rewritten_blocks_total") >= 3


def test_a_hand_off_whose_blocks_are_all_in_redis_rewrites_none(pair):
    ids = prompt(2)
    hand_off(pair, "whole-1", ids)
    rewritten = store_metric(pair.prefill, "kv_store_rewritten_blocks_total")
    hand_off(pair, "whole-2", ids)
    assert store_metric(pair.prefill, "kv_store_rewritten_blocks_total") == rewritten


def test_after_a_redis_restart_breakers_close_and_hand_offs_are_served_from_redis(pair):
    ids = prompt(3)
    keys = hand_off(pair, "restart-1", ids)
    assert decode(pair.decode1, "restart-1", ids, keys) == FROM_REDIS

    pair.redis.stop()
    try:
        # Traffic while Redis is down opens the breakers of the workers that get it.
        for i in range(2):
            down = prompt(10 + i)
            decode(pair.decode2, f"down-{i}", down, hand_off(pair, f"down-{i}", down))
        assert breaker_open(pair.prefill) and breaker_open(pair.decode2)
    finally:
        pair.redis.start()  # empty, on the same port

    # No traffic now: the breakers must close on their own once Redis answers.
    start = time.monotonic()
    assert rc.wait_for(lambda: not any(breaker_open(w) for w in pair.workers), RECOVERY_S)
    keys = hand_off(pair, "restart-2", ids)
    assert in_redis(pair, keys) == 3
    assert decode(pair.decode2, "restart-2", ids, keys) == FROM_REDIS
    assert time.monotonic() - start < RECOVERY_S
