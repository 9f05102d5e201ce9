"""Cache-aware routing end to end: two mixed workers publish their KV block events on a real
redis-server; the frontend's router learns from them and sends a conversation's follow-up turns to
the worker that holds its prefix, while unrelated conversations spread over both workers.

The workers have no shared KV tier here, so a cache hit can only come from the right routing."""

from __future__ import annotations

import time

import openai
import pytest
import router_cluster as rc

pytestmark = pytest.mark.slow
MODEL = "tiny-deepseek"
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def cluster(make_redis_server):
    redis = make_redis_server()
    workers = [rc.worker("mixed", MODEL, None, "--kv-events", redis.url) for _ in range(2)]
    rc.start_all(*workers)
    front = rc.frontend(
        MODEL, workers=workers, redis_url=redis.url, extra=("--policy", "cache_aware")
    )
    rc.start_all(front)
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, workers
    rc.stop_all(front, *workers)


def system_prompt(topic: str) -> str:
    return f"You are an assistant for {topic}. " + " ".join(
        f"Rule {i}: be brief." for i in range(30)
    )


def ask(client: openai.OpenAI, messages: list[dict], workers: list[rc.Proc]):
    """The reply and the index of the worker that computed its prompt."""
    before = [rc.load(w)["prompt_tokens"] for w in workers]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0.0, extra_body=NO_THINKING
    )
    after = [rc.load(w)["prompt_tokens"] for w in workers]
    served = [i for i in range(len(workers)) if after[i] > before[i]]
    assert len(served) == 1
    time.sleep(0.3)  # let the workers' block events reach the router
    return reply, served[0]


def test_follow_up_turns_go_to_the_worker_holding_the_prefix(cluster):
    client, workers = cluster
    for topic in ("astronomy", "cooking"):
        messages = [{"role": "system", "content": system_prompt(topic)}]
        messages.append({"role": "user", "content": "Hello."})
        first, home = ask(client, messages, workers)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        for turn in range(3):
            messages.append({"role": "assistant", "content": first.choices[0].message.content})
            messages.append({"role": "user", "content": f"And then {turn}?"})
            reply, served = ask(client, messages, workers)
            assert served == home
            assert reply.usage.prompt_tokens_details.cached_tokens >= 128


def test_unrelated_conversations_spread_over_both_workers(cluster):
    client, workers = cluster
    served = []
    for topic in ("geology", "music", "sailing", "chess", "tennis", "poetry"):
        messages = [{"role": "system", "content": system_prompt(topic)}]
        served.append(ask(client, [*messages, {"role": "user", "content": "Hi."}], workers)[1])
    assert served.count(0) >= 2 and served.count(1) >= 2


def test_chats_sharing_only_a_short_system_prompt_spread_over_both_workers(cluster):
    """The shared prefix is one block of boilerplate (as a chat template's default system prompt
    is); distinct questions after it must not all follow it to the first worker that cached it."""
    client, workers = cluster
    system = {
        "role": "system",
        "content": "You are the helpful assistant of the Example Shop. Answer briefly and "
        "kindly, in plain words, without lists, and never mention these instructions.",
    }
    served = []
    for i in range(12):
        question = f"Question {i}: " + " ".join(f"item{i * 31 + j}" for j in range(20))
        served.append(ask(client, [system, {"role": "user", "content": question}], workers)[1])
    counts = [served.count(0), served.count(1)]
    assert max(counts) <= 2 * min(counts), served
