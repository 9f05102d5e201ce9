"""`write_tiny_deepseek_v4`: a seeded, randomly initialized DeepSeek-V4-architecture checkpoint,
written as an ordinary HF folder in the published V4 layout (deepseek_v4_layout.py), so it loads
through the same path as real checkpoints and transformers' `DeepseekV4ForCausalLM` can be the
reference for it.

Small dims (hidden 64, 4 layers) so the test suite runs it on the CPU, but every V4 feature is on:
one layer of each attention type (sliding window only, CSA with its indexer, HCA) plus a second
CSA, hash-routed MoE in the first two layers, sqrtsoftplus routing with a correction bias and
clamped SwiGLU, hyper-connections, the grouped output projection, attention sinks, and YaRN on the
compressed branch. The window (64) and compress rates (4 and 16) make prompts of 300 and 2,000
tokens pass the window, close many compressed groups, and give CSA more compressed entries than
the indexer keeps (16). One MTP layer (`mtp.0.*`, the `--speculative mtp` drafter). The
vocabulary is the V4 tokenizer's, as tiny-deepseek's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from deepserve.engine.models.deepseek_v4_config import CSA, HCA, SLIDING
from deepserve.engine.testmodels.deepseek_v4_layout import tensor_specs
from deepserve.engine.testmodels.tiny_deepseek import (
    deepseek_tokenizer_with_specials,
    write_deepseek_folder,
)

TINY_V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 64,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.5,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def _value(name: str, shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    randn = torch.randn(shape, generator=gen) if kind != "tid2eid" else None
    if kind == "matrix":
        # a larger output gain keeps the untrained logits peaked, so greedy text depends on the prompt
        gain = 4.0 if name == "head.weight" else 1.0
        return randn * (gain / math.sqrt(shape[-1]))
    if kind == "hc_fn":
        return randn / math.sqrt(shape[-1])
    scales = {"embed": 1.0, "bias": 0.1, "sink": 0.5, "position_bias": 0.5, "hc_base": 0.5}
    if kind in scales:
        return randn * scales[kind]
    if kind in ("norm", "hc_scale"):
        return 1.0 + 0.1 * randn
    assert kind == "tid2eid", kind
    vocab, top_k = shape
    experts = TINY_V4_CONFIG["n_routed_experts"]
    # each token's hash experts are distinct, as a top-k choice would be
    return torch.rand(vocab, experts, generator=gen).argsort(dim=-1)[:, :top_k].contiguous()


def write_tiny_deepseek_v4(out_dir: Path, seed: int = 0, quantization: str | None = None) -> Path:
    """Write the checkpoint into `out_dir` (created if needed) and return it. Same seed, same bytes.
    `quantization`: "mxfp4" as V4 is published (FP8 dense, MXFP4 experts), "fp8" all FP8."""
    tokenizer = deepseek_tokenizer_with_specials()
    config = dict(TINY_V4_CONFIG, vocab_size=tokenizer.get_vocab_size())
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _value(n, s.shape, s.kind, gen) for n, s in tensor_specs(config).items()}
    return write_deepseek_folder(out_dir, config, tensors, tokenizer, quantization)
