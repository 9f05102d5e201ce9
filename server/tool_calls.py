"""Tool calls for chat-template models (the ChatML family), which have no DSML markup.

`tool_choice` picks one of three plans, as vLLM serves them on any model:
- a named function: the output is constrained to that tool's `parameters` schema and is the call's
  `arguments`;
- `"required"`: the output is constrained to a JSON array of `{"name", "arguments"}` objects, one
  branch per tool (`maxItems: 1` when `parallel_tool_calls` is false);
- `"auto"`: no constraint; `<tool_call>...</tool_call>` blocks are parsed out of the text, holding
  a JSON object or a list of them (SmolLM2-Instruct's trained format is a list; Hermes-style
  templates write one object per block). Text outside the blocks stays content.

The model sees the tools too: through its chat template when the template takes `tools`, otherwise
as a short description appended to the system message. The bodies the recipe produced (content
only, tool-call parsing off for this family) are rewritten here into each protocol's calls:
OpenAI `tool_calls`, Anthropic `tool_use` blocks, Responses `function_call` items. Not here: the
streams (server/tool_call_streams.py), DeepSeek's DSML tool calls (the recipe parses those).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field

import deepseek_recipe as dr

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolRequest:
    """What the raw body says about tools that conversion does not keep."""

    named: bool = False  # tool_choice names a function (conversion turns it into "required")
    # Anthropic's {"type": "any"}: a call is required (conversion makes it "auto")
    any_tool: bool = False
    # The client's own parameter schemas by tool name: with `strict: true` conversion rewrites
    # them to OpenAI's strict subset, dropping bounds such as maxLength that xgrammar enforces.
    parameters: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict) -> ToolRequest:
        schemas = {}
        for tool in body.get("tools") or []:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("parameters"), dict):
                schemas[fn.get("name")] = fn["parameters"]
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        # Chat {"type": "function", "function": {...}}, Responses {"type": "function", "name"},
        # Anthropic {"type": "tool", "name"}
        return cls(kind in ("function", "tool"), kind == "any", schemas)

    @staticmethod
    def parallel(body: dict) -> bool:
        """Whether several calls may come at once: OpenAI's `parallel_tool_calls`, Anthropic's
        `tool_choice.disable_parallel_tool_use`."""
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
            return False
        return body.get("parallel_tool_calls", True) is not False


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def as_openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "named" | "required" | "auto"
    tools: tuple[Tool, ...]
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        if self.mode == "named":
            return StructuredOutput("json_schema", json.dumps(self.tools[0].parameters))
        if self.mode == "required":
            return StructuredOutput("json_schema", json.dumps(self.calls_schema()))
        return None

    def calls_schema(self) -> dict:
        """A JSON array of calls, each `{"name": <a tool's name>, "arguments": <its schema>}`."""
        branches, defs = [], {}
        for tool in self.tools:
            params = copy.deepcopy(tool.parameters)
            # A "$ref": "#/$defs/X" resolves against the root, so every tool's $defs move there.
            for name, schema in params.pop("$defs", {}).items():
                if defs.setdefault(name, schema) != schema:
                    raise InvalidRequestError(f"tools define $defs/{name} differently")
            branches.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "arguments": params,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def instructions(self) -> str:
        """The tools and the expected answer, for a template that does not render tools."""
        listed = json.dumps([t.as_openai()["function"] for t in self.tools], ensure_ascii=False)
        head = f"You can call these tools, given as JSON schemas:\n<tools>{listed}</tools>\n"
        if self.mode == "named":
            return head + f"Answer only with the JSON arguments of a call to {self.tools[0].name}."
        example = '[{"name": "tool_name", "arguments": {"argument": "value"}}]'
        if self.mode == "required":
            return head + f"Answer only with a JSON list of tool calls, like {example}."
        return (
            head + f"To call tools, answer with {OPEN}{example}{CLOSE}. "
            "If no tool fits, answer in plain text."
        )


def tool_plan(
    conversation: dr.Conversation, request: ToolRequest, parallel: bool
) -> ToolPlan | None:
    """The plan for a converted request; None when it has no tools or tool_choice is "none"."""
    if conversation.tool_choice == "none" or not conversation.tools:
        return None
    tools = tuple(
        Tool(
            t.name,
            t.description,
            request.parameters.get(t.name) or t.parameters or dict(_ANY_OBJECT),
        )
        for t in conversation.tools
    )
    if conversation.tool_choice == "required" or request.any_tool:
        return ToolPlan("named" if request.named else "required", tools, parallel)
    return ToolPlan("auto", tools, parallel)


def with_tool_instructions(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """Append the plan's instructions to the system message (one is added when there is none)."""
    text = plan.instructions()
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_message(message: dr.Message, template_takes_tools: bool) -> dict:
    """One history message for a chat template.

    A template that renders tools gets the structured fields (`tool_calls` with arguments as an
    object, as HF templates expect, and `tool_call_id`). Otherwise calls are written in the
    `<tool_call>[...]</tool_call>` text they were generated as, and a tool result becomes a user
    turn in `<tool_response>` tags, the form SmolLM2-style ChatML templates are served with.
    """
    role, content = message.role, message.content
    calls = message.tool_calls or []
    if template_takes_tools:
        out: dict = {"role": role, "content": content}
        if calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _loads_or_text(c.arguments)},
                }
                for c in calls
            ]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    if calls:
        listed = [{"name": c.name, "arguments": _loads_or_text(c.arguments)} for c in calls]
        block = OPEN + json.dumps(listed, ensure_ascii=False) + CLOSE
        content = f"{content}\n{block}" if content else block
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


def _loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def protocol_id(call_id: str, prefix: str) -> str:
    """A call's id in another protocol's prefix (`toolu_`, `fc_`), same random part."""
    return prefix + call_id.removeprefix("call_")


class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls, per the plan's mode.

    `feed(text)` and `finish(finish_reason)` return `(content, deltas)`: the text to show as
    content now and OpenAI `delta.tool_calls` entries. `calls` holds the finished calls.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[dict] = []
        self.buffer = ""  # text not yet released: a call being written, or a possible opener
        self.inside = plan.mode != "auto"  # constrained output is all call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            return "", self._named_piece(text)
        self.buffer += text
        if self.plan.mode == "required":
            return "", []
        return self._scan()

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            return "", []
        text, self.buffer = self.buffer, ""
        if not self.inside:
            return text, []
        self.inside = False
        deltas = self._add_calls(text.removeprefix(OPEN))
        if deltas is None:  # not a call after all (cut by max_tokens, or not JSON): keep the text
            return text, []
        return "", deltas

    def _named_piece(self, text: str) -> list[dict]:
        if not self.calls:
            call = _call(self.plan.tools[0].name, text)
            self.calls.append(call)
            return [_delta(0, call)]
        self.calls[0]["function"]["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _scan(self) -> tuple[str, list[dict]]:
        content, deltas = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, OPEN)
                    cut = len(self.buffer) - keep
                    content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    return content, deltas
                content += self.buffer[:at]
                self.buffer = self.buffer[at:]
                self.inside = True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return content, deltas
            block = self.buffer[: end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE) :]
            self.inside = False
            added = self._add_calls(block[len(OPEN) : -len(CLOSE)])
            if added is None:
                content += block
            else:
                deltas += added

    def _add_calls(self, text: str) -> list[dict] | None:
        """Parse a JSON call (or list of calls); None when it is not one."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        if not items or not all(_is_call(i) for i in items):
            return None
        deltas = []
        for item in items:
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            call = _call(item["name"], args)
            deltas.append(_delta(len(self.calls), call))
            self.calls.append(call)
        return deltas


def _is_call(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def _call(name: str, arguments: str) -> dict:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _delta(index: int, call: dict) -> dict:
    return {"index": index, **copy.deepcopy(call)}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (held back, not shown)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def finish_reason(reason: str | None, parser: ToolCallParser) -> str | None:
    return "tool_calls" if parser.calls and reason == "stop" else reason


def rewrite_result(result: dict, plan: ToolPlan) -> None:
    """A collected Chat Completions body: each choice's content becomes content + tool_calls."""
    for choice in result.get("choices") or []:
        message = choice.get("message") or {}
        parser = ToolCallParser(plan)
        shown, _ = parser.feed(message.get("content") or "")
        rest, _ = parser.finish(choice.get("finish_reason"))
        if not parser.calls:
            continue
        message["content"] = (shown + rest) or None
        message["tool_calls"] = parser.calls
        choice["finish_reason"] = finish_reason(choice.get("finish_reason"), parser)


def rewrite_message(result: dict, plan: ToolPlan) -> None:
    """A collected Anthropic Messages body: calls in its text become `tool_use` blocks after
    the text that stays, and `stop_reason` "tool_use"."""
    blocks = result.get("content") or []
    calls, text = _calls_in(plan, "".join(b.get("text", "") for b in blocks if b["type"] == "text"))
    if not calls:
        return
    kept = [b for b in blocks if b["type"] != "text"]
    if text:
        kept.append({"type": "text", "text": text})
    kept += [
        {
            "type": "tool_use",
            "id": protocol_id(c["id"], "toolu_"),
            "name": c["name"],
            "input": c["input"],
        }
        for c in calls
    ]
    result["content"] = kept
    if result.get("stop_reason") == "end_turn":
        result["stop_reason"] = "tool_use"


def rewrite_response(result: dict, plan: ToolPlan) -> None:
    """A collected Responses body: calls in its message text become `function_call` output
    items after the message, which keeps the rest of the text (and is dropped when none is)."""
    items = result.get("output") or []
    messages = [i for i in items if i.get("type") == "message"]
    parts = [p for m in messages for p in m.get("content") or [] if p.get("type") == "output_text"]
    calls, text = _calls_in(plan, "".join(p.get("text", "") for p in parts))
    if not calls:
        return
    kept = [i for i in items if i.get("type") != "message"]
    if text:  # some text came from a message's output_text part
        kept.append({**messages[0], "content": [{**parts[0], "text": text, "logprobs": []}]})
    for c in calls:
        kept.append(
            {
                "type": "function_call",
                "id": protocol_id(c["id"], "fc_"),
                "call_id": c["id"],
                "name": c["name"],
                "arguments": c["arguments"],
                "status": "completed",
            }
        )
    result["output"] = kept


def _calls_in(plan: ToolPlan, text: str) -> tuple[list[dict], str]:
    """The calls in one answer's text, each with its arguments also as an object (`input`),
    and the text left outside them; no calls when any call's arguments are not a JSON object
    (a constrained answer cut by max_tokens): the text then stays as it is."""
    parser = ToolCallParser(plan)
    shown, _ = parser.feed(text)
    rest, _ = parser.finish(None)
    calls = []
    for call in parser.calls:
        fn = call["function"]
        args = _loads_or_text(fn["arguments"])
        if not isinstance(args, dict):
            return [], text
        calls.append(
            {"id": call["id"], "name": fn["name"], "arguments": fn["arguments"], "input": args}
        )
    return calls, shown + rest
