"""The long fuzz run: thousands of hostile bodies (tests/fuzz_bodies.py) against a running server.

Counts every answer by status, and lists the problems: a 5xx, an answer in another content type
than the request asked for, a hang (no complete answer within --timeout). Then sends a normal
request to each route, which must be served. Prints one JSON object.

    .venv/bin/deepserve serve --port 8011 &
    .venv/bin/python benchmarks/fuzz_server.py --base-url http://127.0.0.1:8011 --cases 3000
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_bodies import ROUTES, Case, base_body, cases, problem  # noqa: E402


def send(client: httpx.Client, case: Case, statuses: collections.Counter) -> str | None:
    """Send one case; what is wrong with its answer, or None. A keep-alive connection the server
    closed just as it was reused is retried once on a fresh one (the client's race, not a case
    the server failed)."""
    for attempt in range(2):
        try:
            with client.stream("POST", case.route, content=case.content()) as r:
                payload = r.read()
        except httpx.RemoteProtocolError:
            if attempt:
                raise
            continue
        statuses[str(r.status_code)] += 1
        return problem(case, r.status_code, r.headers.get("content-type", ""), payload)
    return None


def run(base_url: str, n: int, seed: int, timeout: float, model: str, key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    statuses: collections.Counter[str] = collections.Counter()
    problems: list[dict] = []
    client = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(case=cases(model))
    def one(case: Case) -> None:
        try:
            found = send(client, case, statuses)
        except httpx.TimeoutException:
            statuses["hang"] += 1
            found = f"no answer within {timeout}s"
        except httpx.TransportError as e:  # the connection, not the answer: counted, not fatal
            statuses["no answer"] += 1
            found = f"{type(e).__name__}: {e}"
        if found:
            problems.append({"route": case.route, "case": repr(case)[:300], "problem": found})

    start = time.perf_counter()
    one()
    elapsed = time.perf_counter() - start
    after = {
        route: client.post(route, json=base_body(route, model)).status_code for route in ROUTES
    }
    return {
        "cases": sum(statuses.values()),
        "seconds": round(elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "hangs": statuses["hang"],
        "no_answer": statuses["no answer"],
        "problems": len(problems),
        "first_problems": problems[:20],
        "normal_requests_after": after,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--cases", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a hang")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    result = run(args.base_url, args.cases, args.seed, args.timeout, args.model, args.api_key)
    print(json.dumps(result, indent=1))
    ok = not result["problems"] and set(result["normal_requests_after"].values()) == {200}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
