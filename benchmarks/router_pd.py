"""Benchmark: 1 prefill + 1 decode worker (KV handed over through Redis) vs 2 mixed workers, on
the same load: TTFT, TPOT (p50/p99) and output tokens/s, one setup after the other in one run.

Unique prompts (no prefix sharing), greedy, so the PD path streams the prefill worker's first
token and the decode worker continues from the shared tier.

    .venv/bin/python benchmarks/router_pd.py [--requests 32] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

from router_load import router_cluster as rc
from router_load import run_load, summary
from router_multitenant import WORDS, start_redis


def conversations(args) -> list[list[dict]]:
    rng = random.Random(args.seed)
    out = []
    for n in range(args.requests):
        text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        out.append([{"role": "user", "content": f"Ticket {n}: {text}. Summarise it."}])
    return out


def run_setup(name: str, args, convs) -> dict:
    redis, url = start_redis()
    if name == "1P+1D":
        workers = [rc.worker("prefill", args.model, url), rc.worker("decode", args.model, url)]
        front = rc.frontend(args.model, prefill=workers[:1], decode=workers[1:], redis_url=url)
    else:
        workers = [rc.worker("mixed", args.model, None) for _ in range(2)]
        front = rc.frontend(args.model, workers=workers, extra=("--policy", "least_load"))
    try:
        rc.start_all(*workers)
        rc.start_all(front)
        samples, wall = asyncio.run(
            run_load(front.url, args.model, convs, args.max_tokens, args.concurrency)
        )
        return summary(samples, wall)
    finally:
        rc.stop_all(front, *workers)
        redis.terminate()
        redis.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    convs = conversations(args)
    results = {name: run_setup(name, args, convs) for name in ("1P+1D", "2 mixed")}
    print(json.dumps(results, indent=2))
    for name, r in results.items():
        print(
            f"{name}: TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
            f"TPOT p50 {r['tpot_p50_ms']:.0f} ms p99 {r['tpot_p99_ms']:.0f} ms, "
            f"{r['output_tok_s']:.1f} tok/s, errors {r['errors']}"
        )


if __name__ == "__main__":
    main()
