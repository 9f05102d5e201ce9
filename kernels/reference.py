"""Torch reference ops: the default CPU/GPU path and the oracle every other KernelSet is tested against.

Only ops whose reduction order matters live in `KERNELS` (linear, norms, softmax, bmm, paged attention);
elementwise ops (SiLU, RoPE) are called directly by the models. Batch-invariant and Triton variants live
in their own modules and implement the same `KernelSet`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels import cpu_ops
from deepserve.kernels.registry import KernelSet


@dataclass(frozen=True)
class PackedWeight:
    """A CPU linear weight `[out, in]` kept in the two layouts that win on an AVX2 machine (more
    memory than the plain weight). Measured over SmolLM2's 121 matmuls streamed from DRAM:
    float32, one row 32 ms through a transposed copy vs 39-40 ms through F.linear or oneDNN's
    packed layout, 2-3 rows 50 ms packed vs 54-68 ms (transposed) and 73-91 ms (F.linear);
    bfloat16 (no native bf16 GEMM without AVX-512), one row 36 ms through the bf16 weight itself,
    16 rows 109 ms through a float32 packed copy vs 489 ms for the bf16 GEMM."""

    one_row: torch.Tensor  # `[in, out]` (maybe a transposed view) for `x @ one_row`, in x's dtype
    packed: torch.Tensor  # oneDNN's blocked float32 layout (opaque): two rows and up


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x[..., in] @ w[out, in].T; `w` may come from `pack_linear_weight`."""
    if not isinstance(w, PackedWeight):
        return F.linear(x, w)
    if x.numel() == x.shape[-1]:
        return torch.matmul(x, w.one_row)
    # bfloat16 rows widen exactly to float32 and round once at the end, like a bf16 GEMM that
    # accumulates in float32.
    xf = x.contiguous() if x.dtype == torch.float32 else x.float()
    y = torch.ops.mkldnn._linear_pointwise(xf, w.packed, None, "none", [], "")
    return y if y.dtype == x.dtype else y.to(x.dtype)


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor | PackedWeight:
    """`w` as a `PackedWeight` where that applies (a CPU with oneDNN; float32, or bfloat16 on a CPU
    without AVX-512, where oneDNN has no bf16 GEMM to pack for), else `w` itself."""
    usable = w.device.type == "cpu" and w.dim() == 2 and torch.backends.mkldnn.is_available()
    if not usable or w.dtype not in (torch.float32, torch.bfloat16):
        return w
    if w.dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return w
    packed = torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), None)
    one_row = w.t().contiguous() if w.dtype == torch.float32 else w.t()
    return PackedWeight(one_row=one_row, packed=packed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32. Lower precisions cast back before the weight, as the HF models do; in
    float32 torch's fused op gives the same values in one call, the native CPU kernel in one pass
    (within an ulp or two: another summation order)."""
    native = cpu_ops.rms_norm(x, weight, eps)
    if native is not None:
        return native
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
    paged_attention=cpu_ops.paged_attention,
)
