"""Block-quantized weights as the GPU kernels take them, and their dequantization in plain torch
(the oracle, and the fallback of a KernelSet that cannot run them).

- `Fp8Weight`: float8_e4m3fn values `[..., N, K]` and float32 scales `[..., ceil(N/bn),
  ceil(K/bk)]` (DeepSeek-V3's `weight_scale_inv`; V4's UE8M0 bytes read as float32 powers of two),
  `W = values * scale` over each (bn, bk) block, the edge blocks cut to the matrix.
- `Mxfp4Weight`: e2m1 codes packed two per byte along K (low nibble first), uint8 `[..., N, K/2]`,
  and one scale per 32 inputs `[..., N, K/32]`: E8M0 bytes as stored (2^(byte - 127)), or float32.

A leading expert dim `[E, ...]` makes one MoE layer's stacked experts. What does not live here:
reading checkpoints (engine/loading/quantized.py) and the kernels (kernels/triton/fp8_matmul.py,
kernels/triton/fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MX_BLOCK = 32  # MXFP4: values per scale, along K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; bit 3 the sign
E8M0_DTYPES = tuple(
    d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None
)  # how E8M0 scale bytes arrive: as bytes, or as torch's own e8m0 dtype


@dataclass(frozen=True)
class Fp8Weight:
    data: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32 [..., ceil(N/block[0]), ceil(K/block[1])]
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __getitem__(self, expert: int) -> Fp8Weight:
        return Fp8Weight(self.data[expert], self.scale[expert], self.block)

    def to(self, device: torch.device) -> Fp8Weight:
        data, scale = self.data.to(device).contiguous(), self.scale.to(device, torch.float32)
        return Fp8Weight(data, scale.contiguous(), self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.data.shape[-2:]
        s = self.scale.float().repeat_interleave(self.block[0], dim=-2)[..., :rows, :]
        s = s.repeat_interleave(self.block[1], dim=-1)[..., :cols]
        return (self.data.float() * s).to(dtype)


@dataclass(frozen=True)
class Mxfp4Weight:
    data: torch.Tensor  # uint8 [..., N, K/2], two e2m1 codes a byte, the low nibble first
    scale: torch.Tensor  # uint8 E8M0 or float32 [..., N, K/32]
    # E8M0 scales all at most 2^1 (bytes <= 128; a group of weights past 12 in size would need
    # more): the GPU decode may then fold its renormalisation into the scale (kernels/triton/
    # fused_moe.py `E2M1_BF16_PTX_FOLDED`). Found from `scale` when not given (a device sync).
    small_scales: bool | None = None

    def __post_init__(self) -> None:
        if self.small_scales is None:
            small = self.scale.dtype in E8M0_DTYPES and bool(
                (self.scale.view(torch.uint8) <= 128).all()
            )
            object.__setattr__(self, "small_scales", small)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def __getitem__(self, expert: int) -> Mxfp4Weight:
        return Mxfp4Weight(self.data[expert], self.scale[expert], self.small_scales)

    def to(self, device: torch.device) -> Mxfp4Weight:
        data, scale = self.data.to(device).contiguous(), self.scale.to(device).contiguous()
        return Mxfp4Weight(data, scale, self.small_scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        u8 = self.data.view(torch.uint8)
        codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2).long()
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=u8.device)
        values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        scale = self.scale
        scale = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
        return (values * scale.repeat_interleave(MX_BLOCK, dim=-1)).to(dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8Weight:
    """`w` [..., N, K] as e4m3 with one float32 scale per block (amax / 448): the tests' and the
    GPU checks' way to make FP8 weights, the layout DeepSeek publishes."""
    rows, cols = w.shape[-2:]
    nb, kb = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(*w.shape[:-2], nb * block[0], kb * block[1], device=w.device)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.unflatten(-1, (kb, block[1])).unflatten(-3, (nb, block[0]))
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    data = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return Fp8Weight(data.contiguous(), scale.contiguous(), block)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """`w` [..., N, K] (K a multiple of 32) as MXFP4 with E8M0 bytes: each group of 32 scaled by
    the power of two that brings its amax to at most 6, then rounded to the nearest e2m1 value."""
    groups = w.float().unflatten(-1, (-1, MX_BLOCK))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)).flatten(-2)
    table = torch.tensor(E2M1_VALUES, device=w.device)
    mag = (scaled.abs()[..., None] - table).abs().argmin(-1)
    codes = (mag | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Mxfp4Weight(packed.contiguous(), (exponent[..., 0] + 127).to(torch.uint8))


Matrix = torch.Tensor | Fp8Weight | Mxfp4Weight


def reorder_rows(w: Matrix, order: torch.Tensor, dtype: torch.dtype) -> Matrix:
    """`w[order]` along N; an `Fp8Weight` stays FP8 when every row stays inside its scale
    block (the rope rows' reordering of MLA's projections), else it is dequantized to `dtype`."""
    if isinstance(w, torch.Tensor):
        return w[order.to(w.device)]
    rows = torch.arange(len(order))
    if isinstance(w, Fp8Weight) and torch.equal(order // w.block[0], rows // w.block[0]):
        return replace(w, data=w.data[order.to(w.data.device)])
    return w.dequantize(dtype)[order.to(w.data.device)]


def cat_rows(parts: list[Matrix], dtype: torch.dtype) -> Matrix:
    """Matrices stacked along N (fused projections): FP8 when all are FP8 of one block and each
    but the last fills whole scale blocks; MXFP4 when all are MXFP4 with one scale dtype (its
    scales are per row, so any rows stack); else plain `dtype`."""
    fp8 = all(isinstance(p, Fp8Weight) and p.block == parts[0].block for p in parts)
    if fp8 and all(p.shape[-2] % p.block[0] == 0 for p in parts[:-1]):
        data = torch.cat([p.data for p in parts], dim=-2)
        return Fp8Weight(data, torch.cat([p.scale for p in parts], dim=-2), parts[0].block)
    scale_dtype = getattr(parts[0], "scale", parts[0]).dtype
    if all(isinstance(p, Mxfp4Weight) and p.scale.dtype == scale_dtype for p in parts):
        data = torch.cat([p.data for p in parts], dim=-2)
        scale = torch.cat([p.scale for p in parts], dim=-2)
        return Mxfp4Weight(data, scale, all(p.small_scales for p in parts))
    return torch.cat([_plain(p, dtype) for p in parts], dim=-2)


def stack(parts: list[Matrix], dtype: torch.dtype) -> Matrix:
    """One expert dim in front: a quantized stack when all parts share one format and block."""
    first = parts[0]
    same = all(type(p) is type(first) for p in parts) and not isinstance(first, torch.Tensor)
    if same and all(getattr(p, "block", None) == getattr(first, "block", None) for p in parts):
        data, scale = torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts])
        if isinstance(first, Mxfp4Weight):
            return Mxfp4Weight(data, scale, all(p.small_scales for p in parts))
        return replace(first, data=data, scale=scale)
    return torch.stack([_plain(p, dtype) for p in parts])


def _plain(w: Matrix, dtype: torch.dtype) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def linear(x: torch.Tensor, w: Fp8Weight | Mxfp4Weight) -> torch.Tensor:
    """x @ dequant(w).T in x's dtype: the fallback for a set whose kernels take plain weights."""
    return torch.nn.functional.linear(x, w.dequantize(x.dtype))
