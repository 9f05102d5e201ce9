"""server/body_checks.py and server/cache_salt.py alone: the walk's bounds and the salt's rules."""

from __future__ import annotations

import pytest

from deepserve.server.body_checks import MAX_DEPTH, check_body
from deepserve.server.cache_salt import request_salt, tenant_id
from deepserve.server.errors import HTTPError


def refused(body: dict, max_chars: int = 10_000) -> HTTPError:
    with pytest.raises(HTTPError) as e:
        check_body(body, max_chars)
    assert e.value.status == 400
    return e.value


def test_nesting_far_past_the_limit_is_refused_without_recursion():
    value: object = 1
    for _ in range(100_000):
        value = [value]
    assert "nested deeper" in refused({"metadata": value}).message


def test_nesting_at_the_limit_is_accepted():
    value: object = 1
    for _ in range(MAX_DEPTH - 2):
        value = {"a": value}
    check_body({"metadata": value}, 10_000)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_integers_outside_64_bits_are_refused(value):
    assert refused({"seed": value}).param == "seed"


def test_a_uint64_seed_fits():
    check_body({"seed": 2**64 - 1}, 10_000)


def test_text_beyond_the_bound_is_refused_before_anything_reads_it():
    assert "characters" in refused({"prompt": "x" * 101}, max_chars=100).message


def test_a_lone_surrogate_in_a_key_is_refused():
    assert "surrogate" in refused({"a\udc00": 1}).message


def test_another_tenants_salt_cannot_be_named():
    a, b = tenant_id("key-a"), tenant_id("key-b")
    assert request_salt(None, a) != request_salt(a, b)
    assert request_salt("x", a) != request_salt("x", b)
    assert request_salt("x", None) == "x" and request_salt(None, None) is None
