"""Async scheduling on against off (engine/async_scheduling.py), decode only, in one process.

For each shape the same transformers-initialised weights serve two engines that differ only in
`async_scheduling`; decode tok/s is speed.py's measure (128-token prompts, 128 greedy tokens, the
prefill timed apart and taken out). Also the engine's own counts of steps launched ahead and of
fallbacks, so a figure that did not move can be told from an overlap that never engaged; and
a mixed workload (greedy, seeded sampling, logprobs, staggered lengths) run on both engines,
whose outputs must be identical.
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
        outputs: dict[bool, list] = {}
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
            outputs[flag] = mixed_outputs(llm, vocab)
            engine.runner.close()
            del llm, engine
            torch.cuda.empty_cache()
        if len(outputs) == 2:
            differ = sum(a != b for a, b in zip(outputs[True], outputs[False], strict=True))
            rows.append(dict(shape=name, mixed_requests=len(outputs[True]), differing=differ))
            print(rows[-1], flush=True)
        del hf
        torch.cuda.empty_cache()


def mixed_outputs(llm, vocab: int) -> list:
    """Tokens, logprobs and finish reasons of 24 requests of mixed sampling, run together."""
    from deepserve.engine.sampling_params import SamplingParams

    rng = random.Random(11)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(24)]
    params = []
    for i in range(24):
        kind, n = i % 3, 5 + 7 * (i % 6)
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=n))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=n))
        else:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=n, logprobs=2))
    results = llm.generate(prompts, params)
    return [
        (s.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in s.logprobs or []],
         s.finish_reason)
        for r in results for s in r.samples
    ]  # fmt: skip
