"""Test helper (not a test): hostile request bodies for the four generating routes, as hypothesis
strategies, and the check every answer must pass. Shared by tests/test_server_fuzz.py (bounded, in
CI) and benchmarks/fuzz_server.py (thousands of cases against a running server).

A case starts from a valid body of its route and replaces, adds or nests values: integers past
64 bits, NaN and infinities, lone surrogates, wrong types, deep nesting, long strings; or it
corrupts the encoded bytes. Integers a field could take as valid are kept small, so an accepted
request generates a few tokens only and the run stays short.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hypothesis import strategies as st

MODEL = "smollm2-135m"
MAX_TOKENS = 4

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
_MAX_FIELD = {"/v1/responses": "max_output_tokens"}
# A source file with a line number, as native libraries (xgrammar) and tracebacks write them.
SOURCE_PATH = re.compile(rb"/[\w./-]+\.(?:cc|cpp|h|hpp|py):\d+")


def base_body(route: str, model: str = MODEL) -> dict:
    """A valid, short request for `route`."""
    limit = _MAX_FIELD.get(route, "max_tokens")
    body: dict = {"model": model, limit: MAX_TOKENS, "temperature": 0}
    if route == "/v1/completions":
        body["prompt"] = "Once upon a time"
    elif route == "/v1/responses":
        body["input"] = "Say hi."
    else:
        body["messages"] = [{"role": "user", "content": "Say hi."}]
    return body


FIELDS = (
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "echo",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "structured_outputs",
    "guided_regex",
    "guided_json",
    "thinking",
    "cache_salt",
    "messages",
    "prompt",
    "input",
    "system",
    "metadata",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "model",
)

_BIG_INTS = (2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, -(2**64), 10**30, 2**31)
_LONE = ("\ud800", "a\udfffb", "\udc00" * 3)

ints = st.one_of(st.integers(-3, MAX_TOKENS), st.sampled_from(_BIG_INTS))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0]),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(_LONE), st.just("x" * 5000))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def nested(depth: int, leaf: object = 1) -> object:
    value: object = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


deep = st.integers(60, 600).map(nested)
structured = st.sampled_from(
    [
        {"type": "json_schema", "json_schema": "not an object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": nested(200)}},
        {"type": "json_schema", "json_schema": {"name": 5, "schema": {"type": "object"}}},
        {"type": "regex", "regex": "a" * 100_000},
        {"type": "regex", "regex": 7},
        {"type": "json_object"},
        "json",
        {"type": "regex", "regex": "(("},  # constraints xgrammar refuses: errors without paths
        {"grammar": "root ::= (("},
        {"regex": "(("},
        {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
    ]
)
tools = st.sampled_from(
    [
        "tools",
        [1],
        [{"type": "function", "function": {"name": 5}}],
        [{"type": "function", "function": "f"}],
        [{"type": "function", "function": {"name": "f", "parameters": "p"}}],
        [{"name": ["f"], "input_schema": {}}],
    ]
)
hostile = st.one_of(values, deep, structured, tools)


@dataclass(frozen=True)
class Case:
    route: str
    body: dict | None  # None: `raw` is sent as is
    raw: bytes = b""

    def content(self) -> bytes:
        if self.body is None:
            return self.raw
        return json.dumps(self.body).encode()  # NaN, Infinity and "\ud800" escapes included

    @property
    def wants_stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True


@st.composite
def cases(draw, model: str = MODEL) -> Case:
    route = draw(st.sampled_from(ROUTES))
    body = base_body(route, model)
    kind = draw(st.sampled_from(["replace", "replace", "inner", "bytes"]))
    if kind == "bytes":
        raw = bytearray(json.dumps(body).encode())
        at = draw(st.integers(0, len(raw) - 1))
        raw[at : at + 1] = draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc3", b"{", b""]))
        return Case(route, None, bytes(raw))
    # "inner": inside the first message, where the route has messages.
    target = body["messages"][0] if kind == "inner" and "messages" in body else body
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=8)))
        target[name] = draw(hostile)
    return Case(route, body)


def problem(case: Case, status: int, content_type: str, payload: bytes) -> str | None:
    """What is wrong with an answer, or None. 5xx, not the content type the request asked
    for (SSE for an accepted `"stream": true`, JSON otherwise, every error included), or an
    error that names a source file of the server or its libraries."""
    if status >= 500:
        return f"{status}: {payload[:300]!r}"
    if status >= 400 and (path := SOURCE_PATH.search(payload)):
        return f"{status} names a source path {path.group()!r}: {payload[:300]!r}"
    streamed = status == 200 and case.wants_stream
    wanted = "text/event-stream" if streamed else "application/json"
    if not content_type.startswith(wanted):
        return f"{status} answered {content_type!r}, wanted {wanted!r}"
    if not streamed:
        try:
            json.loads(payload)
        except ValueError:
            return f"{status} body is not JSON: {payload[:200]!r}"
    return None
