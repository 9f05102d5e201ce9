"""Each class of body that answered 5xx in the issue-18 fuzz run is now a 400 in the route's error
shape (OpenAI's, Anthropic's on /v1/messages) that names the field."""

from __future__ import annotations

import json

import httpx
import pytest
from fuzz_bodies import ROUTES, base_body
from server_harness import running_server

MODEL = "smollm2-135m"


def deep(n: int) -> object:
    value: object = 1
    for _ in range(n):
        value = {"a": value}
    return value


# (what, field named in the answer, change to a valid body)
HOSTILE = [
    ("integer past 64 bits", "top_k", {"top_k": 2**64}),
    ("integer past signed 64 bits", "top_k", {"top_k": 2**63}),
    ("negative integer past 64 bits", "seed", {"seed": -(2**64)}),
    ("stream_options not an object", "stream_options", {"stream_options": "yes"}),
    ("tools not an array", "tools", {"tools": "tools"}),
    ("a tool name not a string", "tools[0].function.name", {"tools": [{"function": {"name": 5}}]}),
    ("nesting 500 deep", "metadata", {"metadata": deep(500)}),
    (
        "json_schema not an object",
        "response_format.json_schema",
        {"response_format": {"type": "json_schema", "json_schema": "x"}},
    ),
    (
        "schema nested 200 deep",
        "response_format.json_schema.schema",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": deep(200)}}},
    ),
    ("lone surrogate", "user", {"user": "a\ud800b"}),
    ("truthy non-boolean stream", "stream", {"stream": 1}),
    ("string stream", "stream", {"stream": "false"}),
    ("number out of range", "top_p", {"top_p": 2}),
]


@pytest.fixture(scope="module")
def client(smollm_engine):
    with (
        running_server(smollm_engine, MODEL) as srv,
        httpx.Client(base_url=srv.base_url, timeout=120) as c,
    ):
        yield c


def post(client: httpx.Client, route: str, body: dict) -> httpx.Response:
    # json.dumps writes a lone surrogate as its \\ud800 escape, as a hostile client would.
    content = json.dumps(body).encode()
    return client.post(route, content=content, headers={"Content-Type": "application/json"})


def message_and_param(route: str, answer: dict) -> tuple[str, str | None]:
    if route == "/v1/messages":
        assert answer["type"] == "error"
        return answer["error"]["message"], None
    return answer["error"]["message"], answer["error"]["param"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("what", "field", "change"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_field_is_a_400_naming_it(client, route, what, field, change):
    r = post(client, route, {**base_body(route), **change})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    message, param = message_and_param(route, r.json())
    assert message.startswith(field.split(".")[0]), message
    if param is not None:
        assert param.startswith(field.split(".")[0])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_top_k_is_a_400(client, route, raw):
    text = json.dumps(base_body(route))[:-1] + f', "top_k": {raw}}}'
    r = client.post(route, content=text.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("route", ROUTES)
def test_invalid_utf8_is_a_400(client, route):
    text = json.dumps(base_body(route)).encode().replace(b"Say hi.", b"Say \xff hi.")
    text = text.replace(b"Once upon", b"Once \xed\xa0\x80 upon")  # an encoded surrogate too
    r = client.post(route, content=text, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text


def test_an_overlong_regex_is_refused_before_compiling(client):
    body = {**base_body(ROUTES[0]), "response_format": {"type": "regex", "regex": "a" * 100_000}}
    r = post(client, ROUTES[0], body)
    assert r.status_code == 400
    assert "limit" in r.json()["error"]["message"]
