"""Fuzzed bodies on the four generating routes (tests/fuzz_bodies.py): no 5xx, every answer in
the content type asked for, none hangs, and normal requests are served afterwards.

Bounded for CI: a fixed number of cases from a fixed seed. benchmarks/fuzz_server.py runs the
same strategies for thousands of cases against any server.
"""

from __future__ import annotations

import httpx
import pytest
from fuzz_bodies import MODEL, ROUTES, Case, base_body, cases, problem
from hypothesis import HealthCheck, given, settings
from server_harness import running_server

ANSWER_TIMEOUT_S = 60.0  # a hang is an answer slower than this


@pytest.fixture(scope="module")
def client(smollm_engine):
    with (
        running_server(smollm_engine, MODEL) as srv,
        httpx.Client(base_url=srv.base_url, timeout=ANSWER_TIMEOUT_S) as c,
    ):
        yield c


def send(client: httpx.Client, case: Case) -> str | None:
    headers = {"Content-Type": "application/json"}
    with client.stream("POST", case.route, content=case.content(), headers=headers) as r:
        payload = r.read()  # a stream too, to its end: a hang times out here
        return problem(case, r.status_code, r.headers.get("content-type", ""), payload)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_no_fuzzed_body_gets_a_5xx_or_the_wrong_content_type(client, case):
    assert send(client, case) is None, case


@pytest.mark.parametrize("route", ROUTES)
def test_normal_requests_are_served_after_the_fuzzing(client, route):
    # Runs after the fuzz test in file order: the engine must still serve every route.
    r = client.post(route, json=base_body(route))
    assert r.status_code == 200, r.text
