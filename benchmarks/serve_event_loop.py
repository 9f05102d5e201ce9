"""What a request costs the server's event loop, and how a wave of requests reaches the engine.

Starts `deepserve serve` (with benchmarks/gpu/step_log.py's step log installed), then sends waves of
concurrent streamed chat requests from this process (`deepserve bench serve`'s request code, over
keep-alive connections; the server is a process of its own) and reads:
- the CPU time of the server's event-loop thread (its main thread, /proc) per request, and of the
  whole process, over the waves;
- per wave, the engine's steps: how many of the wave's requests the first step carried, and how
  many steps carried prompt tokens (a wave that trickles in costs several small steps instead of
  full ones, benchmarks/RESULTS.md "Run 8").

    .venv/bin/python benchmarks/serve_event_loop.py --model tiny-deepseek --waves 8

Linux only (/proc). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from deepserve.server.bench import BenchConfig, make_prompts, one_request, request_body

HERE = Path(__file__).resolve().parent


def cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(model: str, port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, str(HERE / "gpu" / "step_log.py"), str(log), "serve"]
    args += ["--model", model, "--port", str(port)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


async def waves(port: int, args: argparse.Namespace, log: Path, pid: int) -> dict:
    """A warm-up wave, then `args.waves` waves over the same keep-alive connections (as a
    client's steady traffic, not a fresh process's connection set-up)."""
    cfg = BenchConfig(endpoint="chat", input_len=args.input_len, output_len=args.output_len)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=args.wave_size)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one_wave(seed: int) -> list:
            prompts = make_prompts(args.wave_size, args.input_len, seed)
            bodies = [request_body(cfg, args.model, p, None) for p in prompts]
            return await asyncio.gather(*(one_request(session, url, b) for b in bodies))

        await one_wave(1000)
        loop0, all0 = cpu_s(pid, pid), cpu_s(pid)
        out = []
        for i in range(args.waves):
            t0 = time.time()
            results = await one_wave(i)
            rows, steps = wave_steps(log, t0)
            ttfts = sorted(r.ttft for r in results if r.ok)
            out.append(
                {"first_step_rows": rows, "prompt_steps": steps,
                 "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1) if ttfts else None,
                 "completed": len(ttfts)}
            )  # fmt: skip
        requests = args.waves * args.wave_size
        return {
            "event_loop_cpu_us_per_request": round((cpu_s(pid, pid) - loop0) / requests * 1e6),
            "process_cpu_us_per_request": round((cpu_s(pid) - all0) / requests * 1e6),
            "waves": out,
        }


def wave_steps(log: Path, t0: float) -> tuple[int, int]:
    """(rows of the first step after t0, steps after t0 that carried prompt tokens)."""
    steps = []
    for line in log.read_text().splitlines():
        t, rows, tokens, _, _ = line.split()
        if float(t) >= t0:
            steps.append((int(rows), int(tokens)))
    # A row brings one token in a decode step and its prompt (or a chunk of it) in a prefill.
    return (steps[0][0] if steps else 0), sum(tokens > rows for rows, tokens in steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-deepseek")
    ap.add_argument("--port", type=int, default=18231)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--wave-size", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=100, help="approximate prompt words")
    ap.add_argument("--output-len", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.log"
        proc = start_server(args.model, args.port, log)
        try:
            res = asyncio.run(waves(args.port, args, log, proc.pid))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    ws = res["waves"]
    summary = {
        "first_step_rows_median": statistics.median(w["first_step_rows"] for w in ws),
        "prompt_steps_median": statistics.median(w["prompt_steps"] for w in ws),
        "ttft_p50_ms_median": statistics.median(w["ttft_p50_ms"] or 0 for w in ws),
    }
    print(json.dumps({"workload": vars(args), **res, **summary}, indent=2))


if __name__ == "__main__":
    main()
