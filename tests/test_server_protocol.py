"""Protocol details real OpenAI and Anthropic clients rely on, on `deepserve serve` (SmolLM2),
through the official SDKs or raw HTTP: JSON mode, stream usage, stored responses, abort metrics,
Anthropic token counting and the fields that are refused rather than ignored."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic
from prometheus_client.parser import text_string_to_metric_families
from server_harness import client, server, smollm_engine, wait_until

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Say hello."}]
CAT = [{"role": "user", "content": "Describe a cat as JSON."}]

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_object_response_is_an_object(client, seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAT,
        seed=seed,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    choice = r.choices[0]
    if choice.finish_reason == "length":
        assert choice.message.content.startswith("{")
    else:
        assert isinstance(json.loads(choice.message.content), dict)


def _chat_stream(client, **kwargs) -> list:
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=5, stream=True, **kwargs
    )
    return list(stream)


def test_stream_without_include_usage_carries_no_usage(client):
    chunks = _chat_stream(client)
    assert chunks and all(c.usage is None for c in chunks)


def test_stream_usage_comes_in_a_final_chunk_without_choices(client):
    chunks = _chat_stream(client, stream_options={"include_usage": True})
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None and c.choices for c in body)


def _aborted(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("request_success_total") and s.labels.get("finished_reason") == (
                "abort"
            ):
                return s.value
    return 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_cut_by_the_client_counts_as_abort(server, path):
    before = _aborted(server.base_url)
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True}
    body |= {"messages": HELLO} if path.endswith("chat/completions") else {"prompt": "Hello"}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as s:
        lines = s.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_until(lambda: _aborted(server.base_url) == before + 1, timeout=10)


# --- max_completion_tokens (the openai SDK's current name for the output budget) -------------


def test_max_completion_tokens_bounds_a_chat_answer(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("value", [0, -1])
def test_max_completion_tokens_below_one_is_refused(client, value):
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=value)


# --- integers outside 64 bits -------------------------------------------------------------

HUGE = 2**64


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HELLO, "seed": HUGE}),
        ("/v1/chat/completions", {"messages": HELLO, "top_k": HUGE}),
        ("/v1/chat/completions", {"messages": HELLO, "vendor_field": -HUGE}),
        ("/v1/chat/completions", {"messages": HELLO, "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": HUGE}},
        }}),
        ("/v1/responses", {"input": "hi", "metadata": {"n": [1, HUGE]}}),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 5, "top_k": HUGE}),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 5, "metadata": {"user_id": HUGE}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5, "seed": HUGE}),
    ],
)  # fmt: skip
def test_integer_outside_64_bits_is_a_400(server, path, body):
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert "64 bits" in r.json()["error"]["message"]


def test_top_k_past_the_vocabulary_samples_as_off(client):
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, seed=1, extra_body={"top_k": 2**63 - 1}
    )
    assert r.usage.completion_tokens >= 1


# --- previous_response_id --------------------------------------------------------------------


def _respond(client, text: str, **kwargs):
    return client.responses.create(
        model=MODEL, input=text, max_output_tokens=6, temperature=0, **kwargs
    )


def test_previous_response_id_continues_the_conversation(client):
    first = _respond(client, "My name is Ada.")
    alone = _respond(client, "What is my name?")
    chained = _respond(client, "What is my name?", previous_response_id=first.id)
    # The chained prompt holds the first turn, its answer and the new question.
    assert chained.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    again = _respond(client, "Say it again.", previous_response_id=chained.id)
    assert again.usage.input_tokens > chained.usage.input_tokens + chained.usage.output_tokens


def test_streamed_response_is_stored_for_the_next_turn(client):
    with client.responses.stream(
        model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0
    ) as stream:
        first = stream.get_final_response()
    chained = _respond(client, "What is my name?", previous_response_id=first.id)
    assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_unknown_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="resp_made_up"):
        _respond(client, "Hi", previous_response_id="resp_made_up")


def test_response_with_store_false_cannot_be_continued(client):
    first = _respond(client, "Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        _respond(client, "Hi", previous_response_id=first.id)


# --- refused rather than ignored ---------------------------------------------------------------

IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/chat/completions", {"messages": HELLO, "tool_choice": "auto"}, "tools"),
        ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "tools"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
         "stream"),
        ("/v1/messages", {"messages": HELLO}, "max_tokens"),
        ("/v1/messages", {"messages": [{"role": "system", "content": "Be brief."}, *HELLO],
                          "max_tokens": 5}, "system"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]}, "not served"),
        ("/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": IMAGE_URL}]}]}, "not served"),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]}, "not served"),
        ("/v1/chat/completions", {"messages": HELLO,
                                  "structured_outputs": {"choice": ["yes", "no"]}}, "not served"),
        ("/v1/chat/completions", {"messages": HELLO, "continue_final_message": True},
         "not served"),
    ],
)  # fmt: skip
def test_unserved_or_invalid_field_is_a_400_that_says_so(server, path, body, says):
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert says in r.text


def test_tool_choice_none_without_tools_is_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, tool_choice="none"
    )
    assert r.choices[0].message.content is not None


# --- Anthropic token counting ------------------------------------------------------------------


def test_anthropic_count_tokens_equals_the_prompt_of_a_message(server):
    claude = Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Say hello."}]
    counted = claude.messages.count_tokens(model=MODEL, messages=ask, system="Be brief.")
    sent = claude.messages.create(model=MODEL, messages=ask, system="Be brief.", max_tokens=1)
    assert counted.input_tokens == sent.usage.input_tokens > 0


def test_anthropic_count_tokens_refuses_a_system_role_message(server):
    claude = Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="system"):
        claude.messages.count_tokens(
            model=MODEL, messages=[{"role": "system", "content": "x"}, *HELLO]
        )
