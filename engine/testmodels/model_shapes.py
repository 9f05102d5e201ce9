"""Checkpoints of real model shapes with random weights, for trying the GPU path with no hub:
`write_shaped_model("deepseek-v2-lite", out_dir, device="cuda")`.

DeepSeek-V4-Flash's shape (hidden 4096, 64 heads over one 512-dim latent, 256 routed experts top-6
+ 1 shared, CSA / HCA / sliding layers, hyper-connections) is written in the published V4 layout
(deepseek_v4_layout.py) with `layers` of its 43 (`--layers`): the first one or two sliding-window
only, then CSA and HCA alternating, hash-routed MoE in the first three (fewer with fewer layers, so
every kind of layer is kept from 3 layers up).

DeepSeek-V2-Lite's shape (15.7B: MLA with kv_lora_rank 512, 64 routed experts top-6 + 2 shared,
27 layers) is written in the DeepseekV3 architecture with a 4K context, and SmolLM2-135M's as a
Llama. Weights are drawn on `device` (a GPU draws 15.7B values in seconds) from N(0, 0.02) like
transformers' own init, norms are ones, experts are stored in transformers 5's fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); the tokenizer is a
word-level one over the vocabulary, split on whitespace (`t5 t7` is ids 5, 7; other words are id
0). Timing does not depend on the values, so these serve the benchmarks; they are not for text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from deepserve.engine.models.deepseek_v4_config import CSA, HCA, SLIDING
from deepserve.engine.testmodels.deepseek_v4_layout import tensor_specs

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_nextn_predict_layers": 0,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
    "topk_group": 1, "scoring_func": "sigmoid", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "bfloat16",
}  # fmt: skip
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "compress_rates": {CSA: 4, HCA: 128}, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_nextn_predict_layers": 0,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}  # fmt: skip
SHAPES = {
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
    "smollm2-135m": SMOLLM2_135M,
}
STD = 0.02


def random_weights(config: dict, device: str, seed: int) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors of `config`'s shapes (llama, deepseek_v3 or deepseek_v4)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if config["model_type"] == "deepseek_v4":
        return _deepseek_v4_weights(config, device, gen)

    def mat(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        return t.normal_(0.0, STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=torch.bfloat16)

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    w = {"model.embed_tokens.weight": mat(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = mat(vocab, hidden)
    layer = _deepseek_layer if config["model_type"] == "deepseek_v3" else _llama_layer
    for i in range(config["num_hidden_layers"]):
        w |= {f"model.layers.{i}.{k}": v for k, v in layer(config, i, mat, ones).items()}
    return w


def _mlp(prefix: str, hidden: int, inter: int, mat) -> dict[str, torch.Tensor]:
    return {
        prefix + "gate_proj.weight": mat(inter, hidden),
        prefix + "up_proj.weight": mat(inter, hidden),
        prefix + "down_proj.weight": mat(hidden, inter),
    }


def _llama_layer(c: dict, i: int, mat, ones) -> dict[str, torch.Tensor]:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    return {
        "input_layernorm.weight": ones(h),
        "post_attention_layernorm.weight": ones(h),
        "self_attn.q_proj.weight": mat(heads * d, h),
        "self_attn.k_proj.weight": mat(kv * d, h),
        "self_attn.v_proj.weight": mat(kv * d, h),
        "self_attn.o_proj.weight": mat(h, heads * d),
        **_mlp("mlp.", h, c["intermediate_size"], mat),
    }


def _deepseek_layer(c: dict, i: int, mat, ones) -> dict[str, torch.Tensor]:
    h, heads, lora = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    t = {
        "input_layernorm.weight": ones(h),
        "post_attention_layernorm.weight": ones(h),
        "self_attn.kv_a_proj_with_mqa.weight": mat(lora + rope, h),
        "self_attn.kv_a_layernorm.weight": ones(lora),
        "self_attn.kv_b_proj.weight": mat(heads * (nope + v), lora),
        "self_attn.o_proj.weight": mat(h, heads * v),
    }
    if c.get("q_lora_rank"):
        q = c["q_lora_rank"]
        t |= {
            "self_attn.q_a_proj.weight": mat(q, h),
            "self_attn.q_a_layernorm.weight": ones(q),
            "self_attn.q_b_proj.weight": mat(heads * (nope + rope), q),
        }
    else:
        t["self_attn.q_proj.weight"] = mat(heads * (nope + rope), h)
    if i < c["first_k_dense_replace"]:
        return t | _mlp("mlp.", h, c["intermediate_size"], mat)
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    t |= {
        "mlp.gate.weight": mat(experts, h).float(),
        "mlp.gate.e_score_correction_bias": torch.zeros(experts, device=ones(1).device),
        "mlp.experts.gate_up_proj": mat(experts, 2 * inter, h),
        "mlp.experts.down_proj": mat(experts, h, inter),
    }
    return t | _mlp("mlp.shared_experts.", h, inter * c["n_shared_experts"], mat)


def v4_layer_schedule(layers: int) -> dict:
    """V4-Flash's layer kinds for `layers` layers: one or two sliding-window layers, then CSA and
    HCA alternating; hash-routed MoE in the first three, and at least one learned-routing layer."""
    if layers < 3:
        raise ValueError("a deepseek-v4-flash shape needs 3 layers or more (one of each kind)")
    sliding = min(2, layers - 2)
    rest = [CSA if i % 2 == 0 else HCA for i in range(layers - sliding)]
    hashed = min(3, layers - 1)
    return {
        "num_hidden_layers": layers,
        "layer_types": [SLIDING] * sliding + rest,
        "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (layers - hashed),
    }


def _deepseek_v4_weights(config: dict, device: str, gen: torch.Generator) -> dict:
    """The published V4 layout: matrices N(0, 0.02) in bf16; norms and mixing scales ones; sinks,
    position and mixing biases zeros in float32 (as V4 keeps them); distinct hash experts."""
    out = {}
    for name, spec in tensor_specs(config).items():
        if spec.kind in ("matrix", "embed"):
            t = torch.empty(spec.shape, device=device, dtype=torch.bfloat16)
            out[name] = t.normal_(0.0, STD, generator=gen)
        elif spec.kind == "tid2eid":
            scores = torch.rand(
                spec.shape[0], config["n_routed_experts"], device=device, generator=gen
            )
            out[name] = scores.argsort(dim=-1)[:, : spec.shape[1]].contiguous()
        else:
            fill = 1.0 if spec.kind in ("norm", "hc_scale") else 0.0
            out[name] = torch.full(spec.shape, fill, device=device, dtype=torch.float32)
    return out


def _word_tokenizer(vocab_size: int) -> Tokenizer:
    """Words `t0`..`t{V-1}` are the token ids; any other word is `t0`. Split on whitespace, so a
    text prompt (an HTTP benchmark's) has as many tokens as words."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_shaped_model(
    name: str, out_dir: Path, device: str = "cpu", seed: int = 0, overrides: dict | None = None
) -> Path:
    """Write shape `name` (a key of SHAPES; `overrides` replace config values) as an HF folder."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} ({', '.join(SHAPES)})")
    config = dict(SHAPES[name], **(overrides or {}))
    if config["model_type"] == "deepseek_v4" and "layer_types" not in (overrides or {}):
        config |= v4_layer_schedule(config["num_hidden_layers"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, device, seed)
    save_file(
        {k: v.contiguous().cpu() for k, v in weights.items()}, str(out_dir / "model.safetensors")
    )
    _word_tokenizer(config["vocab_size"]).save(str(out_dir / "tokenizer.json"))
    # config.json last: model_registry treats its presence as "the folder is complete"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
