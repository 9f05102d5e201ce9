"""The three chat protocols deepseek-recipe implements, described once each.

A `ProtocolSpec` says which recipe request and response classes an endpoint uses and how to build
its chunk generator; `parse_request` runs the recipe's validation and conversion. Everything a
protocol differs in lives in this table, so the request path (server/chat_routes.py) is shared.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import deepseek_recipe as dr

from deepserve.server.errors import HTTPError, message_of_conversion_error

GeneratorFactory = Callable[[], object]  # a fresh recipe chunk generator (one per choice)


@dataclass(frozen=True)
class ProtocolSpec:
    name: str  # "chat" | "responses" | "messages"
    request_cls: type
    response_cls: type
    id_prefix: str
    allows_n: bool
    max_tokens_fields: tuple[
        str, ...
    ]  # the protocol's names for the output budget, preferred first


CHAT = ProtocolSpec(
    "chat",
    dr.ChatCompletionRequest,
    dr.ChatCompletionResponse,
    "chatcmpl-",
    True,
    ("max_completion_tokens", "max_tokens"),
)
RESPONSES = ProtocolSpec(
    "responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_", False, ("max_output_tokens",)
)
MESSAGES = ProtocolSpec(
    "messages", dr.MessagesRequest, dr.MessagesResponse, "msg_", False, ("max_tokens",)
)


@dataclass
class ParsedRequest:
    conversation: dr.ConversationRequest
    request_id: str
    make_generator: GeneratorFactory


def new_request_id(spec: ProtocolSpec) -> str:
    return spec.id_prefix + uuid.uuid4().hex[:24]


def parse_request(
    spec: ProtocolSpec, body: dict, options: dr.ConversionOptions, served_name: str
) -> ParsedRequest:
    """Validate and convert a request body with the recipe; HTTPError(400...) when it is bad."""
    _developer_as_system(spec, body)
    try:
        raw = spec.request_cls(body)
        extra = _pre_convert(spec, raw, options)
        conversation = raw.convert(options)
    except dr.ConversionError as e:
        raise HTTPError(e.status_code, message_of_conversion_error(e.body)) from e
    except ValueError as e:  # body that does not deserialize into the protocol's request
        raise HTTPError(400, _client_roles_only(str(e))) from e
    rid = new_request_id(spec)

    def make_generator():
        gen = spec.request_cls.chunk_generator(conversation, rid, served_name)
        if spec is RESPONSES:
            ntm, echo = extra
            gen = gen.with_namespace_tool_map(ntm).with_echo(echo)
        return gen

    return ParsedRequest(conversation, rid, make_generator)


# The message roles a client may send on the OpenAI protocols; the recipe also knows internal ones
# (`latest_reminder`) that no client should see named in an error.
CLIENT_ROLES = ("system", "developer", "user", "assistant", "tool")
_ROLE_LIST = re.compile(r"expected one of (`\w+`(?:, `\w+`)*, `latest_reminder`)")


def _developer_as_system(spec: ProtocolSpec, body: dict) -> None:
    """OpenAI's `developer` role is its newer name for `system`: map it before conversion.

    The recipe refuses it on Chat Completions and would render it as a user turn on Responses;
    both model families (the DeepSeek encoding and the chat templates) know `system` only.
    """
    items = body.get("messages") if spec is CHAT else body.get("input")
    if spec is MESSAGES or not isinstance(items, list):
        return
    for item in items:
        message = isinstance(item, dict) and item.get("type", "message") == "message"
        if message and item.get("role") == "developer":
            item["role"] = "system"


def _client_roles_only(message: str) -> str:
    """The recipe's "unknown variant" error on a message role, listing the roles a client may
    send rather than the recipe's internal ones."""
    allowed = ", ".join(f"`{r}`" for r in CLIENT_ROLES)
    return _ROLE_LIST.sub(f"expected one of {allowed}", message)


def _pre_convert(spec: ProtocolSpec, raw, options: dr.ConversionOptions):
    """What must be read before `convert` consumes the request (Responses only)."""
    if spec is RESPONSES:
        return raw.namespace_tool_map(options), raw.echo()
    return None
