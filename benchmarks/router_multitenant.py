"""Benchmark: multi-tenant prefix sharing over 2 mixed workers, cache_aware vs round_robin.

8 tenants, each with its own ~400-token system prompt, send many short requests in random order.
Each worker's device KV pool holds about half of the tenants' prompts, as a busy fleet's would
(the capacity-constrained regime is where routing decides the hit rate; with room for every
prompt on every worker any policy ends up hitting): 100 blocks of 16 tokens are 4 tenants' 23
full prompt blocks plus the two private blocks of each of the 4 concurrent requests. Round robin
makes every worker see every tenant (and evict), cache_aware keeps each tenant on the worker
holding its prefix. Workers have no shared KV tier here; the router learns from their block
events on Redis. Reports prefix hit rate (cached / prompt tokens, as clients see it in usage) and
TTFT for both policies, each on freshly started workers, in one run.

    .venv/bin/python benchmarks/router_multitenant.py [--requests 192] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess

from router_load import router_cluster as rc
from router_load import run_load, summary

WORDS = [
    "account",
    "order",
    "refund",
    "invoice",
    "shipping",
    "policy",
    "customer",
    "support",
    "escalate",
    "verify",
    "identity",
    "warranty",
    "product",
    "return",
    "label",
    "carrier",
    "tracking",
    "delay",
    "apology",
    "credit",
    "voucher",
    "priority",
]


def tenant_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the support assistant of tenant {i}. Follow these notes: {body}"


def conversations(args) -> list[list[dict]]:
    rng = random.Random(args.seed)
    systems = [tenant_prompt(i, args.system_words) for i in range(args.tenants)]
    out = []
    for n in range(args.requests):
        system = systems[rng.randrange(args.tenants)]
        out.append([
            {"role": "system", "content": system},
            {"role": "user", "content": f"Request {n}: where is my order?"},
        ])  # fmt: skip
    return out


def start_redis() -> tuple[subprocess.Popen, str]:
    port = rc.free_port()
    argv = [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


def run_policy(policy: str, args, convs) -> dict:
    redis, url = start_redis()
    pool = ("--num-kv-blocks", str(args.kv_blocks), "--kv-events", url)
    workers = [rc.worker("mixed", args.model, None, *pool) for _ in range(2)]
    front = rc.frontend(args.model, workers=workers, redis_url=url, extra=("--policy", policy))
    try:
        rc.start_all(*workers)
        rc.start_all(front)
        samples, wall = asyncio.run(
            run_load(front.url, args.model, convs, args.max_tokens, args.concurrency)
        )
        result = summary(samples, wall)
        result["prompt_tokens_mean"] = sum(s.prompt_tokens for s in samples) / len(samples)
        result["per_worker_prompt_tokens"] = [rc.load(w)["prompt_tokens"] for w in workers]
        return result
    finally:
        rc.stop_all(front, *workers)
        redis.terminate()
        redis.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-words", type=int, default=330, help="about 400 tokens")
    p.add_argument("--requests", type=int, default=192, help="the 8 cold misses weigh less")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=100, help="device KV pool per worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    convs = conversations(args)
    results = {policy: run_policy(policy, args, convs) for policy in ("round_robin", "cache_aware")}
    print(json.dumps(results, indent=2))
    rr, ca = results["round_robin"], results["cache_aware"]
    print(
        f"hit rate: round_robin {rr['hit_rate']:.1%}, cache_aware {ca['hit_rate']:.1%} "
        f"({ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x)"
    )
    print(
        f"TTFT p50: round_robin {rr['ttft_p50_ms']:.0f} ms, cache_aware {ca['ttft_p50_ms']:.0f} ms"
    )


if __name__ == "__main__":
    main()
