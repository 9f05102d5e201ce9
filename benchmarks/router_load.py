"""Helper for the router benchmarks (not a benchmark): an async OpenAI-chat streaming load generator
that records, per request, TTFT, inter-token times, tokens and prompt cache hits, plus summaries.

Processes are started with tests/router_cluster.py, the same helper the router tests use.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import router_cluster  # noqa: E402,F401  (re-exported for the benchmarks)


@dataclass
class Sample:
    start: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def one_chat(
    http: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int
) -> Sample:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,  # one logprob entry per token: exact token counts and times
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s = Sample(time.perf_counter())
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            s.error = f"status {resp.status_code}"
            return s
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                _absorb(s, json.loads(line[6:]))
    return s


def _absorb(s: Sample, chunk: dict) -> None:
    now = time.perf_counter()
    if "error" in chunk:
        s.error = chunk["error"].get("message", "error")
    for choice in chunk.get("choices") or []:
        n = len((choice.get("logprobs") or {}).get("content") or [])
        if n:
            s.first = s.first or now
            s.last = now
            s.tokens += n
    usage = chunk.get("usage")
    if usage:
        s.prompt_tokens = usage["prompt_tokens"]
        s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def run_load(
    url: str, model: str, conversations: list[list[dict]], max_tokens: int, concurrency: int
) -> tuple[list[Sample], float]:
    """Send every conversation once, `concurrency` at a time; (samples, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def bounded(messages: list[dict]) -> Sample:
            async with sem:
                return await one_chat(http, url, model, messages, max_tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(m) for m in conversations))
        return list(samples), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summary(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.error is None and s.first is not None]
    ttft = [s.ttft * 1000 for s in ok]
    tpot = [t * 1000 for s in ok if (t := s.tpot) is not None]
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "hit_rate": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else float("nan"),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
        "output_tok_s": sum(s.tokens for s in ok) / wall,
        "wall_s": wall,
    }
