"""What `--speculative ngram` buys a user of `--batch-invariant` through HTTP (issue 34): two
`deepserve serve --batch-invariant` servers, one with n-gram speculation, side by side in one run.

Both servers (SmolLM2 by default) start once and stay up; `deepserve bench serve`'s load
alternates between them (plain, speculative, plain, ...) so both see the same minutes of a shared
host. The load is rewrite prompts (benchmarks/prompts/rewrite.jsonl: "rewrite this paragraph
fixing the typos", answers that repeat their prompt, where n-gram drafts are accepted) over
streaming chat, greedy, replies ending at EOS as a user's do (`ignore_eos` off). Prints one JSON
object: every run, per concurrency the speculative server's output tokens/s and TPOT p50 over the
plain one's (medians over `--rounds`), and the acceptance the speculative server's /metrics counted.

    .venv/bin/python benchmarks/spec_decode_serve.py --rounds 3
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

import httpx
from serve_vs_vllm import server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import free_port  # noqa: E402

from deepserve.server.bench import BenchConfig, run_client  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "prompts" / "rewrite.jsonl"
SERVERS = {"plain": [], "ngram": ["--speculative", "ngram"]}


def load(url: str, args: argparse.Namespace, concurrency: int) -> dict:
    cfg = BenchConfig(
        base_url=url, endpoint="chat", concurrency=concurrency, num_prompts=args.num_prompts,
        output_len=args.output_len, prompts_file=str(args.prompts_file), ignore_eos=False,
    )  # fmt: skip
    result = run_client(cfg)
    keep = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "failed")
    return {k: result.get(k) for k in keep} | {"output_tokens": result.get("total_output_tokens")}


def acceptance(url: str) -> dict:
    """Draft and accepted token counts from the server's Prometheus metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    counts = {}
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        prefix = f"deepserve:spec_decode_{name}_total{{"
        counts[name] = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)
        )
    drafted = counts["num_draft_tokens"]
    return counts | {"acceptance": counts["num_accepted_tokens"] / drafted if drafted else None}


def ratios(runs: list[dict]) -> dict:
    out = {}
    for c in sorted({r["concurrency"] for r in runs}):

        def med(name: str, key: str, c: int = c) -> float:
            vals = [r[key] for r in runs if r["concurrency"] == c and r["server"] == name]
            return statistics.median(v for v in vals if v is not None)

        out[f"concurrency {c}"] = {
            "output_tok_s ngram/plain": med("ngram", "output_throughput")
            / med("plain", "output_throughput"),
            "tpot_p50 ngram/plain": med("ngram", "median_tpot_ms") / med("plain", "median_tpot_ms"),
            # each round's two runs share their minutes of the host: the fairer pairing
            "output_tok_s ngram/plain, median of rounds": statistics.median(
                _round_ratios([r for r in runs if r["concurrency"] == c])
            ),
        }
    return out


def _round_ratios(runs: list[dict]) -> list[float]:
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["server"]] = r["output_throughput"]
    return [v["ngram"] / v["plain"] for v in by_round.values() if len(v) == 2]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256, help="at most; replies end at EOS")
    ap.add_argument("--prompts-file", type=Path, default=PROMPTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="for both servers")
    args = ap.parse_args()
    cli = Path(sys.executable).with_name("deepserve")
    urls = {}
    with contextlib.ExitStack() as stack:
        for name, extra in SERVERS.items():
            port = free_port()
            cmd = [str(cli), "serve", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--batch-invariant", *extra, *args.serve_args]
            log = Path(tempfile.gettempdir()) / f"spec_decode_serve-{name}.log"
            urls[name] = stack.enter_context(server(cmd, dict(os.environ), port, log))
        runs = []
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for name, url in urls.items():
                    r = load(url, args, c) | {"server": name, "concurrency": c, "round": rnd}
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    runs.append(r)
        accepted = acceptance(urls["ngram"])
    summary = {
        "workload": {k: str(v) for k, v in vars(args).items()},
        "load_average": os.getloadavg(),
        "runs": runs,
        "ratios": ratios(runs),
        "ngram_metrics": accepted,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
