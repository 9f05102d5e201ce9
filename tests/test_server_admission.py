"""One admission for every generation endpoint and both topologies: the same bad field gets the
same status and the same message on /v1/chat/completions, /v1/completions, /v1/responses and
/v1/messages, whether the app runs the engine in-process (`deepserve serve`) or routes to a
prefill and a decode worker (`deepserve frontend`). Both apps share one SmolLM2 engine."""

from __future__ import annotations

import re

import httpx
import pytest
from server_harness import running_frontend, running_server, running_worker, smollm_engine

MODEL = "smollm2-135m"
TOKEN = "admission-test-token"
VOCAB = 49152

__all__ = ["smollm_engine"]

MESSAGES = [{"role": "user", "content": "hi"}]
# path -> (a good body, the name that endpoint gives the output budget)
ENDPOINTS = {
    "/v1/chat/completions": ({"messages": MESSAGES}, "max_tokens"),
    "/v1/completions": ({"prompt": "hi"}, "max_tokens"),
    "/v1/responses": ({"input": "hi"}, "max_output_tokens"),
    "/v1/messages": ({"messages": MESSAGES}, "max_tokens"),
}

# (field, value, the error message as a pattern; {budget} is the endpoint's max-tokens field)
BAD_FIELDS = [
    ("temperature", "hot", r"^temperature must be a number$"),
    ("temperature", 3, r"^temperature must be in \[0, 2\]$"),
    ("top_p", 0, r"^top_p must be in \(0, 1\]$"),
    ("top_k", 2.5, r"^top_k must be an integer$"),
    ("top_k", -2, r"^top_k must be in \[0, 9223372036854775807\]$"),
    ("min_p", 2, r"^min_p must be in \[0, 1\]$"),
    ("presence_penalty", 5, r"^presence_penalty must be in \[-2, 2\]$"),
    ("frequency_penalty", "x", r"^frequency_penalty must be a number$"),
    ("repetition_penalty", 0, r"^repetition_penalty must be in \(0, inf\]$"),
    ("seed", "x", r"^seed must be an integer$"),
    ("min_tokens", -1, r"^min_tokens must be in \[0, inf\]$"),
    ("ignore_eos", "yes", r"^ignore_eos must be a boolean$"),
    ("stop_token_ids", ["a"], r"^stop_token_ids must be a list of integers$"),
    ("stop_token_ids", [VOCAB], rf"^token id {VOCAB} is outside the vocabulary \(size {VOCAB}\)$"),
    ("logit_bias", {"1": 500}, r"^logit_bias must map token ids to numbers in \[-100, 100\]$"),
    ("logit_bias", {str(VOCAB + 5): 1}, rf"^token id {VOCAB + 5} is outside the vocabulary"),
    ("{budget}", 0, r"^{budget} must be in \[1, inf\]$"),
    ("{budget}", "x", r"^{budget} must be an integer$"),
    ("{budget}", 10**9, r"^max_tokens 1000000000 plus the prompt's \d+ tokens exceeds the context"),
    ("min_tokens", 50, r"^min_tokens 50 exceeds max_tokens 4$"),
]


@pytest.fixture(scope="module")
def topologies(smollm_engine):
    """{"colocated": base URL, "disaggregated": base URL}."""
    with (
        running_server(smollm_engine, MODEL) as colocated,
        running_worker(smollm_engine, "prefill", TOKEN) as prefill,
        running_worker(smollm_engine, "decode", TOKEN) as decode,
        running_frontend({"prefill": (prefill,), "decode": (decode,)}, MODEL, TOKEN) as front,
    ):
        yield {"colocated": colocated.base_url, "disaggregated": front.base_url}


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def body_for(path: str, field: str | None = None, value=None) -> tuple[dict, str]:
    good, budget = ENDPOINTS[path]
    body = {"model": MODEL, **good, budget: 4}
    if field is not None:
        body[field.format(budget=budget)] = value
    return body, budget


@pytest.mark.parametrize("field,value,pattern", BAD_FIELDS)
def test_a_bad_field_gets_one_error_on_every_endpoint_and_topology(
    topologies, field, value, pattern
):
    seen = {}
    for topology, base in topologies.items():
        for path in ENDPOINTS:
            body, budget = body_for(path, field, value)
            r = post(base, path, body)
            assert r.status_code == 400, (topology, path, r.text)
            message = r.json()["error"]["message"]
            assert re.search(pattern.format(budget=budget), message), (topology, path, message)
            if "{budget}" in field:
                message = message.replace(budget, "{budget}")
            seen[(topology, path)] = message
    # Beyond the pattern: the very same words wherever the prompt's length does not enter.
    if "prompt's" not in pattern:
        assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_top_k_minus_one_means_off_on_every_endpoint(topologies, topology, path):
    body, _ = body_for(path, "top_k", -1)
    body.update({ENDPOINTS[path][1]: 1, "temperature": 0})
    r = post(topologies[topology], path, body)
    assert r.status_code == 200, r.text


def test_a_grammar_that_does_not_compile_is_the_same_400_in_both_topologies(topologies):
    body, _ = body_for("/v1/chat/completions", "structured_outputs", {"regex": "("})
    messages = set()
    for base in topologies.values():
        r = post(base, "/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        messages.add(r.json()["error"]["message"])
    assert len(messages) == 1, messages
