"""Frontend overhead: the same workload through the engine's offline async API and through HTTP.

One process, one engine: first N concurrent requests straight into `AsyncEngine.generate`, then the
same prompts as streaming /v1/completions requests through uvicorn + FastAPI + the SSE path, measured
by `deepserve bench serve` run as a separate process (so the client's own parsing does not share the
server's GIL). Prints one JSON object with both and their ratio.

    .venv/bin/python benchmarks/serve_overhead.py --concurrency 16 --num-prompts 32 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import engine_for, running_server  # noqa: E402

from deepserve.engine.sampling_params import SamplingParams  # noqa: E402
from deepserve.server.bench import make_prompts  # noqa: E402


async def offline(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(i: int, ids: list[int]) -> int:
        async with gate:
            start, n = time.perf_counter(), 0
            async for out in engine.generate(
                f"offline-{i}-{time.time_ns()}", engine.admit(ids, params)
            ):
                if n == 0 and out.outputs[0].token_ids:
                    ttfts.append(time.perf_counter() - start)
                n += len(out.outputs[0].token_ids)
            return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - start
    ttfts.sort()
    return {
        "duration_s": duration,
        "total_output_tokens": sum(counts),
        "output_throughput": sum(counts) / duration,
        "median_ttft_ms": ttfts[len(ttfts) // 2] * 1000,
    }


def bench_subprocess(base_url: str, args: argparse.Namespace) -> dict:
    cli = Path(sys.executable).with_name("deepserve")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                str(cli),
                "bench",
                "serve",
                "--base-url",
                base_url,
                "--endpoint",
                "completions",
                "--concurrency",
                str(args.concurrency),
                "--num-prompts",
                str(args.num_prompts),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--result-file",
                out.name,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-threads", type=int, default=None, help="default: all cores, as serve")
    args = ap.parse_args()
    with engine_for(args.model, num_threads=args.num_threads) as engine:
        texts = make_prompts(args.num_prompts, args.input_len, seed=0)
        ids = [engine.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        asyncio.run(offline(engine, ids[:2], 2, 8))  # warm-up
        off = asyncio.run(offline(engine, ids, args.concurrency, args.output_len))
        with running_server(engine, args.model) as srv:
            http = bench_subprocess(srv.base_url, args)
    http.pop("config", None)
    print(
        json.dumps(
            {
                "workload": vars(args),
                "offline": off,
                "http": http,
                "http_over_offline_throughput": http["output_throughput"]
                / off["output_throughput"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
