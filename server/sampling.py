"""From a protocol request to the engine's `SamplingParams`.

The recipe's `InferenceOptions` give temperature, top_p, seed, max_tokens and logprobs; the fields it
does not carry (n, penalties, logit_bias, stop token ids, and vLLM-style extensions such as top_k or
`structured_outputs`) are read from the raw body here, each checked for its type. Not here: output
parsing and stop strings (the recipe's StreamProcessor applies those).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import deepseek_recipe as dr

from deepserve.engine.errors import InvalidRequestError
from deepserve.engine.sampling_params import SamplingParams, StructuredOutput
from deepserve.server.tool_calls import ToolRequest


@dataclass(frozen=True)
class BodyExtras:
    """What the server takes out of a body before the recipe converts it."""

    n: int = 1
    json_object: bool = False  # response_format json_object, enforced here (see pop_extras)
    structured: StructuredOutput | None = None  # from an extension field
    schema: str | None = None  # the client's own json_schema, before the recipe normalizes it
    parallel_tool_calls: bool = True
    tools: ToolRequest = field(default_factory=ToolRequest)


def pop_extras(body: dict, allow_n: bool) -> BodyExtras:
    """Remove the fields the recipe would refuse but we serve, and return them.

    The recipe rejects n != 1 and a json_object response_format whose prompt lacks the word
    "json"; the engine samples n choices itself and the grammar enforces JSON regardless of the
    prompt, so both are taken out before conversion.
    """
    n = body.pop("n", None) if allow_n else None
    n = 1 if n is None else _int(n, "n", lo=1, hi=16)
    fmt = body.get("response_format")
    json_object = isinstance(fmt, dict) and fmt.get("type") == "json_object"
    if json_object:
        body.pop("response_format")
    parallel = body.get("parallel_tool_calls", True) is not False
    return BodyExtras(
        n,
        json_object,
        _extension_constraint(body),
        _client_schema(body),
        parallel,
        ToolRequest.from_body(body),
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
    so = body.pop("structured_outputs", None) or {}
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object")
    found = {
        "ebnf": so.get("grammar", body.pop("guided_grammar", None)),
        "regex": so.get("regex", body.pop("guided_regex", None)),
        "json_schema": so.get("json", body.pop("guided_json", None)),
    }
    given = [(k, v) for k, v in found.items() if v is not None]
    if len(given) > 1:
        raise InvalidRequestError("give at most one of grammar, regex and json constraints")
    if not given:
        return None
    kind, spec = given[0]
    if kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec)
    if not isinstance(spec, str):
        raise InvalidRequestError(f"the {kind} constraint must be a string")
    return StructuredOutput(kind, spec)


def build_sampling_params(
    body: dict,
    options: dr.InferenceOptions,
    max_tokens: int,
    extras: BodyExtras,
    structured: StructuredOutput | None,
) -> SamplingParams:
    if extras.structured is not None and structured is not None:
        raise InvalidRequestError("response_format and a structured_outputs field both given")
    structured = extras.structured or structured
    if structured is not None and structured.kind == "json_schema" and extras.schema:
        structured = StructuredOutput("json_schema", extras.schema)
    if extras.json_object and structured is None:
        structured = StructuredOutput("json_object")
    return SamplingParams(
        n=extras.n,
        temperature=1.0 if options.temperature is None else options.temperature,
        top_p=1.0 if options.top_p is None else options.top_p,
        top_k=_top_k(body.get("top_k")),
        min_p=_float(body.get("min_p", 0.0), "min_p"),
        presence_penalty=_float(body.get("presence_penalty", 0.0), "presence_penalty"),
        frequency_penalty=_float(body.get("frequency_penalty", 0.0), "frequency_penalty"),
        repetition_penalty=_float(body.get("repetition_penalty", 1.0), "repetition_penalty"),
        logit_bias=parse_logit_bias(body.get("logit_bias")),
        seed=options.seed,
        max_tokens=max_tokens,
        min_tokens=_int(body.get("min_tokens", 0), "min_tokens", lo=0),
        stop_token_ids=tuple(parse_int_list(body.get("stop_token_ids"), "stop_token_ids")),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=(options.top_logprobs or 0) if options.logprobs else None,
        structured=structured,
    )


def _top_k(value) -> int:
    # -1 is the OpenAI-compatible servers' spelling of "off"; SamplingParams uses 0.
    return 0 if value is None or value == -1 else _int(value, "top_k", lo=0)


def _float(value, name: str) -> float:
    if value is None:
        raise InvalidRequestError(f"{name} must be a number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number")
    return float(value)


def _int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidRequestError(f"{name} must be in [{lo}, {hi}]")
    return value


def parse_int_list(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name} must be a list of integers")
    return [_int(v, name) for v in value]


def parse_logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers")
    try:
        bias = {int(k): _float(v, "logit_bias") for k, v in value.items()}
    except ValueError as e:
        raise InvalidRequestError("logit_bias keys must be token ids") from e
    if any(not -100 <= b <= 100 for b in bias.values()):
        raise InvalidRequestError("logit_bias values must be in [-100, 100]")
    return bias
