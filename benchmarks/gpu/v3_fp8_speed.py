"""DeepSeek-V3's geometry in FP8 on the H200 against its HBM floor (issue 29): section `v3_fp8`.

The V3 / R1 slice (`deepseek-v3-slice`'s geometry: hidden 7168, 128 heads, 256 experts top-8)
with 8 of its 61 layers (3 dense, then 5 MoE), its matrices block-scaled FP8 as V3 publishes them
(embeddings, head and router gate kept), made on the device tensor by tensor and never held in
bf16 as a whole (~64 GB as loaded). Decode tokens/s at batch 1 and 64 after 128-token prompts,
beside the step's HBM floor: the bytes one decode step must read (every non-expert weight once,
the routed experts the batch touches: 8 a layer at batch 1, the expected distinct count of
64 x 8 uniform picks among 256 at batch 64, each expert's FP8 bytes and scales) over 4.8 TB/s.
Random routing touches more experts than a trained router's skew would, so the floor is the
random-weight one. Imported by run_all.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping

import speed
import torch

from deepserve.engine.testmodels.model_shapes import (
    DEEPSEEK_V3_SLICE,
    STD,
    _deepseek_layer,
)
from deepserve.kernels import block_quant

LAYERS = 8
HBM_BYTES_S = 4.8e12
CONFIG = dict(DEEPSEEK_V3_SLICE, num_hidden_layers=LAYERS, num_nextn_predict_layers=0)


def _shapes(config: dict) -> dict[str, torch.Size]:
    """Every HF-named tensor's shape, from model_shapes' own layout on the meta device."""

    def mat(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.empty(n, device="meta", dtype=torch.bfloat16)

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": mat(vocab, hidden), "model.norm.weight": ones(hidden),
              "lm_head.weight": mat(vocab, hidden)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        layer = _deepseek_layer(config, i, mat, ones, fused=True)
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    return {name: t.shape for name, t in shapes.items()}


class LazyV3Fp8(Mapping):
    """The slice's tensors made on the device when the loader asks (norms ones, the correction
    bias zeros, the router gate float32, matrices normal(0, STD) then block-scaled FP8)."""

    def __init__(self, config: dict, seed: int = 0, device: str = "cuda") -> None:
        self.shapes = _shapes(config)
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def __getitem__(self, name: str):
        shape, device = self.shapes[name], self.device
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device, dtype=torch.bfloat16)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=device)
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        t.normal_(0, STD, generator=self.gen)
        if name.endswith("mlp.gate.weight"):
            return t.float()
        if t.dim() == 3:  # stacked experts: quantized one at a time (float32 temporaries)
            return block_quant.stack([block_quant.quantize_fp8(e) for e in t], t.dtype)
        return speed.fp8_weights({name: t})[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def step_floor_bytes(config: dict, batch: int) -> float:
    """FP8 bytes a decode step reads: every weight but the embedding and the routed experts
    once (kept tensors at their own width), plus the routed experts the batch is expected to
    touch (uniform routing), scales at 4 bytes per 128 x 128 block."""
    shapes = _shapes(config)
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    per_expert = 3 * config["hidden_size"] * config["moe_intermediate_size"] * (1 + 4 / 128**2)
    touched = experts * (1 - (1 - 1 / experts) ** (batch * top_k))
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    total = moe_layers * touched * per_expert
    for name, shape in shapes.items():
        if "embed_tokens" in name or ".experts." in name:
            continue
        n = shape.numel()
        if name.endswith(("lm_head.weight", "mlp.gate.weight")):
            total += n * (2 if "lm_head" in name else 4)
        elif len(shape) >= 2:
            total += n * (1 + 4 / 128**2)
        else:
            total += 2 * n
    return total


def section_v3_fp8(out: dict, deadline: float, batches=(1, 64), tokens: int = 64) -> None:
    rows = out.setdefault("v3_fp8", [])
    t0 = time.time()
    llm = speed.build_llm_over(CONFIG, LazyV3Fp8(CONFIG), False, quantization="fp8",
                               max_model_len=4096, kv_cache_bytes=8 * 2**30)  # fmt: skip
    out["v3_fp8_build_s"] = round(time.time() - t0, 1)
    out["v3_fp8_allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 1)
    rng = random.Random(3)
    for b in batches:
        if time.time() > deadline:
            out["errors"].append(f"v3_fp8: batch {b}: out of time")
            break
        tok_s = speed.engine_decode_tok_s(llm, b, CONFIG["vocab_size"], rng, tokens)
        floor_s = step_floor_bytes(CONFIG, b) / HBM_BYTES_S
        row = dict(layers=LAYERS, batch=b, decode_tok_s=round(tok_s, 1),
                   floor_tok_s=round(b / floor_s, 1), step_ms=round(1e3 * b / tok_s, 3),
                   floor_ms=round(1e3 * floor_s, 3))  # fmt: skip
        row["times_floor"] = round(row["step_ms"] / row["floor_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    llm.engine.runner.close()
    del llm
    torch.cuda.empty_cache()
