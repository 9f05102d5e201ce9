"""Benchmark: the router's own overhead. The same tiny request, one at a time, five ways:

- worker: straight to a worker's internal API (token ids in, NDJSON out);
- frontend: the OpenAI frontend -> router -> that worker (uvloop + httptools, the default when
  installed);
- serve_uvloop: `deepserve serve`, the same FastAPI app with the engine in-process (no router
  hop), on the same event loop as the frontend;
- frontend_asyncio: a second frontend -> worker pair on asyncio's loop and h11 (the stack before
  uvloop/httptools), for the A/B;
- serve: `deepserve serve --loop asyncio` (its only loop before serve took --loop).

frontend - serve_uvloop is what the router hop adds (goal: < 2 ms at p50): the same request, the
same loop and HTTP parser, with and without the hop. frontend - worker is the whole frontend (HTTP
+ protocol + tokenizer + router). One prompt, repeated, so every run is a prefix-cache hit and
compute stays small and equal; the paths take turns request by request.

    .venv/bin/python benchmarks/router_overhead.py [--iterations 200] [--no-write]

The table goes to benchmarks/RESULTS.md between its router_overhead markers, with the command, the
commit and the load average before and after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
from results_md import write_section
from router_load import pct
from router_load import router_cluster as rc

from deepserve.disagg import protocol as P

PROMPT = "The quick brown fox jumps over the lazy dog."
BEGIN, END = "<!-- router_overhead:begin -->", "<!-- router_overhead:end -->"
PATHS = {
    "worker": "straight to the worker's internal API (sync httpx)",
    "frontend": "frontend → router → worker (uvloop + httptools, the default)",
    "serve_uvloop": "`deepserve serve` on uvloop (same app, engine in-process)",
    "frontend_asyncio": "frontend → router → worker on asyncio + h11 (`--loop asyncio --http h11`)",
    "serve": "`deepserve serve --loop asyncio` (asyncio's loop, httptools)",
}


def timed(calls: dict, iterations: int) -> dict[str, list[float]]:
    """Latency of each call in ms; the calls take turns, so drift in machine load hits all alike."""
    for fn in calls.values():
        fn()  # warm: connection, caches
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iterations):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - start) * 1000)
    return out


def completion(http: httpx.Client, url: str, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
    return lambda: http.post(url + "/v1/completions", json=body).raise_for_status()


def direct(http: httpx.Client, w: rc.Proc, token_ids: list[int]):
    body = P.GenerateRequest("bench", token_ids, {"max_tokens": 1, "temperature": 0.0}).to_json()
    return lambda: http.post(
        w.url + P.GENERATE_PATH, json=body, headers=w.headers
    ).raise_for_status()


def serve_proc(model: str, loop: str) -> rc.Proc:
    port = rc.free_port()
    argv = [*rc.CLI, "serve", "--model", model, "--port", str(port), "--num-threads", "1"]
    return rc.Proc(f"serve-{port}", [*argv, "--loop", loop], port, "/health")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    slow_io = ("--loop", "asyncio", "--http", "h11")
    w = rc.worker("mixed", args.model, None)
    w_slow = rc.worker("mixed", args.model, None, *slow_io)
    rc.start_all(w, w_slow)
    front = rc.frontend(args.model, workers=[w])
    front_slow = rc.frontend(args.model, workers=[w_slow], extra=slow_io)
    serve_uv, serve = serve_proc(args.model, "uvloop"), serve_proc(args.model, "asyncio")
    procs = (front, front_slow, serve_uv, serve)
    try:
        rc.start_all(*procs)
        with httpx.Client(timeout=60) as http:
            card = http.get(w.url + P.MODEL_PATH, headers=w.headers).json()
            from tokenizers import Tokenizer

            ids = Tokenizer.from_str(card["tokenizer"]).encode(PROMPT).ids
            calls = {
                "worker": direct(http, w, ids),
                "frontend": completion(http, front.url, args.model),
                "serve_uvloop": completion(http, serve_uv.url, args.model),
                "frontend_asyncio": completion(http, front_slow.url, args.model),
                "serve": completion(http, serve.url, args.model),
            }
            runs = timed(calls, args.iterations)
    finally:
        rc.stop_all(*procs, w, w_slow)
    result = {k: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99)} for k, v in runs.items()}
    result["router_hop_p50_ms"] = result["frontend"]["p50_ms"] - result["serve_uvloop"]["p50_ms"]
    result["router_hop_asyncio_p50_ms"] = (
        result["frontend_asyncio"]["p50_ms"] - result["serve"]["p50_ms"]
    )
    result["frontend_total_p50_ms"] = result["frontend"]["p50_ms"] - result["worker"]["p50_ms"]
    result["load_avg_1m"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(result, indent=2))
    if not args.no_write:
        command = " ".join([".venv/bin/python", "benchmarks/router_overhead.py", *sys.argv[1:]])
        write_section(BEGIN, END, render(result, command))


def render(result: dict, command: str) -> str:
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.splitlines()
    tree = commit.stdout.strip() + (f" (+ {len(dirty)} files changed in the tree)" if dirty else "")
    before, after = result["load_avg_1m"]
    rows = [
        f"| {label} | {result[k]['p50_ms']:.1f} ms | {result[k]['p99_ms']:.1f} ms |"
        for k, label in PATHS.items()
    ]
    intro = (
        f"`{command}` at {tree}, load {before:.1f} before and {after:.1f} after — the same "
        "`/v1/completions` request (1 output token, prefix-cache hit), five paths taking turns "
        "request by request:"
    )
    hop = (
        f"Router hop (frontend − serve, each on the same loop) at p50: "
        f"**{result['router_hop_p50_ms']:.1f} ms** ({result['router_hop_asyncio_p50_ms']:.1f} ms "
        f"on asyncio + h11); frontend − worker: **{result['frontend_total_p50_ms']:.1f} ms**."
    )
    lines = [
        BEGIN,
        *textwrap.wrap(intro, 100, break_on_hyphens=False),
        "",
        "| path | p50 | p99 |",
        "|---|---|---|",
        *rows,
        "",
        *textwrap.wrap(hop, 100, break_on_hyphens=False),
        END,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
