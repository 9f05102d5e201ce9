"""Rotary position embeddings: inverse frequencies (default, llama3, YaRN), cos/sin tables, and the
rotation itself (half-split layout). Pure functions of tensors; the models own their tables.

Interleaved-pair checkpoints (DeepSeek's `rope_interleave`) are handled by the loader, which permutes
the rope rows of the projection weights into the half-split layout once, so only one rotation exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeTables:
    cos: torch.Tensor  # [max_positions, rot_dim // 2], float32, already times attention_factor
    sin: torch.Tensor
    attention_factor: float  # YaRN's cos/sin magnitude scale (1.0 otherwise)


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    blend in between."""
    inv_freq = default_inv_freq(dim, base)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): interpolate low frequencies by `factor`, keep high ones, ramp between.
    Returns (inv_freq, attention_factor)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    low = math.floor(_yarn_correction_dim(beta_fast, dim, base, old_len))
    high = math.ceil(_yarn_correction_dim(beta_slow, dim, base, old_len))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor") is not None:
        attention_factor = float(scaling["attention_factor"])
    elif mscale and mscale_all:
        attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
    else:
        attention_factor = yarn_get_mscale(factor)
    return inv_freq, attention_factor


def rope_inv_freq(dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Dispatch on `rope_scaling["rope_type"]` (HF naming); returns (inv_freq, attention_factor)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return default_inv_freq(dim, base), 1.0
    if kind == "llama3":
        return llama3_inv_freq(dim, base, scaling), 1.0
    if kind == "yarn":
        return yarn_inv_freq(dim, base, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def build_rope_tables(
    dim: int, base: float, scaling: dict | None, max_positions: int, device: torch.device | str
) -> RopeTables:
    inv_freq, attention_factor = rope_inv_freq(dim, base, scaling)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * attention_factor).to(device)
    sin = (freqs.sin() * attention_factor).to(device)
    return RopeTables(cos=cos, sin=sin, attention_factor=attention_factor)


def rope_at(
    tables: RopeTables, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for one step's tokens, shaped `[T, 1, D // 2]` in `dtype`: built once per forward and
    broadcast over heads in every layer."""
    cos, sin = tables.cos[positions][:, None, :], tables.sin[positions][:, None, :]
    return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[T, H, D]` (half-split layout) by `cos/sin` broadcastable to `[T, H, D // 2]`;
    returns a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` dims of `x[..., D]` as interleaved pairs
    (x0, x1), (x2, x3), ... (DeepSeek-V4's layout, kept as the checkpoint has it because its
    attention output is rotated back and mixed by the output projection); the leading dims pass
    through. `cos/sin` broadcast to `[..., rot_dim // 2]`; computed in float32, returned in x's
    dtype."""
    rot = 2 * cos.shape[-1]
    pairs = x[..., -rot:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rot], rotated.to(x.dtype)], dim=-1)
