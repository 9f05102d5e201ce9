"""A request the engine cannot run is refused with a 400 that names the limit, before any kernel
runs, and the server keeps serving: a prompt at or over the context limit, and one that fits the
context but not the KV pool (with max_tokens set or left to the engine)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import engine_for, running_server

MODEL = "smollm2-135m"
CONTEXT = 512
POOL_BLOCKS = 16  # x 16 tokens: a pool of 256 tokens, under the context limit


@pytest.fixture(scope="module")
def server():
    limits = dict(max_model_len=CONTEXT, num_kv_blocks=POOL_BLOCKS, max_num_seqs=4)
    with engine_for(MODEL, **limits) as engine, running_server(engine, MODEL) as srv:
        yield srv


def complete(server, n_prompt: int, max_tokens: int | None) -> httpx.Response:
    body = {"model": MODEL, "prompt": [42] * n_prompt, "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)


def assert_refused(r: httpx.Response, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"]


@pytest.mark.parametrize("n_prompt", [CONTEXT, CONTEXT + 1, 4 * CONTEXT])
def test_a_prompt_at_or_over_the_context_limit_is_400(server, n_prompt):
    assert_refused(complete(server, n_prompt, 4), "context limit")


def test_a_prompt_longer_than_the_kv_pool_is_400_with_max_tokens_unset(server):
    assert_refused(complete(server, POOL_BLOCKS * 16 + 10, None), "KV pool")


def test_a_prompt_and_max_tokens_over_the_kv_pool_is_400(server):
    assert_refused(complete(server, 200, 100), "KV pool")


def test_the_server_keeps_serving_after_refusals(server):
    for n in (CONTEXT + 1, POOL_BLOCKS * 16 + 10):
        assert complete(server, n, None).status_code == 400
    r = complete(server, 20, 3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert server.engine.load().waiting == 0
