"""Checkpoints of real model shapes with random weights, for trying the GPU path with no hub:
`write_shaped_model("deepseek-v2-lite", out_dir, device="cuda")`.

DeepSeek-V4-Flash's shape (hidden 4096, 64 heads over one 512-dim latent, 256 routed experts top-6
+ 1 shared, CSA / HCA / sliding layers, hyper-connections) is written in the published V4 layout
(deepseek_v4_layout.py) with `layers` of its 43 (`--layers`): the first one or two sliding-window
only, then CSA and HCA alternating, hash-routed MoE in the first three (fewer with fewer layers, so
every kind of layer is kept from 3 layers up).

DeepSeek-V2-Lite's shape (15.7B: MLA with kv_lora_rank 512, no q LoRA, 64 routed experts top-6
under softmax routing + 2 shared, 27 layers, YaRN to 160K) is written as published
(`DeepseekV2ForCausalLM`, one tensor per expert); `deepseek-v2-lite-v3arch` is the same geometry
in the DeepseekV3 architecture with a 4K context and transformers 5's fused expert layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which the GPU
benchmarks run beside transformers' DeepseekV3 model. `deepseek-v3-slice` is DeepSeek-V3 / R1's
geometry (hidden 7168, 128 heads, q LoRA 1536, kv LoRA 512, 256 experts top-8 in 8 groups of which
4, sigmoid routing with a correction bias, scaling 2.5, 3 dense layers first, one MTP layer) with
4 of its 61 layers unless `--layers` says otherwise, written as published (one tensor per expert;
`--quantization fp8` as its FP8 release, testmodels/quantize.py). SmolLM2-135M's is written as a
Llama, and DeepSeek-R1-Distill-Qwen-1.5B's as a Qwen2 (q/k/v biases, untied head) with R1's special
tokens and chat template. Weights are drawn on `device` (a GPU draws 15.7B values in seconds) from
N(0, 0.02) like transformers' own init, norms are ones; the tokenizer is a word-level one over the
vocabulary, split on whitespace (`t5 t7` is ids 5, 7; other words are id 0). Timing does not
depend on the values, so these serve the benchmarks; they are not for text.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from deepserve.engine.models.deepseek_v4_config import CSA, HCA, SLIDING
from deepserve.engine.testmodels.deepseek_v4_layout import TensorSpec, tensor_specs
from deepserve.engine.testmodels.quantize import quantize_checkpoint

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
    "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}  # fmt: skip
# The V2-Lite geometry in the DeepseekV3 architecture with a 4K context: what the GPU benchmarks
# (benchmarks/gpu/) run, where transformers' DeepseekV3 model is the baseline.
DEEPSEEK_V2_LITE_AS_V3 = {
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
# DeepSeek-V3 / R1 / V3.1 as published (V3.1's config), 4 of its 61 layers by default (`--layers`):
# the 3 dense layers and one MoE layer, and the MTP layer with its own embedding and head.
DEEPSEEK_V3_SLICE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}  # fmt: skip
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
R1_DISTILL_QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
    "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "sliding_window": 4096, "use_sliding_window": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}  # fmt: skip
# R1-Distill's special tokens at their ids in the published tokenizer (Qwen2's vocabulary).
R1_SPECIAL_TOKENS = {
    "<｜end▁of▁sentence｜>": 151643, "<｜User｜>": 151644, "<｜Assistant｜>": 151645,
    "<｜begin▁of▁sentence｜>": 151646, "<think>": 151648, "</think>": 151649,
}  # fmt: skip
# R1-Distill's chat template without its tool-call branches: earlier answers keep only the text
# after `</think>`, and the assistant turn opens a think block.
R1_CHAT_TEMPLATE = (
    "{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
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
    "deepseek-v2-lite-v3arch": DEEPSEEK_V2_LITE_AS_V3,
    "deepseek-v3-slice": DEEPSEEK_V3_SLICE,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
    "smollm2-135m": SMOLLM2_135M,
    "r1-distill-qwen-1.5b": R1_DISTILL_QWEN_1_5B,
}
# shapes written in transformers 5's fused expert layout; the others one tensor per expert
FUSED_EXPERTS = ("deepseek-v2-lite-v3arch",)
STD = 0.02


def random_weights(
    config: dict, device: str, seed: int, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors of `config`'s shapes (llama, qwen2, deepseek_v2/v3 or v4); a
    deepseek_v3 MoE's experts fused into [E, 2I, H] / [E, H, I] tensors with `fused_experts`."""
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
    deepseek = config["model_type"] in ("deepseek_v2", "deepseek_v3")
    layer = partial(_deepseek_layer, fused=fused_experts) if deepseek else _llama_layer
    layers = config["num_hidden_layers"]
    mtp = (config.get("num_nextn_predict_layers") or 0) if deepseek else 0
    for i in range(layers + mtp):
        w |= {f"model.layers.{i}.{k}": v for k, v in layer(config, i, mat, ones).items()}
        if i >= layers:  # an MTP layer, as published with its own embedding and head
            w |= {f"model.layers.{i}.{k}": v for k, v in _mtp(hidden, vocab, mat, ones).items()}
    return w


def _mtp(hidden: int, vocab: int, mat, ones) -> dict[str, torch.Tensor]:
    return {
        "enorm.weight": ones(hidden),
        "hnorm.weight": ones(hidden),
        "eh_proj.weight": mat(hidden, 2 * hidden),
        "embed_tokens.weight": mat(vocab, hidden),
        "shared_head.norm.weight": ones(hidden),
        "shared_head.head.weight": mat(vocab, hidden),
    }


def _mlp(prefix: str, hidden: int, inter: int, mat) -> dict[str, torch.Tensor]:
    return {
        prefix + "gate_proj.weight": mat(inter, hidden),
        prefix + "up_proj.weight": mat(inter, hidden),
        prefix + "down_proj.weight": mat(hidden, inter),
    }


def _llama_layer(c: dict, i: int, mat, ones) -> dict[str, torch.Tensor]:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    t = {
        "input_layernorm.weight": ones(h),
        "post_attention_layernorm.weight": ones(h),
        "self_attn.q_proj.weight": mat(heads * d, h),
        "self_attn.k_proj.weight": mat(kv * d, h),
        "self_attn.v_proj.weight": mat(kv * d, h),
        "self_attn.o_proj.weight": mat(h, heads * d),
        **_mlp("mlp.", h, c["intermediate_size"], mat),
    }
    if c["model_type"] == "qwen2":  # Qwen2: biases on q, k and v only
        t |= {f"self_attn.{n}_proj.bias": mat(rows) for n, rows in (("q", heads * d),
              ("k", kv * d), ("v", kv * d))}  # fmt: skip
    return t


def _deepseek_layer(c: dict, i: int, mat, ones, fused: bool) -> dict[str, torch.Tensor]:
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
    t["mlp.gate.weight"] = mat(experts, h).float()
    if c["model_type"] == "deepseek_v3":  # V2 routes without a correction bias
        t["mlp.gate.e_score_correction_bias"] = torch.zeros(experts, device=ones(1).device)
    if fused:
        t["mlp.experts.gate_up_proj"] = mat(experts, 2 * inter, h)
        t["mlp.experts.down_proj"] = mat(experts, h, inter)
    else:  # as published: one tensor per expert
        for e in range(experts):
            t |= _mlp(f"mlp.experts.{e}.", h, inter, mat)
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
    return {
        name: v4_tensor(config, spec, device, gen) for name, spec in tensor_specs(config).items()
    }


def v4_tensor(config: dict, spec: TensorSpec, device: str, gen: torch.Generator) -> torch.Tensor:
    """One tensor of the V4 layout, made as `_deepseek_v4_weights` makes it (the GPU benchmark
    makes a full-width slice's tensors one at a time: the whole slice is 81 GB)."""
    if spec.kind in ("matrix", "embed"):
        t = torch.empty(spec.shape, device=device, dtype=torch.bfloat16)
        return t.normal_(0.0, STD, generator=gen)
    if spec.kind == "tid2eid":
        scores = torch.rand(spec.shape[0], config["n_routed_experts"], device=device, generator=gen)
        return scores.argsort(dim=-1)[:, : spec.shape[1]].contiguous()
    fill = 1.0 if spec.kind in ("norm", "hc_scale") else 0.0
    return torch.full(spec.shape, fill, device=device, dtype=torch.float32)


def _word_tokenizer(vocab_size: int, special: dict[str, int] | None = None) -> Tokenizer:
    """Words `t0`..`t{V-1}` are the token ids; any other word is `t0`. Split on whitespace, so a
    text prompt (an HTTP benchmark's) has as many tokens as words. `special` tokens take their
    ids' places and are matched anywhere in the text (`<｜Assistant｜><think>` is two tokens)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    for text, i in (special or {}).items():
        del vocab[f"t{i}"]
        vocab[text] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if special:  # tokens decode concatenated, so a text's decode is the same however split
        tok.decoder = decoders.Fuse()
    # as published, the think markers are plain added tokens and the rest special ones
    think = [t for t in (special or {}) if t in ("<think>", "</think>")]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in think])
    tok.add_special_tokens(
        [AddedToken(t, normalized=False) for t in special or {} if t not in think]
    )
    return tok


def _write_tokenizer(config: dict, out_dir: Path) -> None:
    """tokenizer.json; for R1-Distill also its special tokens and chat template (which the server
    renders prompts with, through its chat-template family)."""
    if config["model_type"] != "qwen2":
        _word_tokenizer(config["vocab_size"]).save(str(out_dir / "tokenizer.json"))
        return
    _word_tokenizer(config["vocab_size"], R1_SPECIAL_TOKENS).save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "chat_template": R1_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_shaped_model(
    name: str,
    out_dir: Path,
    device: str = "cpu",
    seed: int = 0,
    overrides: dict | None = None,
    quantization: str | None = None,
) -> Path:
    """Write shape `name` (a key of SHAPES; `overrides` replace config values) as an HF folder,
    quantized as the real model is published with `quantization` (testmodels/quantize.py)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} ({', '.join(SHAPES)})")
    config = dict(SHAPES[name], **(overrides or {}))
    if config["model_type"] == "deepseek_v4" and "layer_types" not in (overrides or {}):
        config |= v4_layer_schedule(config["num_hidden_layers"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, device, seed, fused_experts=name in FUSED_EXPERTS)
    if quantization is not None:
        config, weights = quantize_checkpoint(config, weights, quantization)
    save_file(
        {k: v.contiguous().cpu() for k, v in weights.items()}, str(out_dir / "model.safetensors")
    )
    _write_tokenizer(config, out_dir)
    # config.json last: model_registry treats its presence as "the folder is complete"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
