"""`cache_salt` and salting by API key through the frontend, prefill/decode disaggregated: the
salt reaches both workers and the shared Redis tier, so a probe under another salt or key finds
nothing cached on any replica, while the owner's own repeat still hits."""

from __future__ import annotations

import httpx
import pytest
import router_cluster as rc

pytestmark = pytest.mark.slow
MODEL = "tiny-deepseek"
SECRET = "Payroll export for the Lisbon office, account 88-1943, due Friday. " * 5


@pytest.fixture(scope="module")
def front(make_redis_server):
    redis = make_redis_server()
    prefill = [rc.worker("prefill", MODEL, redis.url) for _ in range(2)]
    decode = rc.worker("decode", MODEL, redis.url)
    rc.start_all(*prefill, decode)
    keys = ("--api-key", "key-a", "--api-key", "key-b", "--cache-salt-by-api-key")
    frontend = rc.frontend(MODEL, prefill=prefill, decode=[decode], redis_url=redis.url, extra=keys)
    rc.start_all(frontend)
    yield frontend
    rc.stop_all(frontend, *prefill, decode)


def cached_tokens(front: rc.Proc, text: str, key: str, salt: str | None = None) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "thinking": {"type": "disabled"},
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(
        front.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_salt_finds_nothing_on_any_replica(front):
    secret = f"salted {SECRET}"
    cached_tokens(front, secret, "key-a", salt="victim")
    for _ in range(3):  # whichever prefill worker takes it, with the store behind both
        assert cached_tokens(front, secret, "key-a", salt="attacker") == 0
    assert cached_tokens(front, secret, "key-a", salt="victim") > 0


def test_another_key_finds_nothing_on_any_replica(front):
    secret = f"keyed {SECRET}"
    cached_tokens(front, secret, "key-a")
    for _ in range(3):
        assert cached_tokens(front, secret, "key-b") == 0
    assert cached_tokens(front, secret, "key-a") > 0
