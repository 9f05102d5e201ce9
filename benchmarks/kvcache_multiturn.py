"""Benchmark (not a test): TTFT of the 8th turn of a SmolLM2 chat, cold vs served from each KV tier,
and bulk L2 load throughput beside raw redis-py GETs of the same bytes from the same server.

    .venv/bin/python benchmarks/kvcache_multiturn.py [--redis-url URL] [--turns 8]

Without --redis-url a private redis-server is started on a free loopback port (and stopped).
The conversation is built at the token level (ChatML turns, ~150 user tokens and 64 greedy answer
tokens each), so every turn's prompt extends the previous one exactly. Then the last turn's TTFT:

- cold:  an engine with prefix caching off;
- L0:    the engine that served turns 1..7 (their blocks still in its device pool);
- L1:    the same conversation after every cached device block was evicted into host RAM;
- L2:    a fresh engine (empty device pool, no host tier) that shares only Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace

import torch

from deepserve.engine.config import EngineConfig, KVTierConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.loading.loader import load_model
from deepserve.engine.sampling_params import SamplingParams

TOPICS = [
    "the history of lighthouses along rocky northern coasts and the keepers who lived in them",
    "how sourdough starters work, which microbes live in them and how bakers feed them",
    "the migration routes of arctic terns and how they navigate across whole oceans",
    "the design of medieval cathedrals, flying buttresses and the guilds that built them",
    "how tidal power stations turn the rise and fall of the sea into electricity",
    "the chemistry of autumn leaves and why some trees turn red while others turn yellow",
    "the rules of go, its long history in east asia and what makes it hard for computers",
    "how bees communicate the location of flowers through their waggle dance",
]


def user_text(i: int) -> str:
    base = f"Please tell me about {TOPICS[i % len(TOPICS)]}. "
    detail = (
        "I would like a careful answer that covers the main ideas, a few surprising facts, "
        "some numbers if you know them, the people involved, and what is still unknown. "
        "Keep the language simple, avoid lists, and connect it to everyday life where you can. "
    )
    return base + detail * 2


class Conversation:
    """Token ids of a ChatML conversation, extended turn by turn."""

    def __init__(self, tokenizer) -> None:
        self.encode = lambda s: tokenizer.encode(s).ids
        self.ids = self.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")

    def add_user(self, text: str) -> list[int]:
        self.ids = self.ids + self.encode(f"<|im_start|>user\n{text}<|im_end|>\n")
        self.ids += self.encode("<|im_start|>assistant\n")
        return self.ids

    def add_answer(self, tokens: list[int]) -> None:
        self.ids = self.ids + tokens + self.encode("<|im_end|>\n")


def ttft(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int = 1):
    """(seconds to the first token, generated tokens, final output) for one request."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, ids, params)
    first, tokens, last = None, [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            last = out
            if first is None and tokens:
                first = time.perf_counter() - start
    return first, tokens, last


class PrivateRedis:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="deepserve-bench-redis-")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--maxmemory", "2gb",
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def build_conversation(engine, loaded, turns: int, answer_tokens: int) -> tuple[list[int], list]:
    conv = Conversation(loaded.tokenizer)
    for i in range(turns - 1):
        ids = conv.add_user(user_text(i))
        _, answer, _ = ttft(engine, f"turn{i}", ids, max_tokens=answer_tokens)
        conv.add_answer(answer)
    return conv.add_user(user_text(turns - 1)), conv


def measure_ttfts(loaded, url: str, turns: int, answer_tokens: int) -> dict:
    """TTFT of the last turn with turns 1..N-1 cached in exactly one tier each time."""
    import redis

    raw = redis.Redis.from_url(url)
    config = EngineConfig(
        num_kv_blocks=512, kv_tiers=KVTierConfig(host_bytes=4 << 30, store_url=url)
    )
    warm = LLMEngine(config, loaded)
    last_prompt, _ = build_conversation(warm, loaded, turns, answer_tokens)
    assert warm.kv_tiering.tiers.drain(120)
    history = {k.decode() for k in raw.keys("dskv:*")}  # the blocks of turns 1..N-1

    def forget_last_turn(engine: LLMEngine) -> None:
        """Drop what measuring wrote through, so every tier starts from turns 1..N-1 only."""
        assert engine.kv_tiering.tiers.drain(120)
        new = [k for k in raw.keys("dskv:*") if k.decode() not in history]
        if new:
            raw.delete(*new)

    rows = {}
    cold_engine = LLMEngine(EngineConfig(num_kv_blocks=512, enable_prefix_caching=False), loaded)
    rows["cold"] = ttft(cold_engine, "cold", last_prompt)[::2]
    rows["L0 (device)"] = ttft(warm, "l0", last_prompt)[::2]
    forget_last_turn(warm)
    warm.close()
    l2_runs = []
    for rep in range(3):
        fresh = LLMEngine(replace(config, kv_tiers=KVTierConfig(store_url=url)), loaded)
        l2_runs.append(ttft(fresh, f"l2-{rep}", last_prompt)[::2])
        forget_last_turn(fresh)
        fresh.close()
    rows["L2 (Redis), median of 3"] = sorted(l2_runs, key=lambda r: r[0])[1]
    # L1: a fresh engine whose host RAM holds turns 1..N-1 (promoted from L2 by a fetch).
    host_engine = LLMEngine(config, loaded)
    keys = [k.removeprefix("dskv:") for k in history]
    assert len(host_engine.kv_tiering.tiers.fetch_prefix(keys).payloads) == len(keys)
    rows["L1 (host RAM)"] = ttft(host_engine, "l1", last_prompt)[::2]
    forget_last_turn(host_engine)
    return {"prompt_tokens": len(last_prompt), "rows": rows, "engine": host_engine}


def measure_bulk_load(engine: LLMEngine, url: str, reps: int = 9) -> dict:
    """fetch_prefix (pipelined MGETs + validation + copy into the device cache) vs raw GETs."""
    import redis
    from prometheus_client import CollectorRegistry

    from deepserve.kvcache.metrics import KVCacheMetrics
    from deepserve.kvcache.redis_store import RedisStore, RedisStoreConfig
    from deepserve.kvcache.tiered import TieredKVCache

    raw = redis.Redis.from_url(url)
    keys = [k.decode().removeprefix("dskv:") for k in raw.keys("dskv:*")]
    metrics = KVCacheMetrics(CollectorRegistry())
    tiers = TieredKVCache(engine.kv_tiering.tiers.spec, metrics,
                          store=RedisStore(RedisStoreConfig(url=url, timeout_s=5), metrics),
                          store_mac_key=engine.kv_tiering.tiers.store_mac_key)  # fmt: skip
    nbytes = sum(raw.strlen(f"dskv:{k}") for k in keys)
    raw_times, ours_times, ours_copy_times = [], [], []
    cache = engine.runner.kv_cache  # the engine has finished its requests: scratch space now
    for _ in range(reps):
        start = time.perf_counter()
        pipe = raw.pipeline(transaction=False)
        for k in keys:
            pipe.get(f"dskv:{k}")
        values = pipe.execute()
        raw_times.append(time.perf_counter() - start)
        assert all(v is not None for v in values)
        del values
        start = time.perf_counter()
        fetched = tiers.fetch_prefix(keys).payloads
        ours_times.append(time.perf_counter() - start)
        assert len(fetched) == len(keys)
        for i, payload in enumerate(fetched):
            engine.kv_tiering.write_block(i % cache.shape[1], payload)
        ours_copy_times.append(time.perf_counter() - start)
        del fetched
    gbps = {
        name: (nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9)
        for name, times in (
            ("raw", raw_times),
            ("ours", ours_times),
            ("ours_copy", ours_copy_times),
        )
    }
    return {"blocks": len(keys), "bytes": nbytes, "reps": reps, "gbps": gbps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=64)
    args = ap.parse_args()
    server = None if args.redis_url else PrivateRedis()
    url = args.redis_url or server.url
    try:
        t0 = time.perf_counter()
        loaded = load_model(EngineConfig())
        torch.set_num_threads(1)
        result = measure_ttfts(loaded, url, args.turns, args.answer_tokens)
        bulk = measure_bulk_load(result["engine"], url)
        report(result, bulk, time.perf_counter() - t0)
    finally:
        if server is not None:
            server.close()


def report(result: dict, bulk: dict, elapsed: float) -> None:
    rows = result["rows"]
    cold = rows["cold"][0]
    print(f"8th-turn prompt: {result['prompt_tokens']} tokens; SmolLM2-135M float32, 1 thread")
    print("| served from | TTFT (ms) | x cold | cached tokens (by tier) |")
    print("|---|---|---|---|")
    order = ["cold", "L0 (device)", "L1 (host RAM)", "L2 (Redis), median of 3"]
    for name, (t, out) in ((n, rows[n]) for n in order):
        tiers = ", ".join(f"{k} {v}" for k, v in out.cached_tokens_by_tier.items() if v)
        print(
            f"| {name} | {t * 1000:.0f} | {t / cold:.2f} | {out.cached_tokens} ({tiers or '-'}) |"
        )
    print()
    n = bulk["reps"]
    print(
        f"bulk L2 load: {bulk['blocks']} blocks, {bulk['bytes'] / 1e6:.1f} MB, {n} interleaved runs"
    )
    print("| read path | GB/s median | GB/s best | x raw (median) |")
    print("|---|---|---|---|")
    raw = bulk["gbps"]["raw"][0]
    names = {
        "raw": "raw redis-py pipelined GETs",
        "ours": "fetch_prefix (pipelined MGETs + header/checksum checks)",
        "ours_copy": "fetch_prefix + copy into the KV cache",
    }
    for key, label in names.items():
        median, best = bulk["gbps"][key]
        print(f"| {label} | {median:.2f} | {best:.2f} | {median / raw:.2f} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n(total benchmark time {elapsed:.0f} s; load average at the end {load} on {os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
