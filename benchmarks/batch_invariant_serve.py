"""What `--batch-invariant` costs a user of the HTTP server: `deepserve serve` with and without the
flag, side by side in one run, under `deepserve bench serve`'s load with prompts of mixed lengths.

Both servers (SmolLM2, the CLI's defaults otherwise) start once and stay up; the load alternates
between them (off, on, off, on, ...) at each concurrency, so both see the same minutes of a shared
host. Each load sends streaming /v1/completions whose prompts are drawn from `--min-words` to
`--max-words` words (about a token each, so prefills of different lengths arrive together, are
chunked, and attend over real context lengths), `--output-len` tokens each (ignore_eos). Prints
one JSON object: every run, and per concurrency the flag's output tokens/s and TTFT p50 over the
flag off's (medians over `--rounds`).

    .venv/bin/python benchmarks/batch_invariant_serve.py --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from serve_vs_vllm import server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import free_port  # noqa: E402

from deepserve.server.bench import BenchConfig, run_client  # noqa: E402


def load(url: str, args: argparse.Namespace, concurrency: int, prompts: int, seed: int) -> dict:
    cfg = BenchConfig(
        base_url=url, endpoint="completions", concurrency=concurrency, num_prompts=prompts,
        input_len=args.max_words, min_input_len=args.min_words, output_len=args.output_len,
        seed=seed,
    )  # fmt: skip
    result = run_client(cfg)
    keep = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "failed", "duration_s")
    keep += ("min_input_tokens", "max_input_tokens")
    return {k: result.get(k) for k in keep}


def ratios(runs: list[dict]) -> dict:
    out = {}
    for c in sorted({r["concurrency"] for r in runs}):

        def med(flag: bool, key: str, c: int = c) -> float:
            vals = [r[key] for r in runs if r["concurrency"] == c and r["batch_invariant"] is flag]
            vals = [v for v in vals if v is not None]  # a run whose requests all failed
            return statistics.median(vals) if vals else float("nan")

        out[f"concurrency {c}"] = {
            "output_tok_s on/off": med(True, "output_throughput") / med(False, "output_throughput"),
            "ttft_p50 on/off": med(True, "median_ttft_ms") / med(False, "median_ttft_ms"),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts-per-stream", type=int, default=1, help="prompts = streams x this")
    ap.add_argument("--min-prompts", type=int, default=4, help="at least this many prompts a run")
    ap.add_argument("--min-words", type=int, default=30)
    ap.add_argument("--max-words", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="for both servers")
    args = ap.parse_args()
    cli = Path(sys.executable).with_name("deepserve")
    urls = {}
    with contextlib.ExitStack() as stack:
        for flag in (False, True):
            port = free_port()
            cmd = [str(cli), "serve", "--host", "127.0.0.1", "--port", str(port)]
            cmd += [*(["--batch-invariant"] if flag else []), *args.serve_args]
            log = Path(tempfile.gettempdir()) / f"batch_invariant_serve-{flag}.log"
            urls[flag] = stack.enter_context(server(cmd, dict(os.environ), port, log))
        for flag in (False, True):  # warm-up: first calls, the native build's first use
            load(urls[flag], args, 2, 2, seed=99)
        runs = []
        for rnd in range(args.rounds):
            for c in args.concurrency:
                prompts = max(args.min_prompts, c * args.prompts_per_stream)
                for flag in (False, True):
                    r = load(urls[flag], args, c, prompts, seed=rnd)
                    r |= {"batch_invariant": flag, "concurrency": c, "round": rnd}
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    runs.append(r)
    summary = {
        "workload": vars(args),
        "load_average": os.getloadavg(),
        "runs": runs,
        "ratios": ratios(runs),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
