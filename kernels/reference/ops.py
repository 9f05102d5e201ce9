"""The reference ops in torch: the oracle every other backend is tested against, and the set
(`deepserve.kernels.reference.KERNELS`) on a device no other backend covers.

Only ops whose reduction order matters, and the sampler's argmax, live here (linear, norms,
softmax, bmm, argmax); paged attention is in attention.py, MoE routing in moe_routing.py.
Nothing here imports a native or Triton module: the native CPU ops (kernels/cpu/) and the
Triton ops (kernels/triton/) are separate backends, picked by kernels/registry.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`: the first maximum, NaN counting as the maximum."""
    return x.argmax(dim=-1)
