"""Before/after driver: router_overhead.py and serve_overhead.py of two checkouts, taking turns.

Each checkout runs its own copy of the two benchmarks with its own installed venv (so each
measures its own code), round by round, the order swapped every round so a drift in the machine's
load does not favour one side. The 1-minute load average is recorded around every run; the summary
is the median over rounds of each figure.

    .venv/bin/python benchmarks/before_after.py --before /work/wt/before226 --after . --rounds 3
    .venv/bin/python benchmarks/before_after.py ... --skip-router --serve-threads 1

Both checkouts need `.venv` (with the package installed editable from that checkout). Prints one
JSON object: every run, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

ROUTER = ["benchmarks/router_overhead.py", "--model", "tiny-deepseek", "--no-write"]
SERVE = ["benchmarks/serve_overhead.py", "--concurrency", "16", "--num-prompts", "32"]


def run_json(tree: Path, script: list[str]) -> dict:
    """Run one benchmark in `tree` with that tree's venv; its stdout ends with one JSON object."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tree / ".venv" / "torch_extensions"))
    out = subprocess.run(
        [str(tree / ".venv" / "bin" / "python"), *script],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out[out.rindex("\n{\n") + 1 :] if not out.startswith("{") else out)


def figures(router: dict | None, serve: dict) -> dict[str, float]:
    """The numbers the issue compares: router hop and frontend overhead, HTTP vs offline."""
    http = {
        "offline_tok_s": serve["offline"]["output_throughput"],
        "http_tok_s": serve["http"]["output_throughput"],
        "http_over_offline": serve["http_over_offline_throughput"],
        "http_ttft_p50_ms": serve["http"]["median_ttft_ms"],
    }
    if router is None:
        return http
    return {
        **http,
        "router_hop_p50_ms": router["router_hop_p50_ms"],
        "frontend_minus_worker_p50_ms": router["frontend_total_p50_ms"],
        "worker_p50_ms": router["worker"]["p50_ms"],
        "frontend_p50_ms": router["frontend"]["p50_ms"],
        "serve_uvloop_p50_ms": router["serve_uvloop"]["p50_ms"],
    }


def one_round(
    trees: dict[str, Path], order: list[str], router_args: list[str] | None, serve_args: list[str]
) -> list[dict]:
    runs = []
    for side in order:
        load = [os.getloadavg()[0]]
        started = time.strftime("%H:%M:%S", time.gmtime())
        router = run_json(trees[side], ROUTER + router_args) if router_args is not None else None
        load.append(os.getloadavg()[0])
        serve = run_json(trees[side], SERVE + serve_args)
        load.append(os.getloadavg()[0])
        runs.append({"side": side, "utc": started, "load_1m": load, **figures(router, serve)})
        print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=300, help="router_overhead.py's")
    ap.add_argument("--skip-router", action="store_true", help="serve_overhead.py only")
    ap.add_argument(
        "--serve-threads",
        type=int,
        default=None,
        help="serve_overhead.py's --num-threads (default: the engine's own choice)",
    )
    args = ap.parse_args()
    router_args = None if args.skip_router else ["--iterations", str(args.iterations)]
    serve_args = [] if args.serve_threads is None else ["--num-threads", str(args.serve_threads)]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: list[dict] = []
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        runs += one_round(trees, order, router_args, serve_args)
    keys = [k for k in runs[0] if k not in ("side", "utc", "load_1m")]
    medians = {
        side: {k: statistics.median(r[k] for r in runs if r["side"] == side) for k in keys}
        for side in trees
    }
    print(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
