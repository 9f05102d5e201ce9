"""HTTP serving against the offline engine in one call (issue 15): `deepserve serve` on a
real-shape checkpoint, loaded by `deepserve bench serve` at `concurrency` streams, beside the
offline `LLM.generate` of the very same prompts on the same engine settings. Each side reports
its steps in the timed window (step_log.py: rows and tokens per step, graph or eager), and the
HTTP side the bench client's own CPU time against wall time (is the client the limit?).

Both sides run the same work (and, between them, the in-process AsyncEngine without HTTP): `num_prompts` completions prompts (bench.make_prompts, tokenized
by the checkpoint's own tokenizer for the offline side), `output_len` greedy tokens each with
ignore_eos, at most `concurrency` sequences running. Each side is warmed up first (graph capture
for every batch bucket), then timed once; the figure is output tokens per second of wall time,
prefills included on both sides. Prefix caching is off on both: the shaped tokenizer maps
the bench's words to one id, so every prompt would otherwise be a cache hit. The offline engine is freed before the server starts, so the
two never share the GPU. Imported by run_all.py (section `serve`); runs alone too:

    python3 benchmarks/gpu/serve_bench.py --out /tmp/serve [--quick-cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import step_log
import torch

# Every step of the timed runs (step_log.py): offline, the AsyncEngine and the servers append to it.
STEP_LOG = Path("/tmp/deepserve-steps.log")

QUICK_OVERRIDES = {
    "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024,
}  # fmt: skip


@dataclass(frozen=True)
class ServeRun:
    """What both sides serve, and the engine settings they share."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    concurrency: int = 64
    num_prompts: int = 256
    input_len: int = 128
    output_len: int = 128
    kv_cache_bytes: int = 8 * 2**30
    max_num_batched_tokens: int = 4096
    # The servers started in turn, each by its extra flags: as users start it, and the A/B of
    # the scheduler's arrival hold (that of async scheduling is in RESULTS.md, run 8-3).
    servers: tuple[tuple[str, ...], ...] = ((), ("--prefill-gather-ms", "0"))


QUICK = ServeRun("cpu", "float32", concurrency=4, num_prompts=8, input_len=16, output_len=8,
                 kv_cache_bytes=2**28)  # fmt: skip


def write_checkpoint(folder: Path, run: ServeRun, quick: bool) -> tuple[Path, float]:
    from deepserve.engine.testmodels.model_shapes import write_shaped_model

    t0 = time.time()
    if not (folder / "config.json").exists():
        overrides = QUICK_OVERRIDES if quick else None
        write_shaped_model("deepseek-v2-lite-v3arch", folder, run.device, 0, overrides)
        _free(run)
    return folder, time.time() - t0


def _greedy(max_tokens: int):
    from deepserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def offline_tok_s(folder: Path, run: ServeRun) -> dict:
    """The offline engine over the bench's prompts: warm-up (every bucket), then one timed run."""
    from deepserve.engine.llm import LLM
    from deepserve.server.bench import make_prompts

    t0 = time.time()
    llm = LLM(_engine_config(folder, run))
    load_s = time.time() - t0
    try:
        warm = [llm.encode(p) for p in make_prompts(run.concurrency, run.input_len, 1)]
        llm.generate(warm, _greedy(16))
        prompts = [llm.encode(p) for p in make_prompts(run.num_prompts, run.input_len, 0)]
        log = step_log.install(STEP_LOG)
        _sync(run)
        w0, t0 = time.time(), time.perf_counter()
        results = llm.generate(prompts, _greedy(run.output_len))
        _sync(run)
        wall = time.perf_counter() - t0
        log()
        steps = step_log.summary(STEP_LOG, w0, w0 + wall)
    finally:
        llm.close()
        del llm
        _free(run)
    tokens = sum(len(r.token_ids) for r in results)
    return dict(side="offline", load_s=load_s, wall_s=wall, output_tokens=tokens,
                prompt_tokens=sum(map(len, prompts)), output_tok_s=tokens / wall,
                steps=steps)  # fmt: skip


def async_engine_tok_s(folder: Path, run: ServeRun) -> dict:
    """The same prompts through the in-process AsyncEngine (the server's engine client), with
    `concurrency` asyncio consumers that only count tokens: the engine thread and the asyncio
    hand-off without HTTP, to place what the server loses between them."""
    from deepserve.engine.async_engine import AsyncEngine
    from deepserve.server.bench import make_prompts

    config = _engine_config(folder, run)

    async def main() -> tuple[float, int]:
        engine = await asyncio.to_thread(AsyncEngine, config)
        gate = asyncio.Semaphore(run.concurrency)

        async def one(rid: str, ids: list[int], n: int) -> int:
            async with gate:
                got = 0
                async for out in engine.generate(rid, engine.admit(ids, _greedy(n))):
                    got += sum(len(c.token_ids) for c in out.outputs)
                return got

        try:
            enc = engine.tokenizer.encode
            warm = [enc(p).ids for p in make_prompts(run.concurrency, run.input_len, 1)]
            await asyncio.gather(*(one(f"w{i}", p, 16) for i, p in enumerate(warm)))
            prompts = [enc(p).ids for p in make_prompts(run.num_prompts, run.input_len, 0)]
            stop_log = step_log.install(STEP_LOG)
            t0 = time.perf_counter()
            counts = await asyncio.gather(
                *(one(f"r{i}", p, run.output_len) for i, p in enumerate(prompts))
            )
            wall = time.perf_counter() - t0
            stop_log()
            return wall, sum(counts)
        finally:
            await engine.shutdown()

    w0 = time.time()
    wall, tokens = asyncio.run(main())
    steps = step_log.summary(STEP_LOG, w0, time.time())
    _free(run)
    return dict(side="async_engine", wall_s=wall, output_tokens=tokens, output_tok_s=tokens / wall,
                steps=steps)  # fmt: skip


def _engine_config(folder: Path, run: ServeRun):
    from deepserve.engine.config import EngineConfig

    return EngineConfig(
        model=str(folder), device=run.device, dtype=run.dtype, max_num_seqs=run.concurrency,
        kv_cache_bytes=run.kv_cache_bytes, max_num_batched_tokens=run.max_num_batched_tokens,
        enable_prefix_caching=False,
    )  # fmt: skip


def _sync(run: ServeRun) -> None:
    if run.device == "cuda":
        torch.cuda.synchronize()


def _free(run: ServeRun) -> None:
    import gc

    gc.collect()
    if run.device == "cuda":
        torch.cuda.empty_cache()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    folder: Path, run: ServeRun, port: int, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cmd = [
        sys.executable, str(Path(step_log.__file__)), str(STEP_LOG), "serve", "--model", str(folder),
        "--device", run.device, "--dtype", run.dtype, "--port", str(port),
        "--max-num-seqs", str(run.concurrency), "--kv-cache-bytes", str(run.kv_cache_bytes),
        "--max-num-batched-tokens", str(run.max_num_batched_tokens), "--no-prefix-caching",
        *extra,
    ]  # fmt: skip
    out = log.open("w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> float:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the session we started for it, nothing else
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_tok_s(folder: Path, run: ServeRun, log: Path, extra: tuple[str, ...] = ()) -> dict:
    """`deepserve bench serve` against a fresh `deepserve serve` (given `extra` flags): warm-up,
    then one timed run."""
    from deepserve.server.bench import BenchConfig, run_client

    port = _free_port()
    proc = start_server(folder, run, port, log, extra)
    try:
        ready_s = wait_healthy(proc, port, 600)
        base = dict(base_url=f"http://127.0.0.1:{port}", endpoint="completions",
                    concurrency=run.concurrency, input_len=run.input_len)  # fmt: skip
        warm = BenchConfig(**base, num_prompts=run.concurrency, output_len=16, seed=1)
        run_client(warm)
        spy = start_profile(proc.pid, log.with_name("pyspy.txt"))
        w0, cpu0 = time.time(), time.process_time()  # the bench client's own CPU time
        summary = run_client(BenchConfig(**base, num_prompts=run.num_prompts,
                                         output_len=run.output_len, seed=0))  # fmt: skip
        w1, cpu1 = time.time(), time.process_time()
        profile = stop_profile(spy, log.with_name("pyspy.txt"))
    finally:
        stop_server(proc)
    steps = step_log.summary(STEP_LOG, w0, w1)
    client = dict(cpu_s=round(cpu1 - cpu0, 3), cpu_over_wall=round((cpu1 - cpu0) / (w1 - w0), 3))
    keep = ("completed", "failed", "duration_s", "total_output_tokens", "total_input_tokens",
            "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "first_error")  # fmt: skip
    row = {k: summary[k] for k in keep if k in summary}
    side = " ".join(("http", *extra))
    return dict(side=side, healthy_after_s=ready_s, **row, output_tok_s=summary["output_throughput"],
                steps=steps, client=client, profile=profile)  # fmt: skip


def start_profile(pid: int, path: Path) -> subprocess.Popen | None:
    """py-spy sampling the server's threads while the timed run goes (when py-spy is there)."""
    exe = shutil.which("py-spy") or next(iter(Path("/tmp/deepserve-site/bin").glob("py-spy")), None)
    if exe is None:
        return None
    cmd = [str(exe), "record", "--pid", str(pid), "--format", "raw", "--output", str(path),
           "--rate", "250", "--threads", "--idle", "--nonblocking"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_profile(spy: subprocess.Popen | None, path: Path) -> dict:
    """Per thread: samples, and the functions most often on its stack (inclusive share)."""
    if spy is None:
        return {"error": "no py-spy"}
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    try:
        _, err = spy.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        return {"error": "py-spy did not stop"}
    if not path.exists():
        return {"error": (err or b"")[-500:].decode(errors="replace")}
    threads: dict[str, collections.Counter] = {}
    totals: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0]
        totals[thread] += int(count)
        seen = {f.rsplit(":", 1)[0] for f in frames[1:]}
        threads.setdefault(thread, collections.Counter()).update(dict.fromkeys(seen, int(count)))
    return {
        t: {"samples": totals[t],
            "top": [(f, round(c / totals[t], 3)) for f, c in threads[t].most_common(25)]}
        for t in sorted(totals, key=totals.get, reverse=True)[:4]
    }  # fmt: skip


def section_serve(out: dict, work: Path, run: ServeRun, quick: bool = False) -> None:
    """Offline engine, then the HTTP server, on one V2-Lite-shaped checkpoint."""
    rows = out.setdefault("serve", [])
    STEP_LOG.unlink(missing_ok=True)  # each run reads its own steps, not an earlier run's
    folder, write_s = write_checkpoint(work / "v2-lite-ckpt", run, quick)
    rows.append(dict(side="checkpoint", folder=str(folder), write_s=write_s))
    rows.append(offline_tok_s(folder, run))
    print(rows[-1], flush=True)
    offline = rows[-1]["output_tok_s"]
    rows.append(async_engine_tok_s(folder, run))
    print(rows[-1], flush=True)
    for extra in run.servers:
        log = work / "serve.log"
        try:
            rows.append(served_tok_s(folder, run, log, extra))
        finally:
            out["serve_log_tail"] = log.read_text()[-3000:] if log.exists() else ""
        print(rows[-1], flush=True)
        side = f"{rows[-1]['side']} / offline"
        rows.append(dict(side=side, ratio=rows[-1]["output_tok_s"] / offline))
        print(rows[-1], flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick-cpu", action="store_true", help="a tiny smoke run on the CPU")
    args = parser.parse_args()
    run = QUICK if args.quick_cpu else ServeRun()
    out: dict = {}
    args.out.mkdir(parents=True, exist_ok=True)
    section_serve(out, args.out, run, args.quick_cpu)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
