"""tiny-deepseek-v4 (the V4 architecture: hybrid compressed attention, hyper-connections, hash MoE;
random weights, V4 tokenizer) through `deepserve serve` over HTTP, checked with the openai SDK:
reasoning, streaming, /v1/responses, an enforced DSML tool call, and a chat's second turn whose
prefix-cache hit gives the tokens a cold server gives."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_harness import engine_for, running_server, sdk_client

MODEL = "tiny-deepseek-v4"
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NO_THINKING = {"thinking": {"type": "disabled"}}
# Enum-bounded: a random-weight model closes an unbounded string or number only by chance.
ENUM_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": ENUM_PARAMS},
    }
]
# Long enough that the first turn fills whole KV blocks past the window (64) and closes many
# compressed groups, so the second turn resumes from cached V4 rows, not from scratch.
FIRST = [
    {"role": "system", "content": "You are a terse weather assistant. " * 12},
    {"role": "user", "content": "Describe the weather in Paris, Rome and Oslo this week."},
]


@pytest.fixture(scope="module")
def engine():
    with engine_for(MODEL) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine, MODEL) as srv:
        yield sdk_client(srv.base_url)


def test_thinking_mode_answers_with_reasoning_content(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6)
    assert r.choices[0].message.model_extra.get("reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    assert r.usage.completion_tokens == 6


def test_streamed_chat_equals_the_whole_answer(client):
    args = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**args).choices[0].message.content
    pieces = [
        c.delta.content or ""
        for chunk in client.chat.completions.create(**args, stream=True)
        for c in chunk.choices
    ]
    assert len(pieces) > 1
    assert "".join(pieces) == whole


def test_responses_in_thinking_mode_returns_a_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
    (item,) = r.output
    assert item.type == "reasoning"
    assert item.content[0].text
    assert r.usage.output_tokens == 8


def test_responses_without_reasoning_returns_output_text(client):
    r = client.responses.create(
        model=MODEL,
        input="Say hello.",
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text
    assert r.usage.output_tokens == 8


def test_required_tool_call_arguments_match_the_schema(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=300,
        extra_body=NO_THINKING,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), ENUM_PARAMS)


def _second_turn(client) -> tuple[list[str], int]:
    """Turn one, then turn two over it: (turn two's tokens, its cached prompt tokens)."""
    greedy = dict(model=MODEL, temperature=0, max_tokens=16, extra_body=NO_THINKING)
    first = client.chat.completions.create(messages=FIRST, **greedy).choices[0].message.content
    turn = [
        *FIRST,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And Oslo?"},
    ]
    r = client.chat.completions.create(messages=turn, logprobs=True, **greedy)
    cached = (
        (r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details else 0
    )
    return [t.token for t in r.choices[0].logprobs.content], cached


def test_second_turn_prefix_hit_gives_the_cold_tokens(client):
    warm, cached = _second_turn(client)
    assert cached > 0
    with (
        engine_for(MODEL, enable_prefix_caching=False) as cold_engine,
        running_server(cold_engine, MODEL) as srv,
    ):
        cold, cold_cached = _second_turn(sdk_client(srv.base_url))
    assert cold_cached == 0
    assert warm == cold
