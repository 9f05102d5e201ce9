"""Protocol details real OpenAI and Anthropic clients rely on, on `deepserve serve` (SmolLM2),
through the official SDKs or raw HTTP: JSON mode, stream usage, stored responses, abort metrics,
Anthropic token counting and the fields that are refused rather than ignored."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import client, server, smollm_engine, wait_until

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Say hello."}]
CAT = [{"role": "user", "content": "Describe a cat as JSON."}]

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_object_response_is_an_object(client, seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAT,
        seed=seed,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    choice = r.choices[0]
    if choice.finish_reason == "length":
        assert choice.message.content.startswith("{")
    else:
        assert isinstance(json.loads(choice.message.content), dict)


def _chat_stream(client, **kwargs) -> list:
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=5, stream=True, **kwargs
    )
    return list(stream)


def test_stream_without_include_usage_carries_no_usage(client):
    chunks = _chat_stream(client)
    assert chunks and all(c.usage is None for c in chunks)


def test_stream_usage_comes_in_a_final_chunk_without_choices(client):
    chunks = _chat_stream(client, stream_options={"include_usage": True})
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None and c.choices for c in body)


def _aborted(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("request_success_total") and s.labels.get("finished_reason") == (
                "abort"
            ):
                return s.value
    return 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_cut_by_the_client_counts_as_abort(server, path):
    before = _aborted(server.base_url)
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True}
    body |= {"messages": HELLO} if path.endswith("chat/completions") else {"prompt": "Hello"}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as s:
        lines = s.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_until(lambda: _aborted(server.base_url) == before + 1, timeout=10)
