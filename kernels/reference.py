"""Torch reference ops: the default CPU/GPU path and the oracle every other KernelSet is tested against.

Only ops whose reduction order matters live in `KERNELS` (linear, norms, softmax, bmm, paged attention);
elementwise ops (SiLU, RoPE) are called directly by the models. Batch-invariant and Triton variants live
in their own modules and implement the same `KernelSet`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.kernels.attention_ref import paged_attention
from deepserve.kernels.registry import KernelSet


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[..., in] @ w[out, in].T"""
    return F.linear(x, w)


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
