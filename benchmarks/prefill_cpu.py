"""Prefill time of one long prompt through the offline engine on the CPU (issue 32): a fresh
prompt of `--tokens` random token ids, one output token, the prefix cache cleared, timed from
`add_request` to the first token; the median and span of `--reps` runs, and where the time goes
(torch.profiler over one more run, by op). `--decode-batch B` times decode steps instead: B
fresh 32-token prompts, 33 tokens each, the mean step after their prefill (a check that what
speeds up prefill does not slow decode down).

    .venv/bin/python benchmarks/prefill_cpu.py --tokens 1024 --threads 1 --cpu-time
    .venv/bin/python benchmarks/prefill_cpu.py --tokens 1024 --dtype bfloat16 --lib old.so

`--cpu-time` uses the process's CPU clock (with 1 thread, the time a neighbour takes from the
core is not counted: use it on a loaded host). `--lib` loads that build of the native library
(one built from an older commit) in place of this checkout's, for a before/after: run the two
in turn, several times, on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams


def use_library(path: str) -> None:
    """Load `path` as the native kernels; the engine's own load() then finds them loaded."""
    from deepserve.kernels.cpu import native

    torch.ops.load_library(path)
    native.load = lambda: True


def prefill_s(engine: LLMEngine, tokens: int, seed: int, clock) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (tokens,), generator=g).tolist()
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = clock()
    engine.add_request(f"prefill-{seed}", ids, params)
    while engine.has_unfinished():
        engine.step()
    return clock() - start


def decode_step_s(engine: LLMEngine, batch: int, seed: int, clock) -> float:
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(100, 40000, (32,), generator=g).tolist()
        engine.add_request(f"decode-{seed}-{i}", ids, params)
    engine.step()  # the prompts' prefill
    start, steps = clock(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (clock() - start) / steps


def profile(engine: LLMEngine, tokens: int) -> str:
    from torch.profiler import profile as torch_profile

    with torch_profile() as p:
        prefill_s(engine, tokens, 10_000, time.perf_counter)
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--decode-batch", type=int, help="time decode steps of this many sequences")
    p.add_argument("--lib", help="a native library .so to load instead of this checkout's")
    args = p.parse_args()
    if args.lib:
        use_library(args.lib)
    config = EngineConfig(
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = LLMEngine(config)
    clock = time.process_time if args.cpu_time else time.perf_counter
    prefill_s(engine, 64, -1, clock)  # warm-up
    if args.decode_batch:
        times = sorted(decode_step_s(engine, args.decode_batch, i, clock) for i in range(args.reps))
        what = f"decode step of {args.decode_batch}"
    else:
        times = sorted(prefill_s(engine, args.tokens, i, clock) for i in range(args.reps))
        what = f"prefill {args.tokens} tokens"
    print(
        f"{what}, {args.dtype}, {args.threads} thread(s), "
        f"{'CPU' if args.cpu_time else 'wall'} clock, lib {args.lib or 'this checkout'}, "
        f"load {os.getloadavg()[0]:.2f}: median {statistics.median(times) * 1e3:.1f} ms "
        f"({times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f})",
        flush=True,
    )
    if args.profile and not args.decode_batch:
        print(profile(engine, args.tokens))
    engine.close()


if __name__ == "__main__":
    main()
