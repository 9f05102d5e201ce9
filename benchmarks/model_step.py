"""Model-only decode step timing (no scheduler, no sampler): how fast the reference path runs a
flattened decode batch of B sequences with `ctx` cached tokens each. Separates model cost from
engine cost when reading benchmarks/engine_cpu.py's numbers.

    python benchmarks/model_step.py [--model smollm2-135m|smollm2-shape|PATH] [--threads 1] [--batch 1 16]

`smollm2-shape` builds SmolLM2-135M's shape with random weights (no files needed).
"""

from __future__ import annotations

import argparse
import time

import torch

from deepserve.engine.models.common import WeightStore
from deepserve.engine.models.llama import LlamaForCausalLM
from deepserve.kernels.attention_metadata import AttentionMetadata
from deepserve.kernels.registry import get_kernels


def smollm2_shape(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    c = {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    }  # fmt: skip
    shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (576,),
            p + "post_attention_layernorm.weight": (576,),
        }
        for n, s in [("q", 576), ("k", 192), ("v", 192), ("o", 576)]:
            shapes[p + f"self_attn.{n}_proj.weight"] = (s, 576)
        shapes |= {p + "mlp.gate_proj.weight": (1536, 576), p + "mlp.up_proj.weight": (1536, 576)}
        shapes[p + "mlp.down_proj.weight"] = (576, 1536)
    weights = {k: torch.randn(v) * 0.05 for k, v in shapes.items()}
    kernels = get_kernels(device, batch_invariant=False)
    return LlamaForCausalLM(c, WeightStore(weights, torch.device(device), dtype), kernels, "bench")


def load(name: str, device: str, dtype: str):
    if name == "smollm2-shape":
        return smollm2_shape(device, getattr(torch, dtype))
    from deepserve.engine.config import EngineConfig
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(model=name, device=device, dtype=dtype)).model


def step_time(model, batch: int, ctx: int, steps: int, block_size: int = 16) -> float:
    spec, dev = model.kv_cache_spec, model.device
    nb = (ctx + steps) // block_size + 2
    cache = torch.zeros(
        spec.num_layers, batch * nb + 1, block_size, spec.width, dtype=spec.dtype, device=dev
    )
    tables = (torch.arange(batch * nb) + 1).view(batch, nb).to(torch.int32)
    times = []
    for s in range(steps):
        n = ctx + s
        pos = torch.full((batch,), n)
        slots = tables[:, n // block_size].long() * block_size + n % block_size
        t0 = time.perf_counter()
        attn = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.full((batch,), n + 1, dtype=torch.int32, device=dev),
            context_lens=torch.full((batch,), n, dtype=torch.int32, device=dev),
            slot_mapping=slots.to(dev),
            block_tables=tables.to(dev),
            block_size=block_size,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[n + 1] * batch,
            context_lens_cpu=[n] * batch,
        )
        with torch.inference_mode():
            model.compute_logits(
                model.forward(
                    torch.zeros(batch, dtype=torch.long, device=dev), pos.to(dev), attn, cache
                )
            )
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.model, args.device, args.dtype)
    for b in args.batch:
        t = step_time(model, b, args.ctx, args.steps)
        print(
            f"{args.model} {args.dtype} threads={args.threads} batch={b}: median step {t * 1e3:.1f} ms, {b / t:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
