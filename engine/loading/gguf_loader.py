"""Reads a GGUF checkpoint into the engine's common form: an HF-style config dict, HF-named float32
tensors (dequantized; Q4_0/Q4_1/Q8_0 matrices also as their raw blocks), the embedded tokenizer and
chat template.

Supported: the `llama` architecture; tensor types F32, F16, BF16, Q4_0, Q4_1, Q8_0. llama.cpp's
converter permutes the rows of Q and K (interleaved rotary pairs); we undo that so the weights are
exactly the HF layout the models expect.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer

from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError
from deepserve.engine.loading.checkpoint import Checkpoint
from deepserve.engine.loading.gguf_format import GGUFFile, dequantize, read_gguf_file
from deepserve.engine.loading.tokenizer import tokenizer_from_gguf
from deepserve.kernels.quant_panels import FORMATS, QuantizedMatrix

SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf(path: Path) -> Checkpoint:
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    f = read_gguf_file(path)
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path.name} is not supported (only 'llama')"
        )
    config = _llama_config(meta)
    weights, quantized = _read_tensors(f, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Checkpoint(
        config=config,
        weights=weights,
        tokenizer=_tokenizer(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        chat_template=meta.get("tokenizer.chat_template"),
        files=[path],
        quantized=quantized,
    )


def _llama_config(m: dict) -> dict:
    heads = int(m["llama.attention.head_count"])
    hidden = int(m["llama.embedding_length"])
    if m.get("llama.rope.scaling.type", "none") not in ("none", "linear") or m.get(
        "llama.rope.scaling.factor", 1.0
    ) not in (0.0, 1.0):
        raise UnsupportedModelError("GGUF rope scaling is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(m.get("llama.vocab_size", len(m.get("tokenizer.ggml.tokens", [])))),
        "hidden_size": hidden,
        "intermediate_size": int(m["llama.feed_forward_length"]),
        "num_hidden_layers": int(m["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(m.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(m.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(m.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.get("llama.context_length", 2048)),
    }


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K permutation: per head, rows were reordered from HF's half-split
    rotary layout to interleaved pairs; restore the half-split order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_tensors(
    f: GGUFFile, config: dict
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedMatrix]]:
    """Every tensor dequantized to float32 by HF name, and the matrices in a block format the
    native CPU linear reads (kernels/quant_panels.py) as their raw blocks."""
    heads = {"self_attn.q_proj": config["num_attention_heads"]}
    heads["self_attn.k_proj"] = config["num_key_value_heads"]
    weights, quantized = {}, {}
    for t in f.tensors:
        if t.qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} has quantization {t.qtype.name}; supported: "
                + ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            )
        name = _hf_name(t.name)
        raw = f.raw(t)
        w = dequantize(raw, t.qtype, t.shape)
        blocks = raw.view(t.shape[0], -1) if t.qtype.name in FORMATS and len(t.shape) == 2 else None
        for part, n in heads.items():
            if f".{part}." in name:
                w = unpermute_rotary_rows(w, n).contiguous()
                blocks = None if blocks is None else unpermute_rotary_rows(blocks, n).contiguous()
        weights[name] = w
        if blocks is not None:
            quantized[name] = QuantizedMatrix(t.qtype.name, blocks, t.shape[1])
    return weights, quantized


def _tokenizer(m: dict) -> Tokenizer:
    tokens = m.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedModelError("GGUF file has no embedded tokenizer")
    return tokenizer_from_gguf(
        model=m.get("tokenizer.ggml.model"),
        tokens=tokens,
        token_types=m.get("tokenizer.ggml.token_type", [1] * len(tokens)),
        merges=m.get("tokenizer.ggml.merges", []),
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        add_bos=bool(m.get("tokenizer.ggml.add_bos_token", False)),
    )
