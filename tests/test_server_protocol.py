"""Protocol details real OpenAI and Anthropic clients rely on, on `deepserve serve` (SmolLM2),
through the official SDKs or raw HTTP: JSON mode, stream usage, stored responses, abort metrics,
Anthropic token counting and the fields that are refused rather than ignored."""

from __future__ import annotations

import json

import pytest
from server_harness import client, server, smollm_engine

MODEL = "smollm2-135m"
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
