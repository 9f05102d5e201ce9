"""Generic checks of a request body before anything converts it: shape bounds and declared types.

`check_body` walks the parsed JSON once (iteratively, so no depth can blow the stack) and refuses,
as a 400 naming the field: nesting deeper than `MAX_DEPTH`, integers outside 64 bits, numbers
that are not finite (1e400 parses to inf), strings holding lone surrogates (they cannot be encoded
to UTF-8, so the tokenizer and the recipe fail on them), and more string characters than any
prompt the context can hold could have. Then it checks each known top-level field against its
declared type and bounds (booleans strict: `"stream": "yes"` is refused, not taken as true).

Not here: what a field means for one protocol (tool_choice without tools, unsupported fields:
server/protocols.py and the recipe), engine limits that need the tokenized prompt
(LLMEngine.check_request).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from deepserve.server.errors import HTTPError

MAX_DEPTH = 64  # a JSON schema or tool parameters nested deeper is not one a model could fill
# Any integer must fit 64 bits, signed or unsigned (a seed may be a uint64); fields held in a
# signed int64 (top_k) say so in their own rule.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
MAX_CACHE_SALT_CHARS = 256
MAX_STOP_STRINGS = 64


@dataclass(frozen=True)
class BodyStats:
    string_chars: int  # characters in every string of the body, keys included


def check_body(
    body: dict, max_string_chars: int, route_fields: dict[str, Check] | None = None
) -> BodyStats:
    """Walk `body`; HTTPError(400) on the first value out of bounds, then check the declared
    types of TOP_LEVEL's fields and of the route's own (`route_fields`, which win on a clash)."""
    stats = _walk(body, max_string_chars)
    for name, check in {**TOP_LEVEL, **(route_fields or {})}.items():
        value = body.get(name)
        if value is not None:
            check(name, value)
    return stats


def _walk(body: dict, max_string_chars: int) -> BodyStats:
    chars = 0
    stack: list[tuple[str, object, int]] = [("", body, 0)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, dict):
            _check_depth(path, depth)
            for key, item in value.items():
                _check_string(_join(path, key), key)
                chars += len(key)
                stack.append((_join(path, key), item, depth + 1))
        elif isinstance(value, list):
            _check_depth(path, depth)
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(path, value)
            chars += len(value)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                _refuse(path, "is an integer outside 64 bits")
        elif isinstance(value, float) and not math.isfinite(value):
            _refuse(path, "is not a finite number")
        if chars > max_string_chars:
            raise HTTPError(
                400,
                f"the request holds more than {max_string_chars} characters of text, more than "
                "the context limit could take as tokens",
            )
    return BodyStats(chars)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_depth(path: str, depth: int) -> None:
    if depth >= MAX_DEPTH:
        _refuse(path, f"is nested deeper than {MAX_DEPTH} levels")


def _check_string(path: str, value: str) -> None:
    # Encoding finds a lone surrogate as a regex would, a hundred times faster (a regex scan of a
    # 7 MB prompt holds the GIL, and so the event loop, for a third of a second).
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _refuse(path or "body", "holds a lone UTF-16 surrogate, which is not valid Unicode text")


def _refuse(path: str, what: str) -> None:
    param = path or None
    raise HTTPError(400, f"{path or 'the body'} {what}", param=param)


# ---- declared types of the top-level fields -------------------------------------------------

Check = Callable[[str, object], None]


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), "an array" if isinstance(value, list) else "an object"
    )


def boolean(path: str, value: object) -> None:
    if not isinstance(value, bool):
        _refuse(path, f"must be a boolean, not {_type_name(value)}")


def string(path: str, value: object) -> None:
    if not isinstance(value, str):
        _refuse(path, f"must be a string, not {_type_name(value)}")


def obj(path: str, value: object) -> None:
    if not isinstance(value, dict):
        _refuse(path, f"must be an object, not {_type_name(value)}")


def array(path: str, value: object) -> None:
    if not isinstance(value, list):
        _refuse(path, f"must be an array, not {_type_name(value)}")


def integer(lo: int = INT_MIN, hi: int = INT_MAX) -> Check:
    def check(path: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            _refuse(path, f"must be an integer, not {_type_name(value)}")
        _check_range(path, value, lo, hi)

    return check


def _check_range(path: str, value, lo, hi) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        low = "-inf" if lo is None else lo
        high = "inf" if hi is None else hi
        _refuse(path, f"must be in [{low}, {high}], not {value}")


def one_of(*checks: Check, what: str) -> Check:
    def check(path: str, value: object) -> None:
        for c in checks:
            try:
                c(path, value)
                return
            except HTTPError:
                continue
        _refuse(path, f"must be {what}, not {_type_name(value)}")

    return check


def list_of(item: Check, max_items: int | None = None) -> Check:
    def check(path: str, value: object) -> None:
        array(path, value)
        if max_items is not None and len(value) > max_items:
            _refuse(path, f"may hold at most {max_items} items, not {len(value)}")
        for i, v in enumerate(value):
            item(f"{path}[{i}]", v)

    return check


def string_or_list(max_items: int) -> Check:
    """A string, or a list of at most `max_items` strings; a list's own error (too long, an item
    not a string) is reported as such, not as "not a string"."""

    def check(path: str, value: object) -> None:
        if isinstance(value, list):
            list_of(string, max_items)(path, value)
        elif not isinstance(value, str):
            _refuse(path, f"must be a string or a list of strings, not {_type_name(value)}")

    return check


def fields(**declared: Check) -> Check:
    """An object whose listed fields, when present and not null, pass their checks."""

    def check(path: str, value: object) -> None:
        obj(path, value)
        for name, c in declared.items():
            if value.get(name) is not None:
                c(_join(path, name), value[name])

    return check


def _cache_salt(path: str, value: object) -> None:
    string(path, value)
    if not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        _refuse(path, f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")


_TOOL = fields(function=fields(name=string, parameters=obj), name=string, input_schema=obj)
_TEXT_OR_PARTS = one_of(string, array, what="a string or an array")

# The declared types of the fields any of the four generating routes takes, other than the
# sampling fields server/admission.py's FIELD_RULES check. A field a route does not know is the
# route's business (the recipe or the completions route refuses it).
TOP_LEVEL: dict[str, Check] = {
    "model": string,
    "stream": boolean,
    "stream_options": fields(include_usage=boolean, continuous_usage_stats=boolean),
    "best_of": integer(1),
    "stop": string_or_list(MAX_STOP_STRINGS),
    "stop_sequences": list_of(string, MAX_STOP_STRINGS),
    "echo": boolean,
    "parallel_tool_calls": boolean,
    "store": boolean,
    "user": string,
    "metadata": obj,
    "messages": list_of(fields(role=string, content=one_of(string, array, what="text or parts"))),
    "prompt": _TEXT_OR_PARTS,
    "input": _TEXT_OR_PARTS,
    "instructions": string,
    "system": _TEXT_OR_PARTS,
    "tools": list_of(_TOOL),
    "tool_choice": one_of(string, obj, what="a string or an object"),
    "response_format": fields(
        type=string,
        json_schema=fields(name=string, schema=obj, strict=boolean),
        regex=string,
    ),
    "text": fields(format=fields(type=string, schema=obj, strict=boolean)),
    "structured_outputs": fields(
        json=one_of(string, obj, what="a schema"), regex=string, grammar=string
    ),
    "guided_json": one_of(string, obj, what="a schema"),
    "guided_regex": string,
    "guided_grammar": string,
    "thinking": obj,
    "reasoning": obj,
    "cache_salt": _cache_salt,
}

# `logprobs` is a flag on the chat protocols and a count on legacy completions.
CHAT_FIELDS: dict[str, Check] = {"logprobs": boolean}
COMPLETIONS_FIELDS: dict[str, Check] = {"logprobs": integer(0, 20)}

# Longest output constraint compiled, in characters: compile time grows with the size (a
# 100,000-character regex compiles for many seconds), and no useful constraint is this long.
MAX_CONSTRAINT_CHARS = {"regex": 16_384, "ebnf": 65_536, "json_schema": 65_536}
MAX_TOOL_CONSTRAINT_CHARS = 262_144  # every tool's parameters together


def check_constraint_size(kind: str, spec: str) -> None:
    limit = MAX_CONSTRAINT_CHARS.get(kind, MAX_TOOL_CONSTRAINT_CHARS)
    if len(spec) > limit:
        raise HTTPError(
            400, f"the {kind} output constraint has {len(spec)} characters; the limit is {limit}"
        )
