"""Tool calls on a ChatML model (SmolLM2) through Chat Completions, with the official openai SDK:
named and required tool_choice under a JSON constraint, "auto" parsed from `<tool_call>` blocks,
"none", and tool results in the history."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI
from server_harness import client, server, smollm_engine

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CALC = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 30}},
    "required": ["expression"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression",
            "parameters": CALC,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "calculate": CALC}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Forces the text a tool-calling model writes, so "auto" parsing is checked whatever 135M would say.
AUTO_TEXT = r'Let me check\. <tool_call>\[\{"name": "get_weather", "arguments": \{"city": "Paris", "days": 3\}\}\]</tool_call>'  # noqa: E501

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


def ask(client: OpenAI, **kwargs):
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    return client.chat.completions.create(**{**args, **kwargs})


def streamed(client: OpenAI, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) assembled from the deltas."""
    content, calls, finish = "", {}, None
    for chunk in ask(client, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    return content, calls, finish


def test_named_tool_choice_arguments_validate_against_the_schema(client):
    choice = ask(client, tool_choice=NAMED).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert choice.message.content is None


def test_named_tool_choice_finishes_with_tool_calls(client):
    assert ask(client, tool_choice=NAMED).choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_calls_one_of_two_tools_with_valid_arguments(client):
    choice = ask(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_without_parallel_calls_gives_exactly_one_call(client):
    choice = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_tool_call_equals_non_stream_at_temperature_zero(client, tool_choice):
    whole = ask(client, tool_choice=tool_choice).choices[0]
    content, calls, finish = streamed(client, tool_choice=tool_choice)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert finish == "tool_calls" and content == ""


def test_auto_parses_tool_call_block_and_keeps_text_as_content(client):
    choice = ask(client, extra_body={"structured_outputs": {"regex": AUTO_TEXT}}).choices[0]
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.finish_reason == "tool_calls"


def test_auto_stream_holds_back_the_tool_call_block(client):
    content, calls, finish = streamed(
        client, extra_body={"structured_outputs": {"regex": AUTO_TEXT}}
    )
    assert content == "Let me check. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    assert finish == "tool_calls"


def test_auto_without_a_tool_call_answers_with_text(client):
    choice = ask(client, tool_choice="auto", max_tokens=12).choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_tools_are_rendered_into_the_prompt(client):
    with_tools = ask(client, tool_choice="auto", max_tokens=1).usage.prompt_tokens
    without = ask(client, tool_choice="none", max_tokens=1).usage.prompt_tokens
    assert with_tools > without + 40


def test_tool_choice_none_answers_plain_text(client):
    plain = ask(client, tool_choice="none", max_tokens=8, extra_body={"ignore_eos": True})
    choice = plain.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason == "length"


def test_conversation_with_a_tool_result_renders_and_answers(client):
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    choice = ask(client, messages=history, max_tokens=12).choices[0]
    assert choice.message.content or choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length", "tool_calls")


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
NAMED_RESPONSES = {"type": "function", "name": "get_weather"}
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


@pytest.fixture(scope="module")
def claude(server) -> Anthropic:
    return Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def ask_claude(claude: Anthropic, **kwargs):
    args = {"model": MODEL, "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 60}
    return claude.messages.create(**{**args, "extra_body": {"temperature": 0}, **kwargs})


def test_messages_tool_choice_any_answers_with_a_valid_tool_use_block(claude):
    message = ask_claude(claude, tool_choice={"type": "any"})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_messages_named_tool_gives_that_tools_input(claude):
    message = ask_claude(claude, tool_choice={"type": "tool", "name": "calculate"})
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "calculate"
    jsonschema.validate(use.input, CALC)


def test_messages_tool_result_turn_is_answered(claude):
    first = ask_claude(claude, tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    history = [*ASK, {"role": "assistant", "content": first.content}]
    answer = ask_claude(claude, messages=[*history, {"role": "user", "content": [result]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_responses_required_tool_choice_gives_function_call_items(client):
    response = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS, tool_choice="required",
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and calls
    for call in calls:
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_responses_function_call_output_continues_a_stored_response(client):
    first = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS, store=True,
        tool_choice=NAMED_RESPONSES, max_output_tokens=60,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[output], tools=RESPONSES_TOOLS,
        max_output_tokens=12,
    )  # fmt: skip
    assert answer.output_text


@pytest.mark.parametrize(
    "tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["named", "any"]
)
def test_streamed_messages_tool_use_equals_non_stream(claude, tool_choice):
    args = dict(model=MODEL, messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=60,
                tool_choice=tool_choice, extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in types and streamed.stop_reason == whole.stop_reason == "tool_use"
    assert _blocks(streamed) == _blocks(whole)


def _blocks(message) -> list[tuple]:
    return [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in message.content]


@pytest.mark.parametrize("tool_choice", [NAMED_RESPONSES, "required"], ids=["named", "required"])
def test_streamed_responses_function_calls_equal_non_stream(client, tool_choice):
    args = dict(model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                tool_choice=tool_choice, temperature=0, max_output_tokens=60)  # fmt: skip
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types
    assert _calls(streamed) == _calls(whole) != []


def test_a_streamed_stored_function_call_is_continued_by_its_output(client):
    with client.responses.stream(
        model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS, tool_choice=NAMED_RESPONSES,
        max_output_tokens=60, store=True,
    ) as stream:  # fmt: skip
        first = stream.get_final_response()
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[output], max_output_tokens=12
    )
    assert answer.output_text


def _calls(response) -> list[tuple]:
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


def test_named_tool_choice_with_an_unknown_name_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_required_tool_choice_with_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        ask(client, tool_choice="required", response_format={"type": "json_object"})
