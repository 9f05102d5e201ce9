"""The KV tier and the KV events on a real Redis Cluster (3 masters, 3 replicas, on loopback):
a prefill worker, a decode worker and a frontend all given `redis+cluster://`. Follow-up turns hit
the prefix cache, the decode worker reads the prefill worker's blocks from the cluster, block keys
land on all three masters, a master SIGKILLed under load fails no request (its blocks are misses
while the replica takes over) and the tier hits again after the failover. The router's event
subscriber follows the events channel's shard through a failover of its master."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
import router_cluster as rc
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisClusterException
from redis_cluster import Cluster, redis_cluster

from deepserve.disagg import protocol as P
from deepserve.kvcache.redis_url import async_client
from deepserve.router.kv_events import KVEventSubscriber
from deepserve.router.prefix_index import PrefixIndex

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

MODEL = "tiny-deepseek"
KEY_PREFIX = "dskv:"
NO_THINKING = {"thinking": {"type": "disabled"}}
LOAD_REQUESTS = 24
LOAD_CONCURRENCY = 6


@dataclass
class Stack:
    cluster: Cluster
    front: rc.Proc
    prefill: rc.Proc
    decode: rc.Proc

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.front.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def stack():
    with redis_cluster() as cluster:
        prefill = rc.worker("prefill", MODEL, cluster.url)
        decode = rc.worker("decode", MODEL, cluster.url)
        rc.start_all(prefill, decode)
        front = rc.frontend(MODEL, prefill=[prefill], decode=[decode], redis_url=cluster.url)
        rc.start_all(front)
        try:
            yield Stack(cluster, front, prefill, decode)
        finally:
            rc.stop_all(front, prefill, decode)


def chat(stack: Stack, messages: list[dict], max_tokens: int = 4):
    return stack.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body=NO_THINKING,
    )


def prompt(i: int, tag: str) -> list[dict]:
    """A prompt of several full KV blocks that no other call sends."""
    text = f"Request {tag}-{i}: " + " ".join(f"item{tag}{i}x{j}" for j in range(40))
    return [{"role": "user", "content": text}]


def store_counter(worker: rc.Proc, name: str) -> float:
    """A worker's `deepserve:<name>` counter for the store tier (summed over other labels)."""
    text = httpx.get(worker.url + "/metrics", headers=worker.headers, timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == f"deepserve:{name}"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("tier") == "store"
    )


def store_hits(worker: rc.Proc) -> float:
    return store_counter(worker, "kv_tier_hits")


def store_errors(stack: Stack) -> float:
    return sum(store_counter(w, "kv_store_errors") for w in (stack.prefill, stack.decode))


def bytes_per_master(cluster: Cluster) -> dict[int, int]:
    """KV bytes each live master holds (STRLEN of every block key it has)."""
    out = {}
    for node in cluster.masters():
        client = node.client()
        out[node.port] = sum(client.strlen(k) for k in client.scan_iter(KEY_PREFIX + "*", 1000))
    return out


def run_load(stack: Stack, tag: str, during=None) -> list[str | None]:
    """LOAD_REQUESTS chats, LOAD_CONCURRENCY at a time; `during` runs once a quarter are done.
    Returns one error string (None: success) per request."""

    def one(i: int) -> str | None:
        try:
            reply = chat(stack, prompt(i, tag))
            return None if reply.choices[0].finish_reason in ("stop", "length") else "no finish"
        except openai.OpenAIError as e:
            return repr(e)

    with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        futures = [pool.submit(one, i) for i in range(LOAD_REQUESTS)]
        if during is not None:
            rc.wait_for(lambda: sum(f.done() for f in futures) >= LOAD_REQUESTS // 4, 120)
            during()
        return [f.result() for f in futures]


@dataclass
class FailedOver:
    errors: list[str | None]  # per request, None for a success
    store_faults: float  # store operations the workers counted as failed during the load


@pytest.fixture(scope="module")
def failed_over(stack: Stack) -> FailedOver:
    """The load with one master SIGKILLed a quarter of the way in; the cluster has failed over
    when this returns."""
    before = store_errors(stack)
    errors = run_load(stack, "kill", during=stack.cluster.kill_master)
    assert stack.cluster.wait_healthy(), "the cluster did not fail over"
    return FailedOver(errors, store_errors(stack) - before)


def test_follow_up_turns_hit_the_prefix_cache_through_the_cluster(stack):
    # As the prefix-cache acceptance flow: each follow-up turn finds most of the previous
    # turn's prompt cached.
    history = [{"role": "user", "content": "Tell me about gardens. " * 12}]
    previous_prompt = 0
    for turn in range(3):
        reply = chat(stack, history, max_tokens=6)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert turn == 0 or cached >= 0.8 * previous_prompt, (turn, cached, previous_prompt)
        previous_prompt = reply.usage.prompt_tokens
        history += [
            {"role": "assistant", "content": reply.choices[0].message.content or "ok"},
            {"role": "user", "content": f"And then, part {turn}?"},
        ]


def test_decode_worker_reads_the_prefill_workers_blocks_from_the_cluster(stack):
    before = store_hits(stack.decode)
    chat(stack, prompt(0, "pd"))
    assert store_hits(stack.decode) > before


def test_kv_bytes_spread_over_all_three_masters(stack):
    assert all(e is None for e in run_load(stack, "spread"))
    per_node = bytes_per_master(stack.cluster)
    print("KV bytes per master:", per_node)
    assert len(per_node) == 3 and all(n > 0 for n in per_node.values()), per_node


def test_killing_a_master_mid_load_fails_no_request(failed_over):
    assert [e for e in failed_over.errors if e is not None] == []


def test_the_killed_masters_faults_were_store_misses(failed_over):
    # The kill did land while the tier was in use: the workers counted failed store operations
    # (turned into misses or skipped writes), yet no request failed (the test above).
    assert failed_over.store_faults > 0


def test_the_tier_hits_again_after_the_failover(stack, failed_over):
    before = store_hits(stack.decode)
    # Right after the failover the store's circuit breaker may still be cooling down (up to its
    # 5 s maximum), skipping the store: a later round must hit it.
    for attempt in range(4):
        assert all(e is None for e in run_load(stack, f"after-{attempt}"))
        if store_hits(stack.decode) > before:
            break
        time.sleep(5)
    assert store_hits(stack.decode) > before
    per_node = bytes_per_master(stack.cluster)
    print("KV bytes per master after the failover:", per_node)
    assert len(per_node) == 3 and all(n > 0 for n in per_node.values()), per_node


async def _publish_until_seen(url: str, index: PrefixIndex, worker: str, timeout: float) -> bool:
    """Publish one block event for `worker` every 0.2 s until the subscriber has applied it."""
    client = async_client(url, socket_timeout=1, socket_connect_timeout=1)
    batch = P.EventBatch(worker, [P.BlockEvent("stored", key=f"{worker}-key", token_ids=[1, 2])])
    message = json.dumps(batch.to_json())
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            # Mid-failover a publish fails: the subscriber sees a later one.
            with contextlib.suppress(OSError, redis.RedisError, RedisClusterException):
                await client.spublish(P.KV_EVENTS_CHANNEL, message)
            if index.held(worker):
                return True
            await asyncio.sleep(0.2)
        return False
    finally:
        await client.aclose()


async def test_event_subscriber_follows_its_shard_through_a_failover():
    with redis_cluster() as cluster:
        index = PrefixIndex()
        subscriber = KVEventSubscriber(cluster.url, index)
        subscriber.start()
        try:
            await asyncio.wait_for(subscriber.ready.wait(), 10)
            assert await _publish_until_seen(cluster.url, index, "before", 10)
            owner = redis.RedisCluster.from_url(cluster.url.replace("+cluster", ""))
            port = owner.get_node_from_key(P.KV_EVENTS_CHANNEL).port
            owner.close()
            victim = next(n for n in cluster.nodes if n.port == port)
            victim.kill()
            assert await _publish_until_seen(cluster.url, index, "after", 30)
        finally:
            await subscriber.stop()
