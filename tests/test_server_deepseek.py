"""The DeepSeek family on tiny-deepseek (random weights, V4 tokenizer): DSML tool calls under the
grammar, the recipe's thinking-mode rules, reasoning output. Checked with the openai SDK."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_harness import engine_for, running_frontend, running_server, running_worker, sdk_client

MODEL = "tiny-deepseek"
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS},
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def engine():
    with engine_for(MODEL) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine, MODEL) as srv:
        yield sdk_client(srv.base_url)


@pytest.fixture(scope="module")
def pd_client(engine):
    """`deepserve frontend` over a prefill and a decode worker (in-process, the same engine):
    the decode worker resumes the grammar after the prefill worker's first token."""
    token = "deepseek-test-token"
    with (
        running_worker(engine, "prefill", token) as prefill,
        running_worker(engine, "decode", token) as decode,
        running_frontend({"prefill": (prefill,), "decode": (decode,)}, MODEL, token) as front,
    ):
        yield sdk_client(front.base_url)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 7)])
def test_required_tool_call_arguments_match_the_schema(client, temperature, seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        seed=seed,
        max_tokens=300,
        extra_body=NO_THINKING,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)


def test_streamed_tool_call_arguments_assemble_to_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=300,
        stream=True,
        extra_body=NO_THINKING,
    )
    args, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(args), PARAMS)


def test_required_tool_choice_in_thinking_mode_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="(?i)thinking"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8
        )


def test_thinking_mode_streams_reasoning_content(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6)
    assert r.choices[0].message.model_extra.get("reasoning_content")
    assert r.usage.completion_tokens_details.reasoning_tokens > 0


def _tool_request(client, tool_choice: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=300,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_THINKING,
        **kwargs,
    )


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tool_request_reports_a_logprob_per_generated_token(client, tool_choice):
    r = _tool_request(client, tool_choice)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for item in content:
        top = [t.logprob for t in item.top_logprobs]
        assert len(top) == 2 and top == sorted(top, reverse=True)
        # Logprobs are the model's own (before the grammar), so the chosen token may rank lower.
        assert item.logprob <= top[0] + 1e-6


def test_tool_call_logprob_tokens_spell_the_call(client):
    choice = _tool_request(client, "required").choices[0]
    text = "".join(i.token for i in choice.logprobs.content)
    (call,) = choice.message.tool_calls
    assert call.function.name in text
    assert json.loads(call.function.arguments)["city"] in text


def test_streamed_tool_call_logprobs_equal_non_stream(client):
    whole = _tool_request(client, "required").choices[0].logprobs.content
    streamed = []
    for chunk in _tool_request(client, "required", stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [i.token for i in streamed] == [i.token for i in whole]
    # A prefix-cache hit may take another reduction order: equal to float noise.
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in whole], abs=1e-4)


def test_responses_tool_request_with_logprobs_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS}],
            top_logprobs=2,
            include=["message.output_text.logprobs"],
            max_output_tokens=8,
            extra_body=NO_THINKING,
        )


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
NAMED = {"type": "function", "function": {"name": "get_weather"}}
THINK_END = 128822  # "</think>" in the V4 tokenizer


def _enum_tools(strict: bool, *, with_other: bool) -> list[dict]:
    fns = [{"name": "get_weather", "description": "Weather", "parameters": ENUM_PARAMS}]
    if with_other:
        fns.append({"name": "get_time", "parameters": {"type": "object", "properties": {}}})
    # The recipe wants every tool strict or none.
    return [{"type": "function", "function": {**fn, "strict": strict}} for fn in fns]


CASES = [("required", True, False), (NAMED, False, True)]  # tool_choice, strict, a second tool


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("tool_choice", "strict", "with_other"), CASES)
def test_enforced_tool_call_arguments_match_the_client_schema(
    client, seed, tool_choice, strict, with_other
):
    # strict: true once let the recipe's strict rewrite drop the integer enum, and strict: false
    # left the arguments free (xgrammar's reading of a non-strict tool).
    _check_enforced_call(client, seed, tool_choice, strict, with_other)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("tool_choice", "strict", "with_other"), CASES)
def test_disaggregated_tool_call_arguments_match_the_client_schema(
    pd_client, seed, tool_choice, strict, with_other
):
    _check_enforced_call(pd_client, seed, tool_choice, strict, with_other)


def _check_enforced_call(client, seed, tool_choice, strict, with_other) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=_enum_tools(strict, with_other=with_other),
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0.7,
        seed=seed,
        max_tokens=400,
        extra_body=NO_THINKING,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), ENUM_PARAMS)


def _parse_after_thinking(client, seed: int, **kwargs):
    # The reasoning is free; a bias on `</think>` makes a random-weight model end it soon.
    return client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        seed=seed,
        max_tokens=400,
        logit_bias={str(THINK_END): 12},
        **kwargs,
    )


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_in_thinking_mode_constrains_the_answer_after_the_reasoning(client, seed):
    r = _parse_after_thinking(client, seed, response_format=Weather)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.model_extra.get("reasoning_content") is not None
    assert isinstance(message.parsed, Weather)


def test_disaggregated_json_schema_in_thinking_mode_parses(pd_client):
    r = _parse_after_thinking(pd_client, 1, response_format=Weather)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Weather)


def test_regex_in_thinking_mode_constrains_the_content(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        seed=4,
        max_tokens=400,
        logit_bias={str(THINK_END): 12},
        response_format={"type": "regex", "regex": "(Paris|Rome) in [1-3] days"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert re.fullmatch("(Paris|Rome) in [1-3] days", choice.message.content)
