"""server/tool_calls.py without a model: the `<tool_call>` parser fed in pieces, the required-call
schema, and how ChatMLFamily renders tools and tool history into a chat template."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from deepserve.engine.errors import InvalidRequestError
from deepserve.server.family import ChatMLFamily
from deepserve.server.tool_calls import Tool, ToolCallParser, ToolPlan, ToolRequest

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}}
AUTO = ToolPlan("auto", (Tool("f", None, OBJ),))


def parse_in_pieces(plan: ToolPlan, text: str, size: int = 1) -> tuple[str, list[dict]]:
    parser, content = ToolCallParser(plan), ""
    for i in range(0, len(text), size):
        content += parser.feed(text[i : i + size])[0]
    content += parser.finish("stop")[0]
    return content, parser.calls


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_splits_text_and_a_listed_call_however_the_text_arrives(size):
    text = 'Hi <tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call> bye'
    content, calls = parse_in_pieces(AUTO, text, size)
    assert content == "Hi  bye"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1})
    ]
    assert calls[0]["id"].startswith("call_")


def test_auto_reads_one_object_per_block_as_hermes_templates_write_it():
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'  # noqa: E501
    content, calls = parse_in_pieces(AUTO, text)
    assert content == ""
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {"x": 2}]


def test_auto_releases_a_partial_opener_that_does_not_complete():
    assert parse_in_pieces(AUTO, "a <tool_cal b") == ("a <tool_cal b", [])


def test_auto_keeps_a_block_that_is_not_json_as_content():
    text = "x <tool_call>not json</tool_call> y"
    assert parse_in_pieces(AUTO, text) == (text, [])


def test_auto_keeps_an_unclosed_cut_off_block_as_content():
    text = 'x <tool_call>[{"name": "f", "argu'
    assert parse_in_pieces(AUTO, text) == (text, [])


def test_named_streams_every_piece_as_arguments_of_one_call():
    plan = ToolPlan("named", (Tool("f", None, OBJ),))
    parser = ToolCallParser(plan)
    first = parser.feed('{"x"')[1]
    second = parser.feed(": 1}")[1]
    assert first[0]["function"] == {"name": "f", "arguments": '{"x"'}
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert parser.calls[0]["function"]["arguments"] == '{"x": 1}'


def test_required_schema_has_one_branch_per_tool_and_hoists_defs():
    a = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": OBJ}}
    plan = ToolPlan("required", (Tool("a", None, a), Tool("b", None, OBJ)), parallel=False)
    schema = plan.calls_schema()
    names = [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert schema["$defs"] == {"P": OBJ} and schema["maxItems"] == 1 and schema["minItems"] == 1
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]


def test_required_schema_refuses_conflicting_defs():
    a = {"type": "object", "$defs": {"P": {"type": "integer"}}}
    b = {"type": "object", "$defs": {"P": {"type": "string"}}}
    with pytest.raises(InvalidRequestError):
        ToolPlan("required", (Tool("a", None, a), Tool("b", None, b))).calls_schema()


def _family(template: str) -> ChatMLFamily:
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return ChatMLFamily(tok, "m", template)


HISTORY = {
    "model": "m",
    "messages": [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": OBJ}}],
}


def _render(family: ChatMLFamily) -> str:
    conv = dr.ChatCompletionRequest(json.loads(json.dumps(HISTORY))).convert(
        family.conversion_options
    )
    plan = family.prepare(conv, True, ToolRequest()).tools
    return family.render(conv.conversation, plan)


def test_template_that_takes_tools_gets_them_and_structured_tool_calls():
    template = (
        "{{ tools | map(attribute='function.name') | join(',') }}|"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.x }}{% endfor %}"
        "{{ m.tool_call_id or '' }};{% endfor %}"
    )
    assert _render(_family(template)) == "f|user:weather?;assistant:1;tool:sunnycall_1;"


def test_template_without_tools_gets_them_in_the_system_message():
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    text = _render(_family(template))
    assert text.startswith("[system]You can call these tools") and '"name": "f"' in text
    assert '[assistant]<tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>' in text
    assert "[user]<tool_response>\nsunny\n</tool_response>" in text
