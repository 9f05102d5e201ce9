"""Torch reference ops: the default CPU/GPU path and the oracle every other KernelSet is tested against.

Only ops whose reduction order matters live in `KERNELS` (linear, norms, softmax, bmm, paged attention);
elementwise ops (SiLU, RoPE) are called directly by the models. Batch-invariant and Triton variants live
in their own modules and implement the same `KernelSet`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels.attention_ref import paged_attention
from deepserve.kernels.registry import KernelSet


@dataclass(frozen=True)
class PackedWeight:
    """A float32 CPU linear weight `[out, in]` kept in the two layouts that win on this AVX2 machine
    (twice the memory of the plain weight): measured over SmolLM2's 121 matmuls streamed from
    DRAM, one row took 32 ms through `transposed` vs 39-40 ms through F.linear or `packed`, and 2-3
    rows 50 ms through `packed` vs 54-68 ms (transposed) and 73-91 ms (F.linear)."""

    transposed: torch.Tensor  # [in, out], contiguous: the fastest one-row GEMV
    packed: torch.Tensor  # oneDNN's blocked layout (opaque): fastest from two rows up


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x[..., in] @ w[out, in].T; `w` may come from `pack_linear_weight`."""
    if not isinstance(w, PackedWeight):
        return F.linear(x, w)
    if x.numel() == x.shape[-1]:
        return torch.matmul(x, w.transposed)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, None, "none", [], "")


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor | PackedWeight:
    """`w` as a `PackedWeight` where that applies (float32 on a CPU with oneDNN), else `w` itself.
    oneDNN packs bfloat16 only with AVX-512 or AVX-NE-CONVERT, which this machine lacks."""
    usable = (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and torch.backends.mkldnn.is_available()
    )
    if not usable:
        return w
    packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
    return PackedWeight(transposed=w.t().contiguous(), packed=packed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32. Lower precisions cast back before the weight, as the HF models do; in
    float32 torch's fused op gives the same values in one call."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x if x.dtype == torch.float32 else x.float(), dim=dim)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x if x.dtype == torch.float32 else x.float(), dim=dim)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


KERNELS = KernelSet(
    name="reference",
    linear=linear,
    rms_norm=rms_norm,
    softmax=softmax,
    log_softmax=log_softmax,
    bmm=bmm,
    paged_attention=paged_attention,
)
