"""Matmul with one fixed tile configuration: `linear` (x @ w.T) and `bmm`.

Why it is batch-invariant: the tile sizes never depend on M, K is never split across programs, and
each output tile accumulates its K blocks in order from 0, so an output row gets the same sequence of
tensor-core instructions whatever the number of rows (the row count only changes how many tiles
exist). The kernel can walk tiles `pid, pid + P, ...` (persistent, P programs); the engine launches
one program per tile (P = tiles), which gives the same bits (a tile's instructions do not depend on
the program that runs it) and was 1.6x faster at 2,048 rows on the H200 (benchmarks/RESULTS.md).
Nothing that varies with M is a compile-time constant (`M`, `BATCH` and `NUM_PROGRAMS` are not
specialised on), so a new row count never triggers a compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels.triton.lang import cdiv, constexpr, jit, tl


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. The engine uses DEFAULT for every shape; others exist to be timed."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # tiles of group_m row-blocks share their B columns in L2
    num_warps: int = 4
    num_stages: int = 3


DEFAULT = TileConfig()


@jit(do_not_specialize=["M", "BATCH", "NUM_PROGRAMS", "s_ab", "s_cb"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, BATCH,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, NUM_PROGRAMS,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr,
    GROUP_M: constexpr, PRECISION: constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_batch = tiles_m * tiles_n
    for tile in tl.range(pid, per_batch * BATCH, NUM_PROGRAMS):
        batch = tile // per_batch
        t = tile % per_batch
        in_group = GROUP_M * tiles_n
        first_m = (t // in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pm = first_m + (t % in_group) % group_rows
        pn = (t % in_group) // group_rows
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_base = a_ptr + batch * s_ab
        b_base = b_ptr + batch * s_bb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ka = k0 + rk
            a = tl.load(
                a_base + rm[:, None] * s_am + ka[None, :] * s_ak,
                mask=(rm[:, None] < M) & (ka[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                b_base + ka[:, None] * s_bk + rn[None, :] * s_bn,
                mask=(ka[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        c = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: TileConfig = DEFAULT
) -> torch.Tensor:
    """c[B, M, N] = a[B, M, K] @ b[B, K, N], any strides."""
    batch, m, k = a.shape
    n = b.shape[2]
    if m == 0 or n == 0:
        return c
    tiles = batch * cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    programs = tiles
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _matmul_kernel[(programs,)](
        a, b, c, m, n, k, batch,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2), programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PRECISION=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def linear(x: torch.Tensor, w: torch.Tensor, cfg: TileConfig = DEFAULT) -> torch.Tensor:
    """x[..., in] @ w[out, in].T"""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    if w.dtype != flat.dtype:
        flat = flat.to(w.dtype)
    out = torch.empty(flat.shape[0], w.shape[0], device=x.device, dtype=w.dtype)
    _launch(flat[None], w.t()[None], out[None], cfg)
    return out.reshape(*lead, w.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b) for a [..., M, K] and b [..., K, N] (leading dims broadcast)."""
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.empty(a3.shape[0], a3.shape[1], b3.shape[2], device=a.device, dtype=a.dtype)
    _launch(a3, b3, out)
    return out.reshape(*lead, a.shape[-2], b.shape[-1])
