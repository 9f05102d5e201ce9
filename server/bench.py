"""`deepserve bench serve`: load an OpenAI-compatible server and report latency like `vllm bench serve`.

Sends `num_prompts` streaming requests (chat or completions) with at most `concurrency` in flight,
each asking for exactly `output_len` tokens (ignore_eos; with `ignore_eos` off, at most that
many: replies end where the model ends them, as a rewrite's answer does), and prints JSON: request and output
token throughput, and mean / p50 / p90 / p99 of TTFT, TPOT, ITL and end-to-end latency in ms.
Prompts are `input_len` words each, or, with `min_input_len`, of lengths drawn uniformly from
`min_input_len..input_len` (prefills of different lengths arriving together, as real traffic has),
or the prompts of `prompts_file` (one JSON string per line, used in turn), for traffic of a given
kind, such as rewrite prompts whose answers repeat them (where n-gram speculation pays).

The client is aiohttp, as `vllm bench serve`'s: on httpx the client itself was the bottleneck (its
connection pool walks every connection for each body chunk: 530 us of client CPU per streamed
token at 64 streams, so one client process could not read more than ~2,000-4,000 tokens/s).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

WORDS = [
    "river",
    "stone",
    "garden",
    "light",
    "winter",
    "market",
    "silver",
    "cloud",
    "harbor",
    "forest",
    "lamp",
    "quiet",
    "city",
    "bridge",
    "story",
    "engine",
    "paper",
    "window",
    "orange",
    "music",
    "valley",
    "ocean",
    "yellow",
    "tower",
    "number",
    "morning",
    "letter",
]


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # "chat" | "completions"
    model: str | None = None
    concurrency: int = 16
    num_prompts: int = 64
    input_len: int = 32
    min_input_len: int | None = None  # mixed lengths: words drawn from min..input_len
    output_len: int = 128
    seed: int = 0
    api_key: str | None = None
    json_schema_path: str | None = None
    result_file: str | None = None
    prompts_file: str | None = None  # one JSON string per line; None: generated word prompts
    ignore_eos: bool = True  # off: measure replies as long as the model makes them


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def make_prompts(n: int, words: int, seed: int, min_words: int | None = None) -> list[str]:
    """`n` prompts of `words` words, or of min_words..words words each when `min_words` is set."""
    rng = random.Random(seed)
    lengths = [words if min_words is None else rng.randint(min_words, words) for _ in range(n)]
    return [
        f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(k))
        for i, k in enumerate(lengths)
    ]


def bench_prompts(cfg: BenchConfig) -> list[str]:
    """The `num_prompts` prompts to send: the file's, in turn, or generated ones."""
    if cfg.prompts_file is None:
        return make_prompts(cfg.num_prompts, cfg.input_len, cfg.seed, cfg.min_input_len)
    lines = Path(cfg.prompts_file).read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{cfg.prompts_file}: expected one JSON string per line")
    return [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]


def request_body(cfg: BenchConfig, model: str, prompt: str, schema: dict | None) -> dict:
    body = {
        "model": model,
        "max_tokens": cfg.output_len,
        "temperature": 0.0,
        "ignore_eos": cfg.ignore_eos and schema is None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema},
            }
    else:
        body["prompt"] = prompt
    return body


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    last, res = None, RequestResult(ok=False)
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return RequestResult(ok=False, error=f"{r.status} {await r.text()!r}")
            async for line in sse_lines(r.content.iter_any()):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                if not _has_text(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        return RequestResult(ok=False, error=repr(e))
    res.e2e = time.perf_counter() - start
    res.ok = last is not None
    return res


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body's lines from its chunks as they arrive, whatever their length (aiohttp's own line
    iterator refuses lines over its buffer size, and one event may carry a long merged delta)."""
    pending = b""
    async for data in chunks:
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


def _has_text(chunk: dict) -> bool:
    """Whether the chunk carries output: completion text, or a chat delta's answer or reasoning
    (a thinking model streams its reasoning first; those tokens count as output too)."""
    for c in chunk.get("choices") or []:
        delta = c.get("delta") or {}
        if c.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _stats(name: str, values: list[float]) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * 1000

    return {
        f"mean_{name}_ms": sum(s) / len(s) * 1000,
        f"median_{name}_ms": pct(50),
        f"p90_{name}_ms": pct(90),
        f"p99_{name}_ms": pct(99),
    }


def summarize(results: list[RequestResult], duration: float, cfg: BenchConfig) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "endpoint": cfg.endpoint,
        "concurrency": cfg.concurrency,
        "num_prompts": cfg.num_prompts,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "min_input_tokens": min((r.prompt_tokens for r in ok), default=0),
        "max_input_tokens": max((r.prompt_tokens for r in ok), default=0),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", tpots)
    summary |= _stats("itl", [x for r in ok for x in r.itls])
    summary |= _stats("e2el", [r.e2e for r in ok])
    errors = [r.error for r in results if not r.ok and r.error]
    if errors:
        summary["first_error"] = errors[0][:300]
    return summary


async def bench(cfg: BenchConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    schema = json.loads(Path(cfg.json_schema_path).read_text()) if cfg.json_schema_path else None
    connector = aiohttp.TCPConnector(limit=cfg.concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=30)
    base = cfg.base_url.rstrip("/")
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout
    ) as session:
        model = cfg.model or await _first_model(session, base)
        url = base + ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions")
        prompts = bench_prompts(cfg)
        gate = asyncio.Semaphore(cfg.concurrency)

        async def run(prompt: str) -> RequestResult:
            async with gate:
                return await one_request(session, url, request_body(cfg, model, prompt, schema))

        start = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(results, duration, cfg) | {"model": model, "config": asdict(cfg)}


async def _first_model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


def run_client(cfg: BenchConfig) -> dict:
    """Run the load on uvloop where it is installed (a dependency off Windows): the client's CPU per
    streamed token falls from ~100 to ~80 us, and the client must not be what the bench measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(bench(cfg))
    return uvloop.run(bench(cfg))


def run_bench(cfg: BenchConfig) -> int:
    summary = run_client(cfg)
    text = json.dumps(summary, indent=2)
    print(text)
    if cfg.result_file:
        Path(cfg.result_file).write_text(text + "\n")
    return 0 if summary["failed"] == 0 else 1
