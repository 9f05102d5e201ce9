"""Faults in a disaggregated cluster of real processes (2 prefill + 2 decode workers, a frontend,
a redis-server): aborts free the KV on both workers, 4xx storms eject nobody, and a worker killed
with SIGKILL during 32 concurrent streams fails no stream (those it was serving resume on the
other worker, never first sent back to the dead one), is routed around, and is re-admitted once
restarted."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
import router_cluster as rc

from deepserve.disagg import protocol as P
from deepserve.disagg.errors import WorkerRejectedError
from deepserve.disagg.flow import GenerationFlow
from deepserve.engine.sampling_params import SamplingParams
from deepserve.router.pool import HealthPolicy
from deepserve.router.router import Router, RouterConfig

pytestmark = pytest.mark.slow
MODEL = "tiny-deepseek"
STREAM_TIMEOUT_S = 90.0
NO_THINKING = {"thinking": {"type": "disabled"}}


@dataclass
class Cluster:
    front: rc.Proc
    prefill: list[rc.Proc]
    decode: list[rc.Proc]

    @property
    def workers(self) -> list[rc.Proc]:
        return [*self.prefill, *self.decode]


@pytest.fixture(scope="module")
def cluster(make_redis_server):
    redis = make_redis_server()
    common = ("--max-num-seqs", "32")
    # Small prefill chunks make a long prompt's prefill last long enough to abort it midway.
    prefill = [
        rc.worker("prefill", MODEL, redis.url, *common, "--max-num-batched-tokens", "64")
        for _ in range(2)
    ]
    decode = [rc.worker("decode", MODEL, redis.url, *common) for _ in range(2)]
    rc.start_all(*prefill, *decode)
    front = rc.frontend(
        MODEL,
        prefill=prefill,
        decode=decode,
        redis_url=redis.url,
        extra=(
            "--policy", "round_robin", "--eject-after", "2", "--readmit-after", "2",
            "--health-interval", "0.3", "--token-timeout", "10", "--first-token-timeout", "60",
        ),
    )  # fmt: skip
    rc.start_all(front)
    yield Cluster(front, prefill, decode)
    rc.stop_all(front, *prefill, *decode)


@dataclass
class StreamResult:
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    first_chunk_at: float | None = None


async def stream_chat(
    http: httpx.AsyncClient, url: str, content: str, max_tokens: int, result: StreamResult
) -> StreamResult:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        **NO_THINKING,
    }
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            result.error = f"status {resp.status_code}: {(await resp.aread())[:200]!r}"
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                result.error = data["error"]["message"]
                continue
            for choice in data.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    result.chunks += 1
                    result.first_chunk_at = result.first_chunk_at or time.monotonic()
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return result


def chat_ok(front: rc.Proc, content: str, max_tokens: int = 4) -> bool:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **NO_THINKING,
    }
    r = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=60)
    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None


def kv_free_everywhere(cluster: Cluster) -> bool:
    return all(rc.load(w)["kv_usage"] == 0 for w in cluster.workers)


def running(workers: list[rc.Proc]) -> int:
    return sum(rc.load(w)["running"] for w in workers)


# ---- aborts -----------------------------------------------------------------------------------


async def abort_when(cluster: Cluster, content: str, max_tokens: int, ready) -> bool:
    """Open a stream, and drop the connection as soon as `ready()` says the moment has come.
    False when the stream ended before that moment was seen (a loaded host can finish a short
    prefill between two polls)."""
    result = StreamResult()
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S) as http:
        task = asyncio.create_task(
            stream_chat(http, cluster.front.url, content, max_tokens, result)
        )
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(ready, result):
            if task.done():
                assert result.error is None, result.error
                return False
            assert time.monotonic() < deadline, "never reached the abort point"
            await asyncio.sleep(0.01)
        task.cancel()  # closes the client's connection: the frontend sees a disconnect
        await asyncio.gather(task, return_exceptions=True)
    return True


def abort_in_some_attempt(cluster: Cluster, prompt, max_tokens: int, ready) -> None:
    """`abort_when` on fresh prompts (no prefix-cache hit shortens the next) until one aborts."""
    for attempt in range(5):
        if asyncio.run(abort_when(cluster, prompt(attempt), max_tokens, ready)):
            return
    raise AssertionError("every stream ended before the abort point")


def test_abort_during_prefill_leaves_no_kv_on_either_worker(cluster):
    def long_prompt(attempt: int) -> str:
        return f"attempt{attempt} " + " ".join(f"word{i}" for i in range(700))

    abort_in_some_attempt(cluster, long_prompt, 50, lambda r: running(cluster.prefill) > 0)
    assert rc.wait_for(lambda: kv_free_everywhere(cluster), 10)
    assert running(cluster.workers) == 0


def test_abort_during_decode_leaves_no_kv_on_either_worker(cluster):
    def decoding(result: StreamResult) -> bool:
        return result.chunks >= 3 and running(cluster.decode) > 0

    abort_in_some_attempt(cluster, lambda i: f"Tell me a long story, number {i}.", 1000, decoding)
    assert rc.wait_for(lambda: kv_free_everywhere(cluster), 10)
    assert running(cluster.workers) == 0


# ---- 4xx storms -------------------------------------------------------------------------------


def test_4xx_storm_through_the_router_never_ejects_a_worker(cluster):
    async def storm() -> Router:
        urls = {"decode": tuple(w.url for w in cluster.decode)}
        config = RouterConfig(workers=urls, internal_token=rc.TOKEN, health=HealthPolicy(1, 1))
        router = Router(config)
        await router.health.probe_all()
        for i in range(40):  # token ids outside the vocabulary: the worker answers 400
            bad = P.GenerateRequest(f"bad-{i}", [10**9], {"max_tokens": 2})
            with pytest.raises(WorkerRejectedError):
                async for _ in router.stream("decode", bad):
                    pass
        good = P.GenerateRequest("good", [5, 6, 7], {"max_tokens": 2})
        assert [ev async for ev in router.stream("decode", good)][-1].finished
        await router.close()
        return router

    router = asyncio.run(storm())
    assert all(w.healthy and w.consecutive_failures == 0 for w in router.pool.workers())


def test_4xx_storm_through_the_frontend_leaves_every_worker_serving(cluster):
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 40}
    for _ in range(20):  # n beyond the workers' max_num_seqs: only the worker can tell
        r = httpx.post(cluster.front.url + "/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400, r.text
    before = [rc.load(w)["prompt_tokens"] for w in cluster.decode]
    assert all(chat_ok(cluster.front, f"Question {i}") for i in range(6))
    after = [rc.load(w)["prompt_tokens"] for w in cluster.decode]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # both served


# ---- SIGKILL during 32 concurrent streams -----------------------------------------------------


async def streams_with_kill(cluster: Cluster, victim: rc.Proc, kill_when) -> list[StreamResult]:
    """32 concurrent streams; SIGKILL `victim` once `kill_when(results)`; every stream's result."""
    results = [StreamResult() for _ in range(32)]
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S, limits=limits) as http:
        tasks = [
            asyncio.create_task(
                asyncio.wait_for(
                    stream_chat(http, cluster.front.url, f"Story {i}, please.", 48, r),
                    STREAM_TIMEOUT_S,
                )
            )
            for i, r in enumerate(results)
        ]
        deadline = time.monotonic() + 60
        while not kill_when(results) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(victim.kill, signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes  # none hung
    return results


def restart_and_wait_readmitted(cluster: Cluster, victim: rc.Proc) -> None:
    victim.start().wait_ready()
    assert rc.wait_for(
        lambda: chat_ok(cluster.front, "Back?") and rc.load(victim)["prompt_tokens"] > 0, 30, 0.2
    ), "restarted worker never served again"


def check_after_kill(cluster: Cluster, results: list[StreamResult]) -> None:
    failed = [r for r in results if r.error or not r.finish_reason]
    assert not failed, failed  # retried before their first token or resumed after it
    assert all(chat_ok(cluster.front, f"After {i}") for i in range(8))


def resumed_streams(front: rc.Proc, victim: rc.Proc) -> tuple[set[str], set[str]]:
    """From the frontend's log: the requests resumed after a worker died mid-stream, and those
    of them whose resume was first sent to `victim` (the router logs each failed try)."""
    text = front.log.read_text(errors="replace")
    resumed = set(re.findall(r"(\S+) died mid-stream, resuming", text))
    sent_back = {rid for rid in resumed if f"request {rid} failed on {victim.url}" in text}
    return resumed, sent_back


def test_killed_decode_worker_fails_no_stream_and_is_readmitted(cluster):
    victim = cluster.decode[0]

    def mid_decode(results: list[StreamResult]) -> bool:
        return sum(r.chunks >= 2 for r in results) >= 4 and rc.load(victim)["running"] > 0

    check_after_kill(cluster, asyncio.run(streams_with_kill(cluster, victim, mid_decode)))
    resumed, sent_back = resumed_streams(cluster.front, victim)
    assert resumed, "the kill caught no stream mid-decode"
    assert not sent_back, f"resumed on the worker that had just died: {sent_back}"
    restart_and_wait_readmitted(cluster, victim)


def test_a_resumed_stream_is_never_sent_back_to_the_worker_that_died(cluster):
    # Cache-aware routing remembers where the prompt went: without avoiding the dead worker, the
    # resume (same prompt) would be routed straight back to it and wait for a refused connect.
    async def stream_and_kill() -> tuple[Router, rc.Proc, list]:
        urls = {
            "prefill": tuple(w.url for w in cluster.prefill),
            "decode": tuple(w.url for w in cluster.decode),
        }
        config = RouterConfig(
            workers=urls, internal_token=rc.TOKEN, policy="cache_aware", health=HealthPolicy(9, 1)
        )
        router = Router(config)
        await router.health.probe_all()
        flow = GenerationFlow(router, max_model_len=2048)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        events, victim = [], None
        async for ev in flow.stream("resume-once", list(range(1000, 1064)), params):
            events.append(ev)
            if len(events) == 3:
                (url,) = [u for u, role in router.stats.decisions if role == "decode"]
                victim = next(w for w in cluster.decode if w.url == url)
                await asyncio.to_thread(victim.kill, signal.SIGKILL)
        await router.close()
        return router, victim, events

    router, victim, events = asyncio.run(stream_and_kill())
    assert events[-1].finished
    assert sum(len(o["token_ids"]) for ev in events for o in ev.outputs) == 400
    decode_picks = {u: n for (u, role), n in router.stats.decisions.items() if role == "decode"}
    assert decode_picks == {victim.url: 1, **{w.url: 1 for w in cluster.decode if w is not victim}}
    restart_and_wait_readmitted(cluster, victim)


def test_killed_prefill_worker_fails_no_stream_and_is_readmitted(cluster):
    victim = cluster.prefill[0]

    def mid_prefill(results: list[StreamResult]) -> bool:
        return rc.load(victim)["running"] > 0

    check_after_kill(cluster, asyncio.run(streams_with_kill(cluster, victim, mid_prefill)))
    restart_and_wait_readmitted(cluster, victim)
