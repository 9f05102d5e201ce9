"""GQA attention's per-token elementwise work in one launch: the rope rotation of the q and k
heads of a fused `[q | k | v]` projection, in place, and the k and v heads' cache write
(`rope_qk_write_kv_`, the contract of kernels/cpu/ops.py). Composed from torch ops this is about
nine launches per layer (two slices, four multiplies, a subtract, an add, a concatenation and two
index copies), which is most of a small model's decode step at batch 1.

Every product and sum is rounded to the tensor's dtype as torch's elementwise ops round them
(and launched without FMA contraction), so the values are bitwise torch's `apply_rope` +
`write_kv`. One program per token, nothing reduced: batch invariant.

`rope_interleaved`: DeepSeek-V4's interleaved-pair rotation of the trailing dims
(kernels/rope.py's `apply_rope_interleaved`, about twelve launches composed) in one, bitwise
the same; one program per (token, head).
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.kv_codes import narrow_kv
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl


@jit
def _rope_qk_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, s_qkv, s_cos, block_size,
    sk_block, sk_row, sk_head, sv_block, sv_row, sv_head, HQ, HKV,
    BLOCK_H: constexpr, HALF: constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    dt = qkv_ptr.dtype.element_ty
    row = qkv_ptr + t * s_qkv
    rotated = hh < HQ + HKV
    f32 = tl.float32
    x1 = tl.load(row + hh * (2 * HALF) + d, mask=rotated, other=0.0).to(f32)
    x2 = tl.load(row + hh * (2 * HALF) + HALF + d, mask=rotated, other=0.0).to(f32)
    c = tl.load(cos_ptr + t * s_cos + d).to(dt).to(f32)
    s = tl.load(sin_ptr + t * s_cos + d).to(dt).to(f32)
    # torch computes each op in float32 and rounds it to the dtype: so do we
    y1 = ((x1 * c).to(dt).to(f32) - (x2 * s).to(dt).to(f32)).to(dt)
    y2 = ((x2 * c).to(dt).to(f32) + (x1 * s).to(dt).to(f32)).to(dt)
    tl.store(row + hh * (2 * HALF) + d, y1, mask=rotated)
    tl.store(row + hh * (2 * HALF) + HALF + d, y2, mask=rotated)
    slot = tl.load(slot_ptr + t)
    block, offset = slot // block_size, slot % block_size
    kh = hh - HQ
    is_k = (kh >= 0) & rotated
    k_dst = k_ptr + block * sk_block + offset * sk_row + kh * sk_head + d
    tl.store(k_dst, narrow_kv(y1, k_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, narrow_kv(y2, k_ptr.dtype.element_ty), mask=is_k)
    vh = tl.arange(0, BLOCK_H)[:, None]
    is_v = vh < HKV
    v_src = row + (HQ + HKV + vh) * (2 * HALF) + d
    v_dst = v_ptr + block * sv_block + offset * sv_row + vh * sv_head + d
    v_dt = v_ptr.dtype.element_ty
    tl.store(v_dst, narrow_kv(tl.load(v_src, mask=is_v), v_dt), mask=is_v)
    tl.store(v_dst + HALF, narrow_kv(tl.load(v_src + HALF, mask=is_v), v_dt), mask=is_v)


def rope_qk_write_kv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> bool:
    """Rotate the q and k heads of `qkv [T, (Hq + 2 Hkv) * D]` in place (cos/sin `[T, 1, D/2]`,
    kernels/rope.py's `rope_at`) and store k and v at `slot_mapping` in the caches
    `[blocks, block_size, Hkv, D]` (strided views); False, nothing done, for other layouts."""
    tokens, width = qkv.shape
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    half = dim // 2
    usable = (
        dim % 2 == 0 and half == next_power_of_2(half) and qkv.stride(1) == 1
        and width == (num_heads + 2 * hkv) * dim and cos.shape[-1] == half
        and cos.stride(-1) == 1 and cos.stride() == sin.stride()
        and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and v_cache.shape == k_cache.shape
    )  # fmt: skip
    if not usable:
        return False
    if tokens:
        _rope_qk_write_kv_kernel[(tokens,)](
            qkv, cos, sin, k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0),
            k_cache.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3], num_heads, hkv,
            BLOCK_H=next_power_of_2(num_heads + hkv), HALF=half, num_warps=1,
            enable_fp_fusion=False,
        )  # fmt: skip
    return True


@jit
def _rope_interleaved_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, H, s_xn, s_xh, s_cn, s_sn, s_yn, s_yh,
    PASS: constexpr, PASS_P2: constexpr, HALF: constexpr, HALF_P2: constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    n, h = (r // H).to(tl.int64), (r % H).to(tl.int64)
    x_row, y_row = x_ptr + n * s_xn + h * s_xh, y_ptr + n * s_yn + h * s_yh
    p = tl.arange(0, PASS_P2)
    tl.store(y_row + p, tl.load(x_row + p, mask=p < PASS), mask=p < PASS)
    k = tl.arange(0, HALF_P2)
    valid = k < HALF
    f32 = tl.float32
    a = tl.load(x_row + PASS + 2 * k, mask=valid, other=0.0).to(f32)
    b = tl.load(x_row + PASS + 2 * k + 1, mask=valid, other=0.0).to(f32)
    c = tl.load(cos_ptr + n * s_cn + k, mask=valid, other=0.0).to(f32)
    s = tl.load(sin_ptr + n * s_sn + k, mask=valid, other=0.0).to(f32)
    dt = y_ptr.dtype.element_ty
    tl.store(y_row + PASS + 2 * k, (a * c - b * s).to(dt), mask=valid)
    tl.store(y_row + PASS + 2 * k + 1, (b * c + a * s).to(dt), mask=valid)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """kernels/rope.py's `apply_rope_interleaved` in one launch for `x [N, H, D]` and cos/sin
    `[N, 1, rot / 2]` (DeepSeek-V4's layout): a new tensor, the rotation in float32 with each
    product and sum rounded as torch's ops round them (no FMA contraction), so the values are
    bitwise the composition's; None for other layouts."""
    half = cos.shape[-1]
    usable = (
        x.dim() == 3 and cos.dim() == 3 and cos.shape == sin.shape
        and cos.shape[:2] == (x.shape[0], 1) and 2 * half <= x.shape[2]
        and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    )  # fmt: skip
    if not usable:
        return None
    n, h, d = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        passed = d - 2 * half
        _rope_interleaved_kernel[(n * h,)](
            x, cos, sin, y, h, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            y.stride(0), y.stride(1), PASS=passed, PASS_P2=next_power_of_2(max(passed, 1)),
            HALF=half, HALF_P2=next_power_of_2(half), num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return y
