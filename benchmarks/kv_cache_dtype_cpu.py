"""`--kv-cache-dtype auto` against `fp8` on the CPU, side by side in one process: decode tokens/s of
a batch of prompts (greedy, ignore_eos), runs alternated A/B so host load hits both alike, the
median and the spread of `--reps` runs each, and the KV bytes per token of either cache. On the CPU
an e4m3 cache runs the torch reference attention (the native kernels read float32 / bfloat16
only) and the unfused writes, so this measures that fallback's cost, not a GPU's.

    .venv/bin/python benchmarks/kv_cache_dtype_cpu.py --model smollm2-135m --batch 8 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.loading.loader import load_model
from deepserve.engine.sampling_params import SamplingParams


def tok_s(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Decode tokens/s of `prompts` run together: steps timed from the one where every request
    has its first token (prefill done) to the end."""
    engine, params = (
        llm.engine,
        SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True),
    )
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step())
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    llms = {}
    for kv in ("auto", "fp8"):
        config = EngineConfig(model=a.model, dtype=a.dtype, kv_cache_dtype=kv, num_kv_blocks=512,
                              enable_prefix_caching=False)  # fmt: skip
        llms[kv] = LLM(config, load_model(config))
    text = "The old lighthouse keeper climbed the spiral stairs every evening. " * 40
    ids = llms["auto"].encode(text)[: a.prompt_tokens]
    prompts = [ids[i:] + ids[:i] for i in range(a.batch)]
    for llm in llms.values():  # warm-up: thread pools, first-call allocations
        tok_s(llm, prompts[:2], 2)
    runs: dict[str, list[float]] = {kv: [] for kv in llms}
    for _ in range(a.reps):
        for kv, llm in llms.items():
            runs[kv].append(tok_s(llm, prompts, a.tokens))
    for kv, llm in llms.items():
        card = llm.engine.card()
        per_token = card.kv_block_bytes // card.block_size
        values = sorted(runs[kv])
        print(f"{kv:5} {card.kv_cache_dtype:14} {per_token:6d} B/token  decode "
              f"{statistics.median(values):7.1f} tok/s  (runs {', '.join(f'{v:.1f}' for v in values)})")  # fmt: skip


if __name__ == "__main__":
    main()
