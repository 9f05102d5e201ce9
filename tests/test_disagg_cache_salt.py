"""`cache_salt` and salting by API key through the frontend, prefill/decode disaggregated: the
salt reaches both workers and the shared Redis tier, so a probe under another salt or key finds
nothing cached on any replica, while the owner's own repeat still hits."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import router_cluster as rc

pytestmark = pytest.mark.slow
MODEL = "tiny-deepseek"
SECRET = "Payroll export for the Lisbon office, account 88-1943, due Friday. " * 5


@dataclass
class Stack:
    frontend: rc.Proc
    prefill: list[rc.Proc]  # their counters show what a prefill found in its caches


@pytest.fixture(scope="module")
def stack(make_redis_server):
    redis = make_redis_server()
    prefill = [rc.worker("prefill", MODEL, redis.url) for _ in range(2)]
    decode = rc.worker("decode", MODEL, redis.url)
    rc.start_all(*prefill, decode)
    keys = ("--api-key", "key-a", "--api-key", "key-b", "--cache-salt-by-api-key")
    frontend = rc.frontend(MODEL, prefill=prefill, decode=[decode], redis_url=redis.url, extra=keys)
    rc.start_all(frontend)
    yield Stack(frontend, prefill)
    rc.stop_all(frontend, *prefill, decode)


def cached_tokens(stack: Stack, text: str, key: str, salt: str | None = None, n: int = 1) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "n": n,
        "thinking": {"type": "disabled"},
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(
        stack.frontend.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_salt_finds_nothing_on_any_replica(stack):
    secret = f"salted {SECRET}"
    cached_tokens(stack, secret, "key-a", salt="victim")
    # Each probe under a salt of its own (a repeat would hit its own blocks); whichever prefill
    # worker takes it, the store is behind both.
    for i in range(3):
        assert cached_tokens(stack, secret, "key-a", salt=f"attacker {i}") == 0
    assert cached_tokens(stack, secret, "key-a", salt="victim") > 0


def test_another_key_finds_nothing_on_any_replica(stack):
    secret = f"keyed {SECRET}"
    cached_tokens(stack, secret, "key-a")
    assert cached_tokens(stack, secret, "key-b") == 0
    for i in range(2):  # more probes from key b, each in a namespace of its own
        assert cached_tokens(stack, secret, "key-b", salt=f"probe {i}") == 0
    assert cached_tokens(stack, secret, "key-a") > 0


def prefill_hits(stack: Stack) -> int:
    return sum(rc.load(w)["cache_hit_tokens"] for w in stack.prefill)


def prefill_hits_of(stack: Stack, text: str, salt: str) -> int:
    before = prefill_hits(stack)
    cached_tokens(stack, text, "key-a", salt=salt, n=2)
    return prefill_hits(stack) - before


def test_a_salt_holds_when_the_decode_worker_samples_every_token(stack):
    # n > 1 cannot resume after the prefill worker's token: the prefill worker only moves the KV,
    # and the usage reports the decode worker's load of it. What the prefill worker found in
    # its caches is the signal a probe would time.
    secret = f"several samples {SECRET}"
    prefill_hits_of(stack, secret, "victim")
    assert prefill_hits_of(stack, secret, "attacker") == 0
    assert prefill_hits_of(stack, secret, "victim") > 0
