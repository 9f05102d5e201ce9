"""GGUF block-quantized matrices (Q4_0, Q4_1, Q8_0) regrouped into the native CPU linear's panels
(kernels/cpu/csrc/linear.cpp, `linear_quant`), so a quantized checkpoint stays quantized in memory.

A GGUF row is a run of 32-element blocks: a float16 scale (Q4_1: and a float16 minimum) and the
block's quants. A panel block here is the same 32 k-steps for 16 output columns: their scales as
float32 (Q4_1: then their minimums), then per k-step the 16 columns' quants (4-bit: byte j holds
column j low and column j + 8 high; 8-bit: one signed byte each). The kernel dequantizes exactly,
so it computes with the very float32 values `engine/gguf_format.dequantize` gives.

What does not live here: reading GGUF files (engine/gguf_format.py), deciding when a model uses
these panels (kernels/cpu/packed.py's `pack_linear_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 16  # output columns per panel, as kernels/cpu/csrc/linear.cpp
BLOCK = 32  # k-steps per quant block, as GGUF
FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # GGUF type name -> linear.cpp's QuantFormat
_ROW_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # one GGUF block of 32 elements


@dataclass(frozen=True)
class QuantizedMatrix:
    """A `[out, in]` matrix as its GGUF blocks: `rows` is `[out, in / 32 * block bytes]` uint8."""

    format: str  # a key of FORMATS
    rows: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]


def concat(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
    """Matrices stacked along `out` (fused q/k/v, gate/up), or None when their formats or widths
    differ."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        return None
    return QuantizedMatrix(first.format, torch.cat([p.rows for p in parts]), first.in_features)


def pack_quant_panels(m: QuantizedMatrix) -> torch.Tensor:
    """`m` as the kernel's `[ceil(out / 16), in / 32, block bytes]` uint8 panels; the last panel's
    missing columns have zero scales."""
    blocks = m.in_features // BLOCK
    raw = m.rows.reshape(m.out_features, blocks, _ROW_BLOCK_BYTES[m.format])
    panels = -(-m.out_features // PANEL)
    padded = torch.zeros(panels * PANEL, blocks, raw.shape[-1], dtype=torch.uint8)
    padded[: m.out_features] = raw
    # [P, 16 columns, blocks, bytes] -> [P, blocks, 16 columns, bytes]: a panel block's columns
    # side by side.
    cols = padded.view(panels, PANEL, blocks, -1).transpose(1, 2)
    header = [_f16_as_f32_bytes(cols[..., 0:2])]
    if m.format == "Q4_1":
        header.append(_f16_as_f32_bytes(cols[..., 2:4]))
        quants = _nibbles(cols[..., 4:])
    elif m.format == "Q4_0":
        quants = _nibbles(cols[..., 2:])
    else:
        quants = cols[..., 2:]  # [P, blocks, 16, 32] int8 bytes
    steps = quants.transpose(-1, -2)  # [P, blocks, 32 k-steps, 16 columns]
    if m.format != "Q8_0":
        steps = steps[..., : PANEL // 2] | (steps[..., PANEL // 2 :] << 4)
    body = steps.reshape(panels, blocks, -1)
    return torch.cat([*header, body], dim=-1).contiguous()


def _f16_as_f32_bytes(b: torch.Tensor) -> torch.Tensor:
    """[P, blocks, 16, 2] float16 bytes -> [P, blocks, 64] bytes of the same values as float32."""
    f32 = b.contiguous().view(torch.float16).float()  # [P, blocks, 16, 1]
    return f32.reshape(*b.shape[:2], PANEL).contiguous().view(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] GGUF 4-bit bytes -> [..., 32] quants in element order (low nibbles are elements
    0-15, high ones 16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)
