"""POST /tokenize and /detokenize (vLLM's routes) on SmolLM2: the ids the generating routes
count, a round trip to the text, and the refusals."""

from __future__ import annotations

import httpx
import pytest
from server_harness import client, server, smollm_engine

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Hello there"}]

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_a_chat_tokenizes_to_the_prompt_chat_completions_counts(server, client):
    tokens = post(server, "/tokenize", {"model": MODEL, "messages": HELLO}).json()
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert tokens["count"] == len(tokens["tokens"]) == answer.usage.prompt_tokens


def test_a_prompt_tokenizes_to_the_ids_completions_counts(server, client):
    tokens = post(server, "/tokenize", {"prompt": "The capital of France is"}).json()
    answer = client.completions.create(model=MODEL, prompt=tokens["tokens"], max_tokens=1)
    again = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1)
    assert answer.usage.prompt_tokens == again.usage.prompt_tokens == tokens["count"]
    assert tokens["max_model_len"] == 8192


def test_detokenize_gives_back_the_tokenized_text(server):
    text = "Paris is the capital of France."
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": "abc"}),
    ],
)
def test_malformed_bodies_are_400(server, path, body):
    assert post(server, path, body).status_code == 400


def test_another_models_name_is_404(server):
    assert post(server, "/tokenize", {"model": "other", "prompt": "hi"}).status_code == 404
