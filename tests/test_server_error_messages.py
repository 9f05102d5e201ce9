"""Error messages a client can act on: they name the limit that was hit, give one range for one
field on every route, and never show a source path of the server or its libraries (xgrammar's
native errors carry its build's `.cc` paths). SmolLM2, driven with the official openai SDK."""

from __future__ import annotations

import openai
import pytest
from fuzz_bodies import SOURCE_PATH
from server_harness import client, server, smollm_engine

from deepserve.server.body_checks import MAX_STOP_STRINGS

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hi."}]

__all__ = ["client", "server", "smollm_engine"]  # shared fixtures (server_harness)


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, **kwargs)


def complete(client: openai.OpenAI, **kwargs):
    return client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, **kwargs)


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call(*args, **kwargs)
    return e.value.body["message"]


@pytest.mark.parametrize("route", [chat, complete])
def test_too_many_stop_strings_name_the_limit(client, route):
    message = refusal(route, client, stop=[f"s{i}" for i in range(100)])
    assert f"at most {MAX_STOP_STRINGS}" in message and "100" in message


@pytest.mark.parametrize("route", [chat, complete])
def test_a_stop_list_holding_a_number_names_the_item(client, route):
    assert "stop[1]" in refusal(route, client, stop=["a", 5])


def test_the_largest_uint64_seed_is_served_on_chat_as_on_completions(client):
    seed = 2**64 - 1
    assert chat(client, seed=seed).choices[0].finish_reason
    assert complete(client, seed=seed).choices[0].finish_reason


def test_a_seed_past_64_bits_gets_one_message_on_every_route(client):
    seed = 2**64
    assert refusal(chat, client, seed=seed) == refusal(complete, client, seed=seed)


CONSTRAINTS = {
    "ebnf": {"structured_outputs": {"grammar": "root ::= (("}},
    "regex": {"structured_outputs": {"regex": "(("}},
    "json_schema": {"structured_outputs": {"json": {"properties": {"a": {"$ref": "#/nope"}}}}},
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_a_refused_constraint_says_why_without_source_paths(client, kind):
    message = refusal(chat, client, extra_body=CONSTRAINTS[kind])
    assert message.startswith(f"invalid {kind} constraint: ")
    assert len(message) > len(f"invalid {kind} constraint: ") + 10  # the reason is kept
    assert not SOURCE_PATH.search(message.encode()), message
    assert ".cc" not in message
