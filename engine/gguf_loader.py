"""Reads a GGUF checkpoint into the engine's common form: an HF-style config dict, HF-named float32
tensors (dequantized), the embedded tokenizer and chat template.

Supported: the `llama` architecture; tensor types F32, F16, BF16, Q4_0, Q4_1, Q8_0. llama.cpp's
converter permutes the rows of Q and K (interleaved rotary pairs); we undo that so the weights are
exactly the HF layout the models expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError
from deepserve.engine.tokenizer import tokenizer_from_gguf

SUPPORTED_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q8_0,
}

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


@dataclass
class GGUFCheckpoint:
    config: dict  # HF config.json-style keys
    weights: dict[str, torch.Tensor]  # HF names, float32
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    chat_template: str | None


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: Path) -> GGUFCheckpoint:
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path.name} is not supported (only 'llama')"
        )
    config = _llama_config(reader)
    weights = _read_tensors(reader, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    return GGUFCheckpoint(
        config=config,
        weights=weights,
        tokenizer=_tokenizer(reader),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(_field(reader, "tokenizer.ggml.eos_token_id"))],
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _llama_config(r: gguf.GGUFReader) -> dict:
    heads = int(_field(r, "llama.attention.head_count"))
    hidden = int(_field(r, "llama.embedding_length"))
    tokens = _field(r, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(r, "llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(r, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(r, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(r, "llama.context_length", 2048)),
    }
    factor = _field(r, "llama.rope.scaling.factor")
    if factor and _field(r, "llama.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError("GGUF rope scaling is not supported")
    return config


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


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: per head, rows were reordered from HF's half-split
    rotary layout to interleaved pairs; restore the half-split order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_tensors(r: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    heads = {"self_attn.q_proj": config["num_attention_heads"]}
    heads["self_attn.k_proj"] = config["num_key_value_heads"]
    weights = {}
    for t in r.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} has quantization {t.tensor_type.name}; supported: "
                + ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            )
        name = _hf_name(t.name)
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        for part, n in heads.items():
            if f".{part}." in name:
                array = unpermute_rotary_rows(array, n)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return weights


def _tokenizer(r: gguf.GGUFReader) -> Tokenizer:
    tokens = _field(r, "tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedModelError("GGUF file has no embedded tokenizer")
    return tokenizer_from_gguf(
        model=_field(r, "tokenizer.ggml.model"),
        tokens=list(tokens),
        token_types=list(_field(r, "tokenizer.ggml.token_type", [1] * len(tokens))),
        merges=list(_field(r, "tokenizer.ggml.merges", [])),
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
    )
