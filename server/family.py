"""Model families: the model-specific half of serving a chat request.

A family turns a converted recipe `ConversationRequest` into prompt token ids, says how the output
is parsed (`ParsingOptions`) and which output constraint the engine enforces. `DeepSeekFamily`
renders with deepseek-recipe's V4 / V4.1 encodings and parses reasoning and DSML tool calls;
`ChatMLFamily` (SmolLM2, Qwen2 / R1-Distill, DeepSeek-V2 and other HF chat models) renders with the
model's own chat template and parses text, with R1-style reasoning where the template opens a think
block (server/reasoning.py) and tool calls from server/tool_calls.py. Not here: protocol request/response
handling (server/chat_routes.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import deepseek_recipe as dr
from jinja2 import meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from deepserve.engine.errors import InvalidRequestError, UnsupportedModelError
from deepserve.engine.sampling_params import StructuredOutput, after_reasoning
from deepserve.server.reasoning import THINK_END, THINK_START, template_parsing
from deepserve.server.tool_calls import (
    ToolPlan,
    ToolRequest,
    template_message,
    tool_plan,
    with_tool_instructions,
)

# Preparing a request this small (render, encode with `encode_text`, validate) takes a fraction of
# a millisecond, less than handing it to a thread and back; larger bodies go to a thread so the loop
# never waits long.
INLINE_PREPARE_BYTES = 4096

_XGRAMMAR_FORMATS = {
    dr.ModelVersion.DeepseekV4Pro: "deepseek_v4",
    dr.ModelVersion.DeepseekV41Flash: "deepseek_v4_1",
}


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    parsing: dr.ParsingOptions
    structured: StructuredOutput | None
    tools: ToolPlan | None = None  # set when tool calls are parsed out of plain text
    # Set under a DSML tool-call grammar: xgrammar may spell a marker from plain tokens, which
    # the recipe parses only as text, so the output is pushed to it decoded.
    push_text: bool = False


class ModelFamily:
    """Base: what every family offers the protocol layer."""

    name = "base"
    conversion_options: dr.ConversionOptions
    recipe_tokenizer: dr.Tokenizer  # decodes `tokens` chunks inside the StreamProcessor
    # Bodies up to this size are prepared (converted, rendered, encoded, admitted) on the event
    # loop, larger ones on a worker thread (server/state.py prepare_off_loop).
    inline_prepare_bytes = INLINE_PREPARE_BYTES

    def prepare(
        self,
        request: dr.ConversationRequest,
        parallel_tools: bool = True,
        tools: ToolRequest | None = None,
    ) -> PreparedPrompt:
        raise NotImplementedError

    def constraint(
        self,
        request: dr.ConversationRequest,
        parallel_tools: bool = True,
        tools: ToolRequest | None = None,
    ) -> StructuredOutput | None:
        """The json / regex constraint of a converted request (tool calls: see subclasses)."""
        oc = request.inference_options.output_constraint
        if oc is None:
            return None
        if oc.kind == "json":
            return StructuredOutput("json_schema", oc.schema) if oc.schema else _JSON_OBJECT
        if oc.kind == "regex":
            return StructuredOutput("regex", oc.schema)
        return self.tool_constraint(request, oc, parallel_tools, tools or ToolRequest())

    def tool_constraint(
        self,
        request: dr.ConversationRequest,
        oc: dr.OutputConstraint,
        parallel: bool,
        tools: ToolRequest,
    ) -> StructuredOutput | None:
        if oc.kind == "tool_call_required":
            raise InvalidRequestError(f"model family {self.name} does not support tool calls")
        return None

    def answer_constraint(
        self, parsing: dr.ParsingOptions, structured: StructuredOutput | None
    ) -> StructuredOutput | None:
        """The request's final output constraint as the engine must apply it: when the output
        starts in reasoning (`parsing`, the prepared prompt's), a json / regex / grammar constraint
        holds only after `</think>`.

        Applied from the first token it would force the answer into the reasoning, and leave
        `content` empty; DeepSeek's tool-call tags carry their own reasoning part.
        """
        if structured is None or structured.kind == "dsml_tool_calls":
            return structured
        stage = parsing.thinking_initial_stage
        if stage is None or not stage.starts_in_reasoning():
            return structured
        return after_reasoning(structured, THINK_END, (THINK_START, THINK_END))


_JSON_OBJECT = StructuredOutput("json_object")


def _in_reasoning(request: dr.ConversationRequest) -> bool:
    stage = request.parsing_options.thinking_initial_stage
    return stage is not None and stage.starts_in_reasoning()


def enforced_tools(recipe_tools: str, tools: ToolRequest) -> list[dict]:
    """The tools the grammar holds the calls to, each with the client's own parameters.

    The recipe's list (already narrowed to a named tool_choice) carries `strict` as sent, and with
    strict true its parameters rewritten to OpenAI's strict subset, which drops `enum` on numbers,
    `maxLength` and other bounds. xgrammar leaves the arguments of a non-strict tool free. A named
    or required tool_choice promises arguments that match the schema, so every tool is enforced,
    with its parameters as the client sent them.
    """
    enforced = []
    for tool in json.loads(recipe_tools):
        fn = dict(tool["function"])
        fn.pop("strict", None)
        fn["parameters"] = tools.parameters.get(fn["name"]) or fn.get("parameters")
        enforced.append({**tool, "function": fn})
    return enforced


class DeepSeekFamily(ModelFamily):
    """DeepSeek V4 / V4.1 prompt encoding and output parsing, all from deepseek-recipe."""

    name = "deepseek"
    # The recipe encodes in native code without the GIL at ~1.5-3 us a token (the DeepSeek
    # tokenizer's pre-tokenizer), most of what a chat request costs the loop: on a thread, a burst
    # of requests is encoded while the loop reads and answers the others.
    inline_prepare_bytes = 0

    def __init__(
        self,
        tokenizer: Tokenizer,
        served_name: str,
        version: dr.ModelVersion = dr.ModelVersion.DeepseekV4Pro,
    ) -> None:
        self.version = version
        self.recipe_tokenizer = dr.Tokenizer.from_str(tokenizer.to_str())
        encoding = (
            dr.DeepseekV41Encoding()
            if version == dr.ModelVersion.DeepseekV41Flash
            else dr.DeepseekV4Encoding()
        )
        self.encoding = encoding.with_tokenizer(self.recipe_tokenizer)
        self.conversion_options = dr.ConversionOptions().with_model_alias(served_name, version)

    def prepare(
        self,
        request: dr.ConversationRequest,
        parallel_tools: bool = True,
        tools: ToolRequest | None = None,
    ) -> PreparedPrompt:
        structured = self.constraint(request, parallel_tools, tools)
        try:
            ids = self.encoding.encode(request.conversation)
        except RuntimeError as e:
            raise InvalidRequestError(f"cannot encode the conversation: {e}") from e
        push_text = structured is not None and structured.kind == "dsml_tool_calls"
        return PreparedPrompt(ids, request.parsing_options, structured, push_text=push_text)

    def tool_constraint(
        self,
        request: dr.ConversationRequest,
        oc: dr.OutputConstraint,
        parallel: bool,
        tools: ToolRequest,
    ) -> StructuredOutput | None:
        spec = {
            "format": _XGRAMMAR_FORMATS[self.version],
            "tools": json.dumps(enforced_tools(oc.schema, tools)),
            "required": oc.kind == "tool_call_required",
            "opened_in_prompt": request.parsing_options.starts_in_tool_calls,
            "parallel": parallel,
            "reasoning": _in_reasoning(request),
        }
        # The engine builds the structural tag (engine/structured.py): xgrammar loads torch.
        return StructuredOutput("dsml_tool_calls", json.dumps(spec))


class ChatMLFamily(ModelFamily):
    """HF chat models: the checkpoint's own chat template; the output is text, with R1-style
    reasoning when the rendered prompt opens a think block (server/reasoning.py).

    Tool calls go through server/tool_calls.py: a named or required tool_choice constrains the
    output to JSON, "auto" parses `<tool_call>` blocks out of the text.
    """

    name = "chatml"

    def __init__(
        self,
        tokenizer: Tokenizer,
        served_name: str,
        chat_template: str,
        bos_token_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # templates such as R1's start with `{{ bos_token }}`
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.bos_token = bos or ""
        self.recipe_tokenizer = dr.Tokenizer.from_str(tokenizer.to_str())
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(chat_template)
        self.template_takes_tools = "tools" in meta.find_undeclared_variables(
            env.parse(chat_template)
        )
        # Thinking off by default: in thinking mode the recipe forces temperature 1.0.
        self.conversion_options = (
            dr.ConversionOptions()
            .with_default_thinking_mode(False)
            .with_model_alias(served_name, dr.ModelVersion.DeepseekV4Pro)
        )

    def render(self, conversation: dr.Conversation, plan: ToolPlan | None = None) -> str:
        messages = [template_message(m, self.template_takes_tools) for m in conversation.messages]
        extra = {}
        if plan is not None and self.template_takes_tools:
            extra["tools"] = [t.as_openai() for t in plan.tools]
        elif plan is not None:
            messages = with_tool_instructions(messages, plan)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, **extra
            )
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from e

    def prepare(
        self,
        request: dr.ConversationRequest,
        parallel_tools: bool = True,
        tools: ToolRequest | None = None,
    ) -> PreparedPrompt:
        plan = tool_plan(request.conversation, tools or ToolRequest(), parallel_tools)
        structured = plan.constraint() if plan else self.constraint(request, parallel_tools)
        text = self.render(request.conversation, plan)
        ids = encode_text(self.tokenizer, text)
        return PreparedPrompt(
            ids, template_parsing(request.parsing_options, text), structured, plan
        )


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added. Through `encode_batch`, which releases the
    GIL while it works (`encode` holds it: a long prompt would stall the event loop)."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def make_family(
    family: str,
    tokenizer: Tokenizer,
    served_name: str,
    chat_template: str | None,
    bos_token_id: int | None = None,
):
    """The family for an engine's ModelInfo.family: deepseek-recipe's encodings for DeepSeek-V3 and
    V4, the checkpoint's own chat template for every other model (DeepSeek-V2 included)."""
    if family in ("deepseek_v3", "deepseek_v4"):
        return DeepSeekFamily(tokenizer, served_name)
    if not chat_template:
        raise UnsupportedModelError(f"model family {family!r} has no chat template to render with")
    return ChatMLFamily(tokenizer, served_name, chat_template, bos_token_id)
