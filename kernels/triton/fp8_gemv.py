"""The FP8 weight-streaming kernel for few rows (decode): `y = x @ dequant(w).T` for an
`Fp8Weight` (kernels/block_quant.py) with x NOT quantized (w8a16).

At M = 1..16 a linear is a read of the weight: the work is streaming N x K fp8 bytes (plus the
scales) once at HBM speed, not tensor-core FLOPs. So each program owns BLOCK_N rows of w and walks
a fixed range of K in 128-steps (one weight scale per step and row block), dequantizing the fp8
tile with its scale and multiplying it by x in float32:

- `rows == 1` (GEMV): on CUDA cores, the float32 products of the tile and x's 128 values summed
  per row; no tensor-core padding of one row to sixteen.
- `rows > 1` (skinny): one dot per step of x in its own dtype (bf16 or float32 on the ieee path)
  against the tile widened to that dtype; every e4m3 value is exact in bf16, so the products are
  the dequantized ones exactly and only the float32 accumulation order differs.

Split-K, fixed by the shape: where N's row blocks alone cannot fill the GPU (V2-Lite's 576 and
2,048-row projections), K is cut into `split` runs of whole 128-steps, each program writes its
float32 partial sums to a `[split, M, N]` buffer, and a second small kernel adds the partials in
split order: deterministic run to run, no atomics.

x is not quantized, so a row's result is not the w8a8 GEMM's bits (fp8_matmul.py), and the scheme
changes with the row count (as cuBLAS changes kernels by shape): only the default KernelSet takes
this path. `--batch-invariant` keeps fp8_matmul's one tile scheme at every M. What does not live
here: the dispatch by row count (fp8_matmul.linear_or) and the weight type (block_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels.block_quant import Fp8Weight
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, next_power_of_2, tl

GROUP = 128  # the weights' K block: one scale per row block and K step
FILL_PROGRAMS = 132  # programs of one H200 wave
MAX_ROWS = 64  # the kernel takes up to this many rows of x (the dot path pads to a power of 2)
SUM_BLOCK = 1024  # outputs per program of the partials' sum


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # rows of w per program: a 64 x 128 step reads 8 KiB of fp8
    num_warps: int = 4
    num_stages: int = 4
    # split K until the launch has this many waves of FILL_PROGRAMS (if K allows): a program
    # has one 8 KiB step in flight, so an SM needs several to cover HBM's latency
    waves: int = 4


GEMV = GemvConfig()


def split_k(n: int, k: int, cfg: GemvConfig = GEMV) -> int:
    """K runs per row block: runs of a whole number of 128-steps, short enough that the launch
    reaches `waves` full waves of programs (never more runs than steps). A function of the shape
    alone: fixed per weight."""
    tiles, steps = cdiv(n, cfg.block_n), cdiv(k, GROUP)
    wanted = min(steps, max(1, cdiv(cfg.waves * FILL_PROGRAMS, tiles)))
    return cdiv(steps, steps // wanted)


def steps_per_split(k: int, split: int) -> int:
    return cdiv(cdiv(k, GROUP), split)


@jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, steps_per_split,
    s_xm, s_wn, s_wsn, s_os, s_om,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr, SCALE_N: constexpr,
    EVEN_K: constexpr, IEEE: constexpr,
):  # fmt: skip
    """out[split, m, n]: the partial sums of split `program_id(1)`'s K steps (with one split,
    `out` is y itself, in its dtype)."""
    pn = tl.program_id(0)
    split = tl.program_id(1)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.minimum(rn, N - 1)  # rows past N repeat a real one (never stored): no row mask
    rk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + rb[:, None].to(tl.int64) * s_wn  # [BLOCK_N, BLOCK_K] tiles, K contiguous
    w_scale = ws_ptr + (rb // SCALE_N) * s_wsn
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kb in range(first, last):
            kk = kb * BLOCK_K + rk
            if EVEN_K:
                w = tl.load(w_base + kk[None, :])
                x = tl.load(x_ptr + kk)
            else:
                w = tl.load(w_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
                x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            acc += part * tl.load(w_scale + kb)
        tl.store(out_ptr + split * s_os + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        rm = tl.arange(0, BLOCK_M)
        x_base = x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * s_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(first, last):
            kk = kb * BLOCK_K + rk
            if EVEN_K:
                w = tl.load(w_base + kk[None, :])
                x = tl.load(x_base + kk[None, :])
            else:
                w = tl.load(w_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
                x = tl.load(x_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
            wt = tl.trans(w.to(x.dtype))  # e4m3 -> bf16 / float32: exact
            if IEEE:
                d = tl.dot(x, wt, input_precision="ieee", out_dtype=tl.float32)
            else:
                d = tl.dot(x, wt, out_dtype=tl.float32)
            acc += d * tl.load(w_scale + kb)[None, :]
        keep = (rm[:, None] < M) & (rn[None, :] < N)
        ptrs = out_ptr + split * s_os + rm[:, None] * s_om + rn[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)


@jit
def _sum_splits_kernel(p_ptr, y_ptr, total, SPLIT: constexpr, BLOCK: constexpr):
    """y = sum of the SPLIT partials `p[s]` (each `total` long), added in split order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * total + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


def supports(x_rows: int, w: Fp8Weight) -> bool:
    """Whether this kernel takes `x_rows` rows against `w`: a 2-D weight of 128-wide K blocks."""
    return 0 < x_rows <= MAX_ROWS and w.data.dim() == 2 and w.block[1] == GROUP


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, cfg: GemvConfig = GEMV) -> torch.Tensor:
    """x[..., K] (at most MAX_ROWS rows) @ dequant(w)[N, K].T in x's dtype, x as it is."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.data.shape[0]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:  # the kernel reads rows of unit stride
        flat = flat.contiguous()
    m = flat.shape[0]
    assert m <= MAX_ROWS, "fp8_gemv takes decode-sized calls (fp8_matmul.linear_or sends them)"
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    split = split_k(n, k, cfg)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (cdiv(n, cfg.block_n), split)
    _fp8_gemv_kernel[grid](
        flat, w.data, w.scale, out, m, n, k, steps_per_split(k, split),
        flat.stride(0), w.data.stride(0), w.scale.stride(0), m * n, n,
        BLOCK_M=1 if m == 1 else max(16, next_power_of_2(m)), BLOCK_N=cfg.block_n,
        BLOCK_K=GROUP, SCALE_N=w.block[0], EVEN_K=k % GROUP == 0,
        IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        total = m * n
        _sum_splits_kernel[(cdiv(total, SUM_BLOCK),)](out, y, total, SPLIT=split, BLOCK=SUM_BLOCK)
    return y.reshape(*lead, n)
