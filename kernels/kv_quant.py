"""KV cache storage dtypes: what `--kv-cache-dtype` names, and the quantize / dequantize of KV rows.

A quantized cache (e4m3, one byte per element) holds `values / scale` saturated to e4m3's finite
range (+-448; the GPU's `cvt.satfinite` does the same), so the cache reads back as
`codes * scale`. Scales are per layer and per tensor (K and V; MLA's one latent takes K's), as
vLLM keeps them. The attention ops need no scale: a model folds K's into the softmax scale
(`q . (k * s) = s * (q . k)`) and multiplies the output by V's, so every op only widens the codes
it loads to the query's dtype (exact: every e4m3 value is a bfloat16 and a float32).
What does not live here: where the scales come from (engine/models/kv_scales.py) and the cache
tensor itself (engine/model_runner.py).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value

# `--kv-cache-dtype` names, as vLLM spells them; None: the model's own dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": FP8_KV_DTYPE,
    "fp8_e4m3": FP8_KV_DTYPE,
}


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for a `--kv-cache-dtype` name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`values` in the cache's `dtype`: divided by `scale` and saturated when quantized, a plain
    cast otherwise."""
    if values.dtype == dtype:  # already the cache's (codes, or the model's own dtype)
        return values
    if not is_quantized(dtype):
        return values.to(dtype)
    if scale != 1.0:
        values = values.float() / scale
    return values.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(codes: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache rows back in `dtype` (`codes * scale`); a no-op for an unquantized cache of `dtype`."""
    out = codes if codes.dtype == dtype else codes.to(dtype)
    return out if scale == 1.0 else out * scale


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """One-byte caches through uint8 (torch's CPU index_copy_ has no float8 kernel); the same
    tensor otherwise."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def index_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t.index_select(0, index)`, through bytes for a one-byte cache (float8 index kernels are
    missing on some devices and torch versions)."""
    if t.element_size() != 1 or t.dtype == torch.uint8:
        return t.index_select(0, index)
    return t.view(torch.uint8).index_select(0, index).view(t.dtype)
