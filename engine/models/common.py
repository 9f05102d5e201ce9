"""Pieces shared by the model families: reading HF-style config values, moving weights onto the
model's device/dtype, and the SwiGLU MLP. Family-specific layers live in their own modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.engine.errors import UnsupportedModelError
from deepserve.kernels.block_quant import Fp8Weight, Matrix, Mxfp4Weight, cat_rows
from deepserve.kernels.kernel_set import KernelSet
from deepserve.kernels.quant_panels import QuantizedMatrix, concat

# HF names -> tensors; FP8 / MXFP4 weights as stored where the loader keeps them for the kernels
Weights = dict[str, torch.Tensor | Fp8Weight | Mxfp4Weight]


class WeightStore:
    """Hands out checkpoint tensors (HF names) on the target device/dtype, and reports what is missing
    or left over so a mismatched checkpoint fails loudly instead of running with garbage."""

    def __init__(
        self,
        weights: Weights,
        device: torch.device,
        dtype: torch.dtype,
        quantized: dict[str, QuantizedMatrix] | None = None,
    ) -> None:
        self._weights = weights
        self._quantized = quantized or {}
        self._used: set[str] = set()
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self._weights

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor; a weight kept quantized (FP8 / MXFP4) is dequantized on the device
        (e.g. MLA's kv_b, whose absorbed halves W_UK / W_UV run as bf16 bmm's)."""
        w = self._fetch(name)
        if isinstance(w, torch.Tensor):
            return w.to(device=self.device, dtype=dtype or self.dtype).contiguous()
        return w.to(self.device).dequantize(dtype or self.dtype)

    def get_linear(self, name: str) -> Matrix:
        """A matmul weight as the KernelSet's `linear` / `moe` take it: kept quantized on the
        device when the checkpoint stores it so and the set runs it (the loader keeps it only
        then), else as `get` gives it."""
        w = self._fetch(name)
        return self.get(name) if isinstance(w, torch.Tensor) else w.to(self.device)

    def cat_linear(self, names: list[str]) -> Matrix:
        """`cat` of matmul weights, FP8 where the parts' scale blocks allow (`cat_rows`)."""
        return cat_rows([self.get_linear(n) for n in names], self.dtype)

    def _fetch(self, name: str) -> torch.Tensor | Fp8Weight | Mxfp4Weight:
        if name not in self._weights:
            raise UnsupportedModelError(f"checkpoint is missing tensor {name!r}")
        self._used.add(name)
        return self._weights[name]

    def cat(self, names: list[str], dim: int = 0) -> torch.Tensor:
        """Several tensors fused along `dim` (e.g. q/k/v into one projection: one matmul, not three)."""
        return torch.cat([self.get(n) for n in names], dim=dim).contiguous()

    def quantized(self, names: list[str]) -> QuantizedMatrix | None:
        """The checkpoint's own quantized blocks for these tensors stacked along `out` (as `cat`
        stacks them), or None unless every one has blocks in one format."""
        parts = [self._quantized.get(n) for n in names]
        return None if None in parts else concat(parts)

    def unused(self) -> list[str]:
        return sorted(set(self._weights) - self._used)


def require(config: dict, key: str):
    if key not in config or config[key] is None:
        raise UnsupportedModelError(f"model config is missing {key!r}")
    return config[key]


def swiglu(
    k: KernelSet, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2*I, H] weight."""
    gu = k.linear(x, gate_up)
    act = k.silu_mul(gu) if k.silu_mul is not None else None
    if act is None:
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return k.linear(act, down)


def add_rms_norm(
    k: KernelSet, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: `(h + delta, rms_norm(h + delta))`. A KernelSet with
    a fused op does both in one pass and updates `h` in place (callers own their residual
    stream); others keep their own rms_norm."""
    if k.add_rms_norm_ is not None:
        normed = k.add_rms_norm_(h, delta, weight, eps)
        if normed is not None:
            return h, normed
    h = h + delta
    return h, k.rms_norm(h, weight, eps)
