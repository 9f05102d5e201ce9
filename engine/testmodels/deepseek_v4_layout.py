"""The DeepSeek-V4 checkpoint layout: every tensor a V4 checkpoint holds, by name, shape and kind,
for a given config. The writers of V4 test models (tiny_deepseek_v4.py, model_shapes.py) fill it
with values; the engine's model (engine/models/deepseek_v4.py) reads the same names.

Names are the published checkpoints' (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.experts.{e}.w1.weight`, ...), the layout transformers' `DeepseekV4ForCausalLM`
loads through its conversion mapping. Routed experts are one tensor per expert, as published.

The MTP layers (`num_nextn_predict_layers`) are `mtp.{j}.*` as published (transformers skips
them on load): a decoder block under the same names as a layer's (`mtp.{j}.attn.*`,
`mtp.{j}.ffn.*`, `mtp.{j}.hc_attn_fn`, ...), `enorm` / `hnorm` and the separate `e_proj` /
`h_proj` that feed it, and its own hyper head (`hc_head_*`) and `norm` before the shared `head`.
The block's attention type is `compress_ratios[num_hidden_layers + j]` where the config lists
one, else sliding window (deepseek_v4_config.py); its MoE routes by score, not by hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.engine.models.deepseek_v4_config import (
    CSA,
    SLIDING,
    compress_rate,
    layer_types,
    mlp_layer_types,
    mtp_layer_type,
)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    # "matrix" (a linear weight, [out, in]), "embed", "norm" (RMSNorm weight), "bias" (router
    # correction bias), "sink" (per-head attention sink), "position_bias" (compressor ape),
    # "hc_fn" / "hc_base" / "hc_scale" (hyper-connection mixing), "tid2eid" (hash routing table)
    kind: str


def tensor_specs(config: dict) -> dict[str, TensorSpec]:
    c, hidden, hc = config, config["hidden_size"], config["hc_mult"]
    specs = {
        "embed.weight": TensorSpec((c["vocab_size"], hidden), "embed"),
        "head.weight": TensorSpec((c["vocab_size"], hidden), "matrix"),
        "norm.weight": TensorSpec((hidden,), "norm"),
        "hc_head_fn": TensorSpec((hc, hc * hidden), "hc_fn"),
        "hc_head_base": TensorSpec((hc,), "hc_base"),
        "hc_head_scale": TensorSpec((1,), "hc_scale"),
    }
    kinds, mlps = layer_types(c), mlp_layer_types(c)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        specs |= _hyper_connections(p, hidden, hc)
        specs |= _attention(c, p + "attn.", kinds[i])
        specs |= _moe(c, p + "ffn.", mlps[i] == "hash_moe")
    for j in range(c.get("num_nextn_predict_layers") or 0):
        specs |= _mtp(c, f"mtp.{j}.", mtp_layer_type(c, j))
    return specs


def _mtp(c: dict, p: str, kind: str) -> dict[str, TensorSpec]:
    hidden, hc = c["hidden_size"], c["hc_mult"]
    out = {
        p + "enorm.weight": TensorSpec((hidden,), "norm"),
        p + "hnorm.weight": TensorSpec((hidden,), "norm"),
        p + "e_proj.weight": TensorSpec((hidden, hidden), "matrix"),
        p + "h_proj.weight": TensorSpec((hidden, hidden), "matrix"),
        p + "norm.weight": TensorSpec((hidden,), "norm"),
        p + "hc_head_fn": TensorSpec((hc, hc * hidden), "hc_fn"),
        p + "hc_head_base": TensorSpec((hc,), "hc_base"),
        p + "hc_head_scale": TensorSpec((1,), "hc_scale"),
    }
    out |= _hyper_connections(p, hidden, hc)
    return out | _attention(c, p + "attn.", kind) | _moe(c, p + "ffn.", False)


def _hyper_connections(p: str, hidden: int, hc: int) -> dict[str, TensorSpec]:
    mixes = (2 + hc) * hc
    out = {p + "attn_norm.weight": TensorSpec((hidden,), "norm")}
    out[p + "ffn_norm.weight"] = TensorSpec((hidden,), "norm")
    for block in ("attn", "ffn"):
        out[f"{p}hc_{block}_fn"] = TensorSpec((mixes, hc * hidden), "hc_fn")
        out[f"{p}hc_{block}_base"] = TensorSpec((mixes,), "hc_base")
        out[f"{p}hc_{block}_scale"] = TensorSpec((3,), "hc_scale")
    return out


def _attention(c: dict, p: str, kind: str) -> dict[str, TensorSpec]:
    hidden, heads, d = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    q_lora, groups, o_rank = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    out = {
        p + "wq_a.weight": TensorSpec((q_lora, hidden), "matrix"),
        p + "q_norm.weight": TensorSpec((q_lora,), "norm"),
        p + "wq_b.weight": TensorSpec((heads * d, q_lora), "matrix"),
        p + "wkv.weight": TensorSpec((d, hidden), "matrix"),
        p + "kv_norm.weight": TensorSpec((d,), "norm"),
        p + "wo_a.weight": TensorSpec((groups * o_rank, heads * d // groups), "matrix"),
        p + "wo_b.weight": TensorSpec((hidden, groups * o_rank), "matrix"),
        p + "attn_sink": TensorSpec((heads,), "sink"),
    }
    if kind == SLIDING:
        return out
    ratio = compress_rate(c, kind)
    series = 2 if kind == CSA else 1  # CSA's windows overlap: two series per token
    out |= _compressor(p + "compressor.", hidden, d, ratio, series)
    if kind == CSA:
        di, hi = c["index_head_dim"], c["index_n_heads"]
        out[p + "indexer.wq_b.weight"] = TensorSpec((hi * di, q_lora), "matrix")
        out[p + "indexer.weights_proj.weight"] = TensorSpec((hi, hidden), "matrix")
        out |= _compressor(p + "indexer.compressor.", hidden, di, ratio, 2)
    return out


def _compressor(p: str, hidden: int, dim: int, ratio: int, series: int) -> dict[str, TensorSpec]:
    return {
        p + "wkv.weight": TensorSpec((series * dim, hidden), "matrix"),
        p + "wgate.weight": TensorSpec((series * dim, hidden), "matrix"),
        p + "ape": TensorSpec((ratio, series * dim), "position_bias"),
        p + "norm.weight": TensorSpec((dim,), "norm"),
    }


def _moe(c: dict, p: str, hashed: bool) -> dict[str, TensorSpec]:
    hidden, experts, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    out = {p + "gate.weight": TensorSpec((experts, hidden), "matrix")}
    if hashed:
        out[p + "gate.tid2eid"] = TensorSpec((c["vocab_size"], c["num_experts_per_tok"]), "tid2eid")
    else:
        out[p + "gate.bias"] = TensorSpec((experts,), "bias")
    for e in range(experts):
        out |= _mlp(f"{p}experts.{e}.", hidden, inter)
    return out | _mlp(p + "shared_experts.", hidden, inter * c.get("n_shared_experts", 1))


def _mlp(p: str, hidden: int, inter: int) -> dict[str, TensorSpec]:
    return {
        p + "w1.weight": TensorSpec((inter, hidden), "matrix"),  # gate
        p + "w3.weight": TensorSpec((inter, hidden), "matrix"),  # up
        p + "w2.weight": TensorSpec((hidden, inter), "matrix"),  # down
    }
