"""A layer's KV cache scales: read from the checkpoint where it carries them, else 1.0.

vLLM's names: `<attention>.k_scale` and `.v_scale`, or one `.kv_scale` for both (scalar tensors;
a per-tensor scale is all a cache row needs). A cache in the model's own dtype ignores them; a
quantized (e4m3) one stores `values / scale` (kernels/kv_quant.py). A checkpoint without them
gets 1.0, vLLM's default: right for activations well inside e4m3's range (+-448), which the KV
rows of the models served here are (the latent is RMS-normed; keys and values of Llama layers
stay within a few tens).
What does not live here: how a model applies them (its attention) and the quantization itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.models.common import WeightStore

_NAMES = ("k_scale", "v_scale", "kv_scale")


@dataclass(frozen=True)
class KVScales:
    k: float = 1.0
    v: float = 1.0

    @property
    def unit(self) -> bool:
        return self.k == 1.0 and self.v == 1.0


def read_kv_scales(weights: WeightStore, prefix: str, quantized: bool) -> KVScales:
    """The scales under `prefix` (e.g. `model.layers.3.self_attn.`), each read (so the loader
    counts them as used) whether or not the cache is `quantized`; unit scales when it is not."""
    found = {n: _scalar(weights, prefix + n) for n in _NAMES if weights.has(prefix + n)}
    if not quantized:
        return KVScales()
    both = found.get("kv_scale", 1.0)
    return KVScales(found.get("k_scale", both), found.get("v_scale", both))


def _scalar(weights: WeightStore, name: str) -> float:
    t = weights.get(name, torch.float32)
    if t.numel() != 1:
        raise UnsupportedModelError(
            f"{name} has {t.numel()} values: only per-tensor KV cache scales are read"
        )
    value = float(t.reshape(()).cpu())
    if not value > 0.0:
        raise UnsupportedModelError(f"{name} = {value}: a KV cache scale must be positive")
    return value


def scaled(values: torch.Tensor, scale: float) -> torch.Tensor:
    """KV rows as a quantized cache stores them before the cast: `values / scale`."""
    return values if scale == 1.0 else values / scale
