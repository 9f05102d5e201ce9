"""The protocol fixes whose path differs behind `deepserve frontend` with a prefill and a decode
worker (in-process, over one shared SmolLM2 engine): the output budget reaches the decode worker,
64-bit overflows stop at the frontend, a cut stream counts as an abort on the frontend, and stored
Responses are shared through Redis, so another frontend continues them."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_frontend, running_worker, smollm_engine, wait_until

MODEL = "smollm2-135m"
TOKEN = "protocol-test-token"
HELLO = [{"role": "user", "content": "Say hello."}]

__all__ = ["smollm_engine"]


@pytest.fixture(scope="module")
def fronts(smollm_engine, redis_server):
    """Two frontends over the same prefill + decode workers, sharing one Redis."""
    with (
        running_worker(smollm_engine, "prefill", TOKEN) as prefill,
        running_worker(smollm_engine, "decode", TOKEN) as decode,
        running_frontend(
            {"prefill": (prefill,), "decode": (decode,)}, MODEL, TOKEN, redis_server.url
        ) as a,
        running_frontend(
            {"prefill": (prefill,), "decode": (decode,)}, MODEL, TOKEN, redis_server.url
        ) as b,
    ):
        yield a.base_url, b.base_url


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_max_completion_tokens_bounds_a_disaggregated_answer(fronts):
    r = sdk(fronts[0]).chat.completions.create(
        model=MODEL, messages=HELLO, max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("value", [0, -1])
def test_max_completion_tokens_below_one_is_refused_by_the_frontend(fronts, value):
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        sdk(fronts[0]).chat.completions.create(
            model=MODEL, messages=HELLO, max_completion_tokens=value
        )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "top_k": 2**64}),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 4, "metadata": {"user_id": -(2**64)}}),
    ],
)
def test_integer_outside_64_bits_is_a_400_at_the_frontend(fronts, path, body):
    r = httpx.post(fronts[0] + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400 and "64 bits" in r.text, r.text


def _aborted(base_url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            abort = s.labels.get("finished_reason") == "abort"
            if s.name.endswith("request_success_total") and abort:
                return s.value
    return 0.0


def test_stream_cut_by_the_client_counts_as_abort_on_the_frontend(fronts):
    base = fronts[0]
    before = _aborted(base)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        lines = s.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_until(lambda: _aborted(base) == before + 1, timeout=10)


def test_a_response_stored_through_redis_continues_on_another_frontend(fronts):
    a, b = (sdk(url) for url in fronts)
    first = a.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    chained = b.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        b.responses.create(
            model=MODEL, input="Hi", previous_response_id="resp_made_up", max_output_tokens=4
        )
