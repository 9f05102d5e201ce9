"""MLA's per-token elementwise work in single launches: the latent's RMSNorm, the rope key's
rotation and the cache write in one program per token (`kv_write_`), and the query's rope part
rotated straight into its slot of the absorbed query (`rope_into_`; `absorbed_query_` also copies
the latent part in). Without them these are about sixteen small torch launches per layer, which is
what a decode step of one sequence waits on.

Rows are independent and reduced in a fixed order, so both are batch invariant. Each returns
False (nothing written) for shapes it does not take; the model then composes the torch ops.
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.kv_codes import narrow_kv
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl


@jit
def _kv_write_kernel(
    ckv_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, s_ckv, s_cos, s_row, eps,
    LORA: constexpr, HALF: constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, LORA)
    x = tl.load(ckv_ptr + t * s_ckv + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / LORA + eps)
    # cast back to the model's dtype before the weight, as the reference (and HF) do
    y = (x * rstd).to(ckv_ptr.dtype.element_ty).to(tl.float32)
    latent = tl.load(w_ptr + d).to(tl.float32) * y
    dst = cache_ptr + tl.load(slot_ptr + t) * s_row
    tl.store(dst + d, narrow_kv(latent, cache_ptr.dtype.element_ty))
    h = tl.arange(0, HALF)
    x1 = tl.load(ckv_ptr + t * s_ckv + LORA + h).to(tl.float32)
    x2 = tl.load(ckv_ptr + t * s_ckv + LORA + HALF + h).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + h).to(tl.float32)
    s = tl.load(sin_ptr + t * s_cos + h).to(tl.float32)
    tl.store(dst + LORA + h, narrow_kv(x1 * c - x2 * s, cache_ptr.dtype.element_ty))
    tl.store(dst + LORA + HALF + h, narrow_kv(x2 * c + x1 * s, cache_ptr.dtype.element_ty))


@jit
def _rope_into_kernel(
    src_ptr, dst_ptr, cos_ptr, sin_ptr, s_st, s_sh, s_dt, s_dh, s_cos, H,
    BLOCK_H: constexpr, HALF: constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = hh < H
    src = src_ptr + t * s_st + hh * s_sh + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + d).to(tl.float32)
    s = tl.load(sin_ptr + t * s_cos + d).to(tl.float32)
    dst = dst_ptr + t * s_dt + hh * s_dh + d
    tl.store(dst, (x1 * c - x2 * s).to(dst_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(dst_ptr.dtype.element_ty), mask=ok)


@jit
def _absorbed_query_kernel(
    lat_ptr, src_ptr, cos_ptr, sin_ptr, out_ptr, s_lt, s_lh, s_st, s_sh, s_ot, s_oh, s_cos,
    LORA: constexpr, HALF: constexpr,
):  # fmt: skip
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    out = out_ptr + t * s_ot + h * s_oh
    d = tl.arange(0, LORA)
    tl.store(out + d, tl.load(lat_ptr + t * s_lt + h * s_lh + d).to(dt))
    r = tl.arange(0, HALF)
    src = src_ptr + t * s_st + h * s_sh + r
    x1 = tl.load(src).to(tl.float32)
    x2 = tl.load(src + HALF).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + r).to(tl.float32)
    s = tl.load(sin_ptr + t * s_cos + r).to(tl.float32)
    tl.store(out + LORA + r, (x1 * c - x2 * s).to(dt))
    tl.store(out + LORA + HALF + r, (x2 * c + x1 * s).to(dt))


def _pow2(n: int) -> bool:
    return n > 0 and n == next_power_of_2(n)


def kv_write_(
    ckv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """`cache[slot] = [rms_norm(ckv[:, :lora]) | rope(ckv[:, lora:])]` for every token.
    ckv `[T, lora + rope]`; cos/sin `[T, 1, rope // 2]` (kernels/rope.py's `rope_at`); cache
    `[num_blocks, block_size, lora + rope]`, e4m3 (scale 1: a scale is divided out by the
    model's unfused write) or ckv's dtype."""
    lora = norm_weight.shape[0]
    half = (ckv.shape[1] - lora) // 2
    row = cache.shape[-1]
    usable = (
        _pow2(lora) and _pow2(half) and ckv.stride(1) == 1 and cache.is_contiguous()
        and row == lora + 2 * half and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    )  # fmt: skip
    if not usable:
        return False
    if ckv.shape[0]:
        _kv_write_kernel[(ckv.shape[0],)](
            ckv, norm_weight, cos, sin, cache, slot_mapping, ckv.stride(0), cos.stride(0), row,
            eps, LORA=lora, HALF=half, num_warps=4,
        )  # fmt: skip
    return True


def rope_into_(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst `[T, H, D]` = the half-split rotation of src `[T, H, D]` (both may be strided views)."""
    tokens, heads, dim = src.shape
    usable = (
        _pow2(dim // 2) and dim % 2 == 0 and src.stride(2) == 1 and dst.stride(2) == 1
        and dst.shape == src.shape and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    )  # fmt: skip
    if not usable:
        return False
    if tokens:
        _rope_into_kernel[(tokens,)](
            src, dst, cos, sin, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            cos.stride(0), heads, BLOCK_H=next_power_of_2(heads), HALF=dim // 2, num_warps=4,
        )  # fmt: skip
    return True


def absorbed_query_(
    latent: torch.Tensor,
    src: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """`out [T, H, lora + rope] = [latent | rope(src)]` in one launch: the absorbed query from
    the no-rope part mapped into latent space (`latent [T, H, lora]`, the bmm's output, strided)
    and the query's rope part (`src [T, H, rope]`), the values of `rope_into_` plus a copy."""
    tokens, heads, lora = latent.shape
    dim = src.shape[-1]
    usable = (
        _pow2(lora) and _pow2(dim // 2) and dim % 2 == 0 and latent.stride(2) == 1
        and src.stride(2) == 1 and out.stride(2) == 1 and src.shape[:2] == latent.shape[:2]
        and out.shape == (tokens, heads, lora + dim)
        and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    )  # fmt: skip
    if not usable:
        return False
    if tokens:
        _absorbed_query_kernel[(tokens, heads)](
            latent, src, cos, sin, out, latent.stride(0), latent.stride(1), src.stride(0),
            src.stride(1), out.stride(0), out.stride(1), cos.stride(0), LORA=lora,
            HALF=dim // 2, num_warps=4,
        )  # fmt: skip
    return True
