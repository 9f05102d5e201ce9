"""Protocol details real OpenAI and Anthropic clients rely on, on `deepserve serve` (SmolLM2),
through the official SDKs or raw HTTP: JSON mode, stream usage, stored responses, abort metrics,
Anthropic token counting and the fields that are refused rather than ignored."""

from __future__ import annotations

import json

import pytest
from server_harness import client, server, smollm_engine

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
