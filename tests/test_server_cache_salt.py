"""`cache_salt` and salting by API key (the default with several keys) close the prefix cache as a
cross-tenant oracle.

The probe: a victim sends a prompt; the attacker sends the same prompt and reads how many of its
tokens came from the cache. Under a different salt (or key) that number must be 0, while the same
salt still hits (else the probe could not have seen anything). Every generating route is probed.
"""

from __future__ import annotations

import re

import httpx
import pytest
from server_harness import running_server

MODEL = "smollm2-135m"
# Long enough for several full KV blocks whatever the template adds.
SECRET = "The merger with Northwind closes on the 14th; tell nobody. " * 6


def body(route: str, text: str, salt: str | None) -> dict:
    b: dict = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    if route == "/v1/completions":
        b["prompt"] = text
    elif route == "/v1/responses":
        b = {"model": MODEL, "input": text, "max_output_tokens": 1, "temperature": 0}
    else:
        b["messages"] = [{"role": "user", "content": text}]
    if salt is not None:
        b["cache_salt"] = salt
    return b


def cached_total(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    found = re.search(r"^deepserve:prefix_cache_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1))


def cached_tokens(client: httpx.Client, route: str, text: str, salt=None, key=None) -> float:
    """Prompt tokens of this request served from the cache (as the server counted them)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    before = cached_total(client)
    r = client.post(route, json=body(route, text, salt), headers=headers)
    assert r.status_code == 200, r.text
    if route == "/v1/chat/completions":  # and what the client is told agrees
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens", 0) == cached_total(client) - before
    return cached_total(client) - before


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.fixture(scope="module")
def server(smollm_engine):
    with running_server(smollm_engine, MODEL) as srv:
        yield httpx.Client(base_url=srv.base_url, timeout=120)


@pytest.fixture(scope="module")
def keyed(smollm_engine):
    """Two API keys and default flags: salted by key."""
    with running_server(smollm_engine, MODEL, api_keys=("key-a", "key-b")) as srv:
        yield httpx.Client(base_url=srv.base_url, timeout=120)


@pytest.mark.parametrize("route", ROUTES)
def test_a_different_salt_gets_no_cached_tokens(server, route):
    # Salts of their own per route: the chat template's system prompt is a block all chat
    # routes share, and it would hit under a salt another test used.
    secret = f"{route} {SECRET}"
    cached_tokens(server, route, secret, salt=f"victim {route}")
    assert cached_tokens(server, route, secret, salt=f"attacker {route}") == 0
    assert cached_tokens(server, route, secret, salt=f"victim {route}") > 0


def test_a_salted_prompt_is_hidden_from_unsalted_probes_and_vice_versa(server):
    secret = f"both ways {SECRET}"
    route = "/v1/completions"
    cached_tokens(server, route, secret)
    assert cached_tokens(server, route, secret, salt="both ways") == 0
    assert cached_tokens(server, route, secret) > 0


@pytest.mark.parametrize("route", ROUTES)
def test_another_api_key_gets_no_cached_tokens(keyed, route):
    secret = f"keyed {route} {SECRET}"
    salt = f"per route {route}"  # keeps the template's shared block out of the probe
    cached_tokens(keyed, route, secret, salt=salt, key="key-a")
    assert cached_tokens(keyed, route, secret, salt=salt, key="key-b") == 0
    assert cached_tokens(keyed, route, secret, salt=salt, key="key-a") > 0


def test_a_client_salt_cannot_reach_another_keys_namespace(keyed):
    route = "/v1/chat/completions"
    secret = f"salted key {SECRET}"
    cached_tokens(keyed, route, secret, salt="shared", key="key-a")
    assert cached_tokens(keyed, route, secret, salt="shared", key="key-b") == 0
    assert cached_tokens(keyed, route, secret, salt="shared", key="key-a") > 0


def test_one_key_shared_by_a_team_shares_its_cache(smollm_engine):
    with running_server(smollm_engine, MODEL, api_keys=("team",)) as srv:
        client = httpx.Client(base_url=srv.base_url, timeout=120)
        route, secret = "/v1/completions", f"one team key {SECRET}"
        cached_tokens(client, route, secret, key="team")  # one member
        assert cached_tokens(client, route, secret, key="team") > 0  # another


def test_keys_of_one_team_share_the_cache_with_salting_turned_off(smollm_engine):
    keys = ("alice", "bob")
    with running_server(smollm_engine, MODEL, api_keys=keys, cache_salt_by_api_key=False) as srv:
        client = httpx.Client(base_url=srv.base_url, timeout=120)
        route, secret = "/v1/completions", f"team keys {SECRET}"
        cached_tokens(client, route, secret, key="alice")
        assert cached_tokens(client, route, secret, key="bob") > 0


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 257])
def test_a_bad_cache_salt_is_a_400_naming_it(server, salt):
    r = server.post(
        "/v1/chat/completions", json={**body(ROUTES[0], "hi", None), "cache_salt": salt}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
