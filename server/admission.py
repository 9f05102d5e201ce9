"""Admission of an HTTP request: from a protocol body to an `AdmittedRequest`, in one place.

Every generation endpoint (chat completions, responses, messages, completions) and both topologies
(in-process engine, remote workers) pass through here, so one bad field gets one error wherever it
is sent:

1. `check_fields(body, max_text_chars, endpoint)` checks the body's shape (depth, 64-bit integers,
   finite numbers, valid Unicode, total text; server/body_checks.py), the declared types of its
   fields, and the sampling fields the endpoints share by one table of rules, before any
   protocol conversion sees them; `check_protocol(endpoint, body)` applies the protocol rules the
   recipe does not, and refuses the fields this server does not serve (docs/server.md lists
   them). `cache_salt` then takes out the request's prefix-cache salt.
2. `pop_extras(body, allow_n, max_tokens_fields)` takes out what the recipe would refuse or
   resolve differently but the server serves (n, the output budget, json_object, vLLM-style
   constraint fields, tool schemas), and reads the sampling fields no protocol conversion carries
   (`BodySampling`: top_k, min_p, the penalties, logit_bias, min_tokens, stop_token_ids,
   ignore_eos), all into one `BodyExtras`.
3. `sampling_params(options, extras, structured, cache_salt)` builds `SamplingParams` from two
   sources, each field from one: the protocol's `RequestOptions` (temperature, top_p, seed,
   max_tokens, logprobs: the recipe's conversion for the chat protocols, `completion_options` for
   /v1/completions) and the `BodyExtras` (n and `BodySampling`'s fields). It reads no body.
4. `admit(state, prompt_ids, params)` bounds the output constraint's size, then hands it to the
   engine's `admit` (engine/admission.py: token ids against the vocabulary and the context,
   max_tokens resolved, the grammar compiled once) and records the structured-output metrics.
   `generate` then trusts the result.

Not here: prompt rendering (server/family.py) and stop strings (the recipe's StreamProcessor,
server/completions.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import deepseek_recipe as dr

from deepserve.engine.admission import AdmittedRequest
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput
from deepserve.server.body_checks import (
    CHAT_FIELDS,
    COMPLETIONS_FIELDS,
    Check,
    check_body,
    check_constraint_size,
)
from deepserve.server.cache_salt import request_salt
from deepserve.server.config import ServerConfig
from deepserve.server.errors import HTTPError
from deepserve.server.tool_calls import ToolRequest

MAX_N = 16
LEGACY_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's legacy API


@dataclass(frozen=True)
class _Rule:
    kind: str  # "number" | "integer" | "boolean"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # (lo, hi] rather than [lo, hi]
    off: int | None = None  # a value accepted as "off" outside the range (top_k = -1)

    def check(self, name: str, value) -> None:
        if value is None:
            return
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise bad_field(name, f"{name} must be a boolean")
            return
        if not _is_kind(value, self.kind):
            article = "an" if self.kind == "integer" else "a"
            raise bad_field(name, f"{name} must be {article} {self.kind}")
        if value == self.off:
            return
        low_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        if not low_ok or (self.hi is not None and value > self.hi):
            raise bad_field(name, f"{name} must be in {self._range()}")

    def _range(self) -> str:
        lo = "-inf" if self.lo is None else _format_bound(self.lo)
        hi = "inf" if self.hi is None else _format_bound(self.hi)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"


# The sampling fields every endpoint shares, by the name the body uses. A field an endpoint does
# not accept is refused by that endpoint's own schema, never by a different rule.
FIELD_RULES: dict[str, _Rule] = {
    "temperature": _Rule("number", 0, 2),
    "top_p": _Rule("number", 0, 1, lo_open=True),
    # -1: the OpenAI-compatible servers' "off"; the sampler holds top_k in an int64.
    "top_k": _Rule("integer", 0, 2**63 - 1, off=-1),
    "min_p": _Rule("number", 0, 1),
    "presence_penalty": _Rule("number", -2, 2),
    "frequency_penalty": _Rule("number", -2, 2),
    "repetition_penalty": _Rule("number", 0, lo_open=True),
    "seed": _Rule("integer", 0, 2**64 - 1),
    "max_tokens": _Rule("integer", 1),
    "max_completion_tokens": _Rule("integer", 1),
    "max_output_tokens": _Rule("integer", 1),
    "min_tokens": _Rule("integer", 0),
    "top_logprobs": _Rule("integer", 0, 20),
    "ignore_eos": _Rule("boolean"),
}


def bad_field(name: str, message: str) -> HTTPError:
    return HTTPError(400, message, param=name)


# Declared types a field has on one endpoint only (`logprobs`: a flag, or a count on completions).
_OWN_FIELDS: dict[str, dict[str, Check]] = {"chat": CHAT_FIELDS, "completions": COMPLETIONS_FIELDS}


def check_fields(body: dict, max_text_chars: int, endpoint: str = "chat") -> None:
    """Check `body`'s shape and declared types (server/body_checks.py), then the shared sampling
    fields (HTTPError 400 naming the field). `endpoint`: "chat" for the three chat protocols,
    or "completions"."""
    check_body(body, max_text_chars, _OWN_FIELDS[endpoint])
    for name, rule in FIELD_RULES.items():
        rule.check(name, body.get(name))
    parse_logit_bias(body.get("logit_bias"))
    parse_int_list(body.get("stop_token_ids"), "stop_token_ids")


def cache_salt(body: dict, config: ServerConfig, tenant: str | None) -> str | None:
    """Take `cache_salt` out of a checked body: the salt its KV blocks are hashed under
    (server/cache_salt.py), the tenant's too when salting by API key."""
    by_key = tenant if config.salts_by_api_key else None
    return request_salt(body.pop("cache_salt", None), by_key)


_NOT_SERVED_PARTS = {
    "chat": ("image_url", "input_audio", "file"),
    "responses": ("input_image", "input_file", "input_audio"),
    "messages": ("image", "document"),
    "count_tokens": ("image", "document"),  # Anthropic's /v1/messages/count_tokens
}
_TEXT_ONLY = "this server reads text only"


def check_protocol(endpoint: str, body: dict) -> None:
    """The protocol's own rules the recipe does not apply, and the fields not served: each a 400
    that says so, rather than an answer that silently ignores what was asked."""
    if endpoint in ("chat", "responses"):
        _tool_choice_needs_tools(body)
    if endpoint == "chat":
        _chat_extensions(body)
    if endpoint in ("messages", "count_tokens"):
        _anthropic_messages(body, needs_max_tokens=endpoint == "messages")
    streaming = bool(body.get("stream"))
    if endpoint == "completions" and body.get("stream_options") is not None and not streaming:
        raise bad_field("stream_options", "stream_options is only allowed when stream is true")
    parts = _NOT_SERVED_PARTS.get(endpoint, ())
    kind = next((k for k in _content_part_types(endpoint, body) if k in parts), None)
    if kind is not None:
        where = "input" if endpoint == "responses" else "messages"
        raise bad_field(where, f"{kind} content parts are not served: {_TEXT_ONLY}")


def _chat_extensions(body: dict) -> None:
    """vLLM's chat extensions this server does not serve."""
    if body.get("continue_final_message"):
        raise bad_field("continue_final_message", "continue_final_message is not served")
    constraint_fields = body.get("structured_outputs")
    choice = isinstance(constraint_fields, dict) and constraint_fields.get("choice") is not None
    if choice or "guided_choice" in body:
        raise bad_field(
            "structured_outputs",
            "structured_outputs.choice is not served; a regex of the choices does the same",
        )


def _tool_choice_needs_tools(body: dict) -> None:
    choice = body.get("tool_choice")
    if choice is not None and choice != "none" and not body.get("tools"):
        raise bad_field("tool_choice", "tool_choice is only allowed when tools are specified")


def _anthropic_messages(body: dict, needs_max_tokens: bool) -> None:
    if needs_max_tokens and body.get("max_tokens") is None:
        raise bad_field("max_tokens", "max_tokens: Field required")
    for i, message in enumerate(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "system":
            raise bad_field(
                f"messages[{i}].role",
                'messages: Unexpected role "system". The Messages API accepts a top-level '
                '`system` parameter, not "system" as an input message role.',
            )


def _content_part_types(endpoint: str, body: dict) -> list[str]:
    """The `type` of every content part of the request's messages (Responses: input items)."""
    items = body.get("input") if endpoint == "responses" else body.get("messages")
    if not isinstance(items, list):
        return []
    types = []
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else [item]:
            if isinstance(part, dict) and isinstance(part.get("type"), str):
                types.append(part["type"])
    return types


@dataclass(frozen=True)
class RequestOptions:
    """The sampling fields a protocol defines itself (the recipe converts them for chat): where
    `SamplingParams` takes temperature, top_p, seed, max_tokens and logprobs from."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k


def recipe_options(options: dr.InferenceOptions, extras: BodyExtras) -> RequestOptions:
    """The chat protocols: what the recipe converted, and the max_tokens and seed taken out
    before."""
    logprobs = (options.top_logprobs or 0) if options.logprobs else None
    return RequestOptions(
        options.temperature, options.top_p, extras.seed, extras.max_tokens, logprobs
    )


def completion_options(body: dict, extras: BodyExtras) -> RequestOptions:
    """/v1/completions: the legacy API's own fields (max_tokens defaults to 16 there)."""
    logprobs = body.get("logprobs")
    _Rule("integer", 0, 20).check("logprobs", logprobs)
    return RequestOptions(
        body.get("temperature"),
        body.get("top_p"),
        extras.seed,
        LEGACY_MAX_TOKENS if extras.max_tokens is None else extras.max_tokens,
        logprobs,
    )


@dataclass(frozen=True)
class BodySampling:
    """The sampling fields the recipe's `InferenceOptions` do not carry (top_k and the
    OpenAI-compatible servers' extensions), read once from the checked body by `from_body`;
    absent fields take the sampler's "off" values."""

    top_k: int = 0  # 0: off, as the body's -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_body(cls, body: dict) -> BodySampling:
        """The fields of a body that has passed `check_fields`; read, not removed: the recipe
        validates the body as it was sent."""
        top_k = body.get("top_k")
        return cls(
            top_k=0 if top_k is None or top_k == -1 else top_k,
            min_p=float(_default_if_none(body.get("min_p"), 0.0)),
            presence_penalty=float(_default_if_none(body.get("presence_penalty"), 0.0)),
            frequency_penalty=float(_default_if_none(body.get("frequency_penalty"), 0.0)),
            repetition_penalty=float(_default_if_none(body.get("repetition_penalty"), 1.0)),
            logit_bias=parse_logit_bias(body.get("logit_bias")),
            min_tokens=_default_if_none(body.get("min_tokens"), 0),
            stop_token_ids=tuple(parse_int_list(body.get("stop_token_ids"), "stop_token_ids")),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )


@dataclass(frozen=True)
class BodyExtras:
    """What the server takes out of a body (or, for `sampling`, reads from it) before the recipe
    converts it."""

    n: int = 1
    max_tokens: int | None = None  # None: up to the context (the engine resolves it)
    json_object: bool = False  # response_format json_object, enforced here (see pop_extras)
    structured: StructuredOutput | None = None  # from an extension field
    schema: str | None = None  # the client's own json_schema, before the recipe normalizes it
    parallel_tool_calls: bool = True
    tools: ToolRequest = field(default_factory=ToolRequest)
    sampling: BodySampling = field(default_factory=BodySampling)
    seed: int | None = None  # read here: the recipe's chat conversion caps it at 2^63


def pop_extras(body: dict, allow_n: bool, max_tokens_fields: tuple[str, ...]) -> BodyExtras:
    """Remove the fields the recipe would refuse or resolve differently, and return them with the
    sampling fields it does not carry (`BodySampling`). `body` has passed `check_fields`.

    The recipe rejects n != 1 and a json_object response_format whose prompt lacks the word
    "json"; the engine samples n choices itself and the grammar enforces JSON regardless of the
    prompt, so both are taken out before conversion. The output budget (`max_tokens_fields`, the
    protocol's names for it, preferred first) is resolved by the engine's admission alone: the
    recipe would clamp it on one protocol and refuse it on another. The seed too: every route
    takes FIELD_RULES' range, where the recipe's Chat Completions conversion stops at 2^63.
    """
    n = body.pop("n", None) if allow_n else None
    _Rule("integer", 1, MAX_N).check("n", n)
    budgets = [body.pop(name, None) for name in max_tokens_fields]
    max_tokens = next((b for b in budgets if b is not None), None)
    fmt = body.get("response_format")
    json_object = isinstance(fmt, dict) and fmt.get("type") == "json_object"
    if json_object:
        body.pop("response_format")
    parallel = ToolRequest.parallel(body)
    return BodyExtras(
        1 if n is None else n,
        max_tokens,
        json_object,
        _extension_constraint(body),
        _client_schema(body),
        parallel,
        ToolRequest.from_body(body),
        BodySampling.from_body(body),
        body.pop("seed", None),
    )


def _client_schema(body: dict) -> str | None:
    """The json_schema as sent (Chat: response_format, Responses: text.format).

    With strict: true the recipe rewrites the schema to OpenAI's strict subset, dropping bounds
    such as maxLength and maxItems; xgrammar enforces those, and the client asked for them.
    """
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
    else:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        ok = isinstance(fmt, dict) and fmt.get("type") == "json_schema"
        schema = fmt.get("schema") if ok else None
    return json.dumps(schema) if isinstance(schema, dict) else None


def _extension_constraint(body: dict) -> StructuredOutput | None:
    """EBNF / regex / JSON schema through vLLM's extension fields."""
    fields = body.pop("structured_outputs", None) or {}
    if not isinstance(fields, dict):
        raise bad_field("structured_outputs", "structured_outputs must be an object")
    found = {
        "ebnf": fields.get("grammar", body.pop("guided_grammar", None)),
        "regex": fields.get("regex", body.pop("guided_regex", None)),
        "json_schema": fields.get("json", body.pop("guided_json", None)),
    }
    given = [(k, v) for k, v in found.items() if v is not None]
    if len(given) > 1:
        raise bad_field(
            "structured_outputs", "give at most one of grammar, regex and json constraints"
        )
    if not given:
        return None
    kind, spec = given[0]
    if kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec)
    if not isinstance(spec, str):
        raise bad_field("structured_outputs", f"the {kind} constraint must be a string")
    return StructuredOutput(kind, spec)


def sampling_params(
    options: RequestOptions,
    extras: BodyExtras,
    structured: StructuredOutput | None = None,
    cache_salt: str | None = None,
) -> SamplingParams:
    """The request's `SamplingParams`: each field from `options` (what the protocol defines) or
    from `extras` (n and the body's other sampling fields), never from both. `structured`: the
    constraint the model family derived from the recipe's conversion (response_format, tools)."""
    if extras.structured is not None and structured is not None:
        raise bad_field(
            "structured_outputs", "response_format and a structured_outputs field both given"
        )
    structured = extras.structured or structured
    if structured is not None and structured.kind == "json_schema" and extras.schema:
        structured = StructuredOutput("json_schema", extras.schema)
    if extras.json_object and structured is None:
        structured = StructuredOutput("json_object")
    body_sampling = extras.sampling
    return SamplingParams(
        n=extras.n,
        temperature=_default_if_none(options.temperature, 1.0),
        top_p=_default_if_none(options.top_p, 1.0),
        top_k=body_sampling.top_k,
        min_p=body_sampling.min_p,
        presence_penalty=body_sampling.presence_penalty,
        frequency_penalty=body_sampling.frequency_penalty,
        repetition_penalty=body_sampling.repetition_penalty,
        logit_bias=body_sampling.logit_bias,
        seed=options.seed,
        max_tokens=options.max_tokens,
        min_tokens=body_sampling.min_tokens,
        stop_token_ids=body_sampling.stop_token_ids,
        ignore_eos=body_sampling.ignore_eos,
        logprobs=options.logprobs,
        structured=structured,
        cache_salt=cache_salt,
    )


def admit(state, prompt_ids: list[int], params: SamplingParams) -> AdmittedRequest:
    """The engine's admission (InvalidRequestError when it refuses), recorded in the metrics.
    A remote engine compiles the grammar on the worker, which times it there."""
    if params.structured is not None:
        check_constraint_size(params.structured.kind, params.structured.spec)
    admitted = state.backend.admit(prompt_ids, params)
    if params.structured is not None:
        state.metrics.structured_request(params.structured.kind)
        if admitted.grammar is not None:
            state.metrics.grammar_compile.observe(admitted.grammar.compile_seconds)
    return admitted


def parse_int_list(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_kind(v, "integer") for v in value):
        raise bad_field(name, f"{name} must be a list of integers")
    return value


def parse_logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    message = "logit_bias must map token ids to numbers in [-100, 100]"
    if not isinstance(value, dict):
        raise bad_field("logit_bias", message)
    try:
        bias = {int(k): v for k, v in value.items()}
    except ValueError as e:
        raise bad_field("logit_bias", message) from e
    if not all(_is_kind(b, "number") and -100 <= b <= 100 for b in bias.values()):
        raise bad_field("logit_bias", message)
    return {k: float(v) for k, v in bias.items()}


def _is_kind(value, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == "integer" else isinstance(value, int | float)


def _default_if_none(value, default):
    return default if value is None else value


def _format_bound(x: float) -> str:
    """A range bound as a message shows it: 2, not 2.0."""
    return str(int(x)) if float(x).is_integer() else str(x)
