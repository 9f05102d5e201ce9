"""Async scheduling on against off (engine/async_scheduling.py), decode only, in one process.

For each shape the same transformers-initialised weights serve two engines that differ only in
`async_scheduling`; decode tok/s is speed.py's measure (128-token prompts, 128 greedy tokens, the
prefill timed apart and taken out). Also the engine's own counts of steps launched ahead and of
fallbacks, so a figure that did not move can be told from an overlap that never engaged.
Imported by run_all.py (section `async`).
"""

from __future__ import annotations

import random
import time

import torch


def section_async(out: dict, shapes: list[str], batches: dict, tokens: int, deadline: float):
    import speed

    rows = out.setdefault("async", [])
    for name in shapes:
        config = speed.SHAPES[name]
        vocab = config["vocab_size"]
        hf = speed.build_hf(config)
        for flag in (True, False):
            if time.time() > deadline:
                break
            rng = random.Random(3)
            llm = speed.build_llm(config, hf, False, max_model_len=4096, async_scheduling=flag)
            engine = llm.engine
            for b in batches[name]:
                if time.time() > deadline:
                    break
                before = (engine.overlap.ahead, engine.overlap.fallbacks)
                tok_s = speed.engine_decode_tok_s(llm, b, vocab, rng, tokens)
                ahead = engine.overlap.ahead - before[0]
                fallbacks = engine.overlap.fallbacks - before[1]
                rows.append(dict(shape=name, async_scheduling=flag, batch=b, decode_tok_s=tok_s,
                                 step_ms=1e3 * b / tok_s, ahead=ahead, fallbacks=fallbacks))  # fmt: skip
                print(rows[-1], flush=True)
            engine.runner.close()
            del llm, engine
            torch.cuda.empty_cache()
        del hf
        torch.cuda.empty_cache()
