"""The CPU cost of `--batch-invariant`: SmolLM2 float32, flag off and on side by side in one run.

Decode tokens/s at batch 1 and 16 (prompts of ~40 tokens, `--tokens` output tokens each, all
submitted at once) and prefill tokens/s of one `--prefill`-token prompt (fresh each repeat, so the
prefix cache never serves it). Prints a markdown table.

    .venv/bin/python benchmarks/batch_invariant_cpu.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.loading.loader import load_model
from deepserve.engine.sampling_params import SamplingParams


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def _timed(llm: LLM, prompts, max_tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0


def measure(flag: bool, args) -> dict[str, float]:
    config = EngineConfig(batch_invariant=flag, num_threads=args.threads)
    llm = LLM(config, load_model(config))
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    row = {}
    for batch in args.batches:
        _timed(llm, _prompts(rng, batch, 40, vocab), 2)  # warm-up
        secs = _timed(llm, _prompts(rng, batch, 40, vocab), args.tokens)
        row[f"decode_b{batch}"] = batch * args.tokens / secs
    times = [_timed(llm, _prompts(rng, 1, args.prefill, vocab), 1) for _ in range(3)]
    row["prefill"] = args.prefill / statistics.median(times)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {flag: measure(flag, args) for flag in (False, True)}
    cols = list(rows[False])
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("| metric (tok/s) | flag off | flag on | on / off |")
    print("|---|---|---|---|")
    for c in cols:
        off, on = rows[False][c], rows[True][c]
        print(f"| {c} | {off:.1f} | {on:.1f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
