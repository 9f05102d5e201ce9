"""How a DeepSeek-V4 config.json names its layer schedule, read the same way by the model and the
test-model writers: transformers' `layer_types` / `mlp_layer_types` / `compress_rates`, or the
published checkpoints' `compress_ratios` (0 / 4 / 128 per layer, then the MTP layers') and
`num_hash_layers`."""

from __future__ import annotations

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


def layer_types(config: dict) -> list[str]:
    """Per-layer attention type."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])[:n]
    by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
    return [by_ratio[r] for r in config["compress_ratios"][:n]]


def mtp_layer_type(config: dict, j: int) -> str:
    """Attention type of MTP layer `j`: the schedule's entry after the last decoder layer where
    the config lists one, else sliding window."""
    n = config["num_hidden_layers"] + j
    kinds = config.get("layer_types") or [
        {0: SLIDING, 4: CSA, 128: HCA}[r] for r in config.get("compress_ratios") or []
    ]
    return kinds[n] if n < len(kinds) else SLIDING


def mlp_layer_types(config: dict) -> list[str]:
    """Per-layer MoE kind: `hash_moe` (tid2eid routing) or `moe`."""
    n = config["num_hidden_layers"]
    if config.get("mlp_layer_types"):
        return list(config["mlp_layer_types"])[:n]
    hashed = min(n, config.get("num_hash_layers", 3))
    return ["hash_moe"] * hashed + ["moe"] * (n - hashed)


def compress_rate(config: dict, kind: str) -> int:
    """Tokens per compressed entry of a CSA or HCA layer."""
    rates = config.get("compress_rates") or {}
    default = {CSA: config.get("compress_rate_csa", 4), HCA: config.get("compress_rate_hca", 128)}
    return int(rates.get(kind, default[kind]))
