"""Constrained (json_schema) vs unconstrained decoding speed, side by side in one run.

One engine; for each batch size, the same prompts decode `--output-len` tokens unconstrained
(ignore_eos) and under a JSON schema whose one long string keeps the grammar open for the whole
budget: its minLength keeps every row decoding (with maxLength alone some rows closed the string
and ended early, so the batch finished with fewer tokens in the same time and the ratio measured
occupancy, not the constraint's cost). The two alternate `--reps` times and the best run of each
counts (the machine is shared, so the best run is the one least disturbed). Reports output tokens/s for both and the ratio (goal >= 0.9).

    .venv/bin/python benchmarks/serve_structured.py --batch-sizes 1 16 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import engine_for  # noqa: E402

from deepserve.engine.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from deepserve.server.bench import make_prompts  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 1000, "maxLength": 4000}},
    "required": ["story"],
    "additionalProperties": False,
}


async def tokens_per_second(engine, prompts, params: SamplingParams, tag: str) -> dict:
    async def one(i: int, ids: list[int]) -> int:
        n = 0
        async for out in engine.generate(f"{tag}-{i}-{time.time_ns()}", engine.admit(ids, params)):
            n += len(out.outputs[0].token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - start
    return {"tokens": sum(counts), "seconds": duration, "tokens_per_s": sum(counts) / duration}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None, help="default: all cores, as serve")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        structured=StructuredOutput("json_schema", json.dumps(SCHEMA)),
    )
    rows = []
    with engine_for(args.model, num_threads=args.num_threads) as engine:
        for batch in args.batch_sizes:
            texts = make_prompts(batch, 24, seed=batch)
            template = "<|im_start|>user\nWrite a long story as JSON: {}<|im_end|>\n<|im_start|>assistant\n"
            ids = [
                engine.tokenizer.encode(template.format(t), add_special_tokens=False).ids
                for t in texts
            ]
            asyncio.run(tokens_per_second(engine, ids[:1], constrained, "warm"))
            runs_a, runs_b = [], []
            for _ in range(args.reps):
                runs_a.append(asyncio.run(tokens_per_second(engine, ids, free, "free")))
                runs_b.append(asyncio.run(tokens_per_second(engine, ids, constrained, "json")))
            a = max(runs_a, key=lambda r: r["tokens_per_s"])
            b = max(runs_b, key=lambda r: r["tokens_per_s"])
            rows.append(
                {
                    "batch": batch,
                    "unconstrained": a,
                    "json_schema": b,
                    "ratio": b["tokens_per_s"] / a["tokens_per_s"],
                }
            )
    print(json.dumps({"workload": vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
