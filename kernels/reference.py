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
    """x[..., in] @ w[out, in].T; `w` may be a weight packed by `pack_linear_weight`."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
    return F.linear(x, w)


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight `[out, in]` in oneDNN's pre-packed layout (an opaque tensor only
    `linear` above can use), or `w` itself where packing does not apply. On this AVX2 machine the
    packed GEMMs were 20-30% faster than F.linear's MKL path for 4-32 rows and even at 1 row
    (benchmarks/RESULTS.md, engine section). oneDNN packs bfloat16 only with AVX-512/AVX-NE."""
    usable = (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and torch.backends.mkldnn.is_available()
    )
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None) if usable else w


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
