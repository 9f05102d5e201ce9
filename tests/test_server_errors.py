"""Bad input gets the protocol's error object with the right status, never a 5xx; the key is enforced.

The expected shapes are the SDKs' own: the openai SDK raises its typed errors from OpenAI's error
object, the anthropic SDK from Anthropic's.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_harness import running_server, smollm_engine

MODEL = "smollm2-135m"
KEY = "test-secret"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AUTH = {"Authorization": f"Bearer {KEY}"}

__all__ = ["smollm_engine"]


@pytest.fixture(scope="module")
def server(smollm_engine):
    with running_server(smollm_engine, MODEL, api_key=KEY) as srv:
        yield srv


def post(server, body, path="/v1/chat/completions", headers=AUTH, **kw) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.base_url + path, headers=headers, timeout=60, **kw)


def openai_error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}],
    ids=["no key", "wrong bearer", "wrong x-api-key"],
)
def test_missing_or_wrong_key_is_401(server, headers):
    r = post(server, OK, headers=headers)
    assert r.status_code == 401
    assert openai_error(r)["type"] == "authentication_error"


def test_x_api_key_header_is_accepted(server):
    assert post(server, OK, headers={"x-api-key": KEY}).status_code == 200


def test_health_needs_no_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_openai_sdk_raises_authentication_error(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**OK)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        {"model": MODEL},
        {**OK, "max_tokens": -5},
        {**OK, "max_tokens": 10**9},
        {**OK, "temperature": "hot"},
        {**OK, "messages": [{"role": "wizard", "content": "x"}]},
        {**OK, "n": 0},
        {**OK, "logit_bias": {"99999999": 5}},
        {**OK, "top_logprobs": 50, "logprobs": True},
        {
            **OK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        },
        {**OK, "response_format": {"type": "regex", "regex": "(unclosed"}},
        {**OK, "structured_outputs": {"grammar": "root ::= missing_rule"}},
        {**OK, "messages": [{"role": "user", "content": "word " * 9000}]},
    ],
    ids=[
        "malformed json",
        "not an object",
        "no messages",
        "negative max_tokens",
        "absurd max_tokens",
        "bad temperature",
        "bad role",
        "n zero",
        "logit_bias id",
        "top_logprobs",
        "invalid schema",
        "invalid regex",
        "invalid grammar",
        "prompt over context",
    ],
)
def test_bad_chat_request_is_400_with_openai_error(server, body):
    r = post(server, body)
    assert r.status_code == 400, r.text
    openai_error(r)


def test_unknown_model_is_404(server):
    r = post(server, {**OK, "model": "no-such-model"})
    assert r.status_code == 404
    assert "no-such-model" in openai_error(r)["message"]


def test_oversized_body_is_413(server):
    r = post(server, {**OK, "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]})
    assert r.status_code == 413
    openai_error(r)


def test_messages_errors_use_anthropic_shape(server):
    ac = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    r = post(
        server, {"model": MODEL, "max_tokens": 4}, path="/v1/messages", headers={"x-api-key": KEY}
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["message"]


def test_responses_bad_input_is_400(server):
    r = post(server, {"model": MODEL, "input": 5}, path="/v1/responses")
    assert r.status_code == 400
    openai_error(r)


def test_completions_bad_prompt_is_400(server):
    r = post(server, {"model": MODEL, "prompt": [], "max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 400
    openai_error(r)


def test_unknown_route_is_404_error_object(server):
    r = httpx.get(server.base_url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404
    openai_error(r)


def test_good_request_after_bad_ones_succeeds(server):
    for body in (b"{", {**OK, "max_tokens": -1}):
        post(server, body)
    assert post(server, OK).status_code == 200
