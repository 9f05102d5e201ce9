"""The HTTP frontend on SmolLM2, driven with the official openai and anthropic SDKs over TCP."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from anthropic import Anthropic
from server_harness import client, server, smollm_engine, wait_until

MODEL = "smollm2-135m"
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
HELLO = [{"role": "user", "content": "Say hello."}]


__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


def test_chat_stream_equals_non_stream_at_temperature_zero(client):
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "paris" in r.choices[0].message.content.lower()
    assert "".join(parts) == r.choices[0].message.content
    assert finish == r.choices[0].finish_reason == "stop"
    assert usage.completion_tokens == r.usage.completion_tokens > 0


def test_usage_reports_cached_prompt_tokens_on_repeat(client):
    client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=2)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    assert (
        r.usage.model_extra["prompt_cache_hit_tokens"]
        == r.usage.prompt_tokens_details.cached_tokens
    )


def test_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_responses_stream_has_created_deltas_completed(client):
    events, deltas = [], []
    with client.responses.stream(
        model=MODEL, input="Name a primary colour in one word.", max_output_tokens=8, temperature=0
    ) as stream:
        for ev in stream:
            events.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert events[0] == "response.created"
    assert "response.completed" in events and deltas
    assert final.output_text == "".join(deltas)
    assert final.usage.output_tokens == 8


def test_responses_non_stream_returns_output_text(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0)
    assert r.output_text.strip()
    assert r.usage.input_tokens > 0


def test_messages_stream_with_anthropic_sdk(server):
    ac = Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    with ac.messages.stream(model=MODEL, max_tokens=8, messages=HELLO) as s:
        text = "".join(s.text_stream)
        msg = s.get_final_message()
    assert text.strip()
    assert msg.content[0].text == text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens > 0


def test_messages_non_stream(server):
    ac = Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    msg = ac.messages.create(model=MODEL, max_tokens=6, messages=HELLO)
    assert msg.content[0].text.strip() and msg.stop_reason == "max_tokens"


def test_n2_returns_two_choices_with_summed_usage(client):
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=1.0, seed=3, max_tokens=6, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_n2_stream_indexes_choices(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        temperature=1.0,
        seed=3,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] and texts[1]
    assert usage.completion_tokens == 8


def test_logprobs_report_chosen_and_top_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_seed_reproduces_sampled_output(client):
    def ask():
        return (
            client.chat.completions.create(
                model=MODEL, messages=HELLO, temperature=0.9, seed=1234, max_tokens=12
            )
            .choices[0]
            .message.content
        )

    assert ask() == ask()


def test_stop_sequence_cuts_output(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
    text = full.choices[0].message.content
    stop = text.split()[1]  # a word the greedy answer is known to contain
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=8, stop=[stop]
    )
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "big": {"type": "boolean"},
        },
        "required": ["city", "big"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": schema, "strict": True},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"


def test_regex_output_fullmatches(client):
    pattern = r"(Paris|London|Rome), [0-9]{4}"
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=20,
        response_format={"type": "regex", "regex": pattern},
    )
    assert re.fullmatch(pattern, r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"


def test_ebnf_grammar_through_extension_field(client):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert r.choices[0].message.content in ("The answer is yes.", "The answer is no.")


def test_completions_endpoint_streams_plain_prompt(server):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert r["choices"][0]["text"] == "".join(chunks) != ""
    assert r["usage"]["completion_tokens"] == 5


def test_stream_disconnect_aborts_and_frees_kv(server):
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.engine.load().running == 1
    start = time.time()
    assert wait_until(lambda: server.engine.load().running == 0, timeout=5)
    assert server.engine.load().kv_usage == 0
    assert time.time() - start < 5


def test_non_stream_disconnect_aborts(server):
    # ignore_eos keeps the request running however fast the engine is: the client must leave first.
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1.5)
    assert wait_until(lambda: server.engine.load().running == 0, timeout=5)
    assert server.engine.load().kv_usage == 0


def test_models_lists_served_name(server):
    data = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]


def test_models_retrieve_gives_the_served_models_card(server, client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "deepserve")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("another-model")


def test_metrics_exports_latency_and_token_counters(server, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for name in [
        "deepserve:time_to_first_token_seconds_bucket",
        "deepserve:inter_token_latency_seconds_bucket",
        "deepserve:e2e_request_latency_seconds_bucket",
        "deepserve:prompt_tokens_total",
        "deepserve:generation_tokens_total",
        "deepserve:num_requests_running",
        "deepserve:num_requests_waiting",
        "deepserve:kv_cache_usage_perc",
        "deepserve:prefix_cache_hit_tokens_total",
        'deepserve:http_requests_total{endpoint="/v1/chat/completions"',
        'deepserve:request_success_total{finished_reason="length"',
        "deepserve:batch_invariant_mode",
    ]:
        assert name in text, name


@pytest.mark.parametrize("stream", [True, False])
def test_a_batch_of_prompts_cut_by_the_client_aborts_every_prompt(server, stream):
    body = {
        "model": MODEL,
        "prompt": ["The capital of France is", "Once upon a time"],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    url = server.base_url + "/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as s:
            lines = s.iter_lines()
            for _ in range(6):
                next(lines)
            assert server.engine.load().running == 2
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=1.5)
    assert wait_until(lambda: server.engine.load().running == 0, timeout=5)
    assert server.engine.load().kv_usage == 0
