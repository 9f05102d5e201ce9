"""The DeepSeek family on tiny-deepseek (random weights, V4 tokenizer): DSML tool calls under the
grammar, the recipe's thinking-mode rules, reasoning output. Checked with the openai SDK."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import engine_for, running_server

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
def client():
    with engine_for(MODEL) as engine, running_server(engine, MODEL) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


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
