"""Batch-invariant matmul: `linear` (x @ w.T) and `bmm`, with the reduction fixed by the weight.

Why it is batch-invariant: the K chunks come from the weight's (K, N) and dtype, never from M. An
output element is the sum, in chunk order, of per-chunk partials, each partial a chain of
tensor-core products over its chunk's K in order from the chunk's start:
`out = ((0 + p_0) + p_1) + ... + p_{S-1}`. How many rows, columns and K steps one program covers,
its warps and its pipeline depth do not enter that chain: each element's products are the same
16-deep MMA instructions into one float32 accumulator whatever the tile (mma.sync at 16-32 rows,
wgmma from 64). benchmarks/gpu/tile_bits.py checked that bit for bit on an H100, 16- to 128-row,
32- to 256-column tiles and BLOCK_K 64 / 128 against the weight's own tile at 1 / 17 / 64 /
2,000 rows. So those follow M (`for_rows`) with the chunk length pinned. Two launch modes
compute exactly that sum:
- split: one program per (tile, chunk) writes its partial in float32, and the tile's last
  program to finish (a counter per tile, fp8_gemv.py's) adds the partials in chunk order. Used
  when the tiles alone cannot fill the GPU (decode: few rows), so the weight is streamed by S
  times more programs; no second launch.
- inline: one program per tile walks its chunks in order and adds each partial as it ends.
  Used when there are enough tiles (prefill); no workspace.
The two modes compile apart (the split mode's epilogue would crowd the wide prefill tiles'
registers), from the same K loop: like the tile, the mode (it follows M) cannot change a bit.
Rows past M read row M - 1 again (never stored) and columns past N read column N - 1 (unless
BLOCK_N divides N), so the K loop has no masks when BLOCK_K divides K. Nothing that varies with M is specialised on, so a new row count never triggers a
compile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from deepserve.kernels.triton import fp8_gemv
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, tl

SMEM_BYTES = 200 * 1024  # shared memory a config's pipeline may take (the H200 has 227 KB a block)
FILL_PROGRAMS = 132  # below this many tiles, split mode (one H200 wave)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration; `splits` is the number of K chunks (1: one chain over all K)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # tiles of group_m row-blocks share their B columns in L2
    num_warps: int = 4
    num_stages: int = 4
    splits: int = 1
    chunk_k: int = 0  # > 0: K per chunk pinned (a tile for M keeps the weight's chunks)

    def chunk(self, k: int) -> int:
        """K per chunk: a multiple of block_k, from K alone."""
        return self.chunk_k or cdiv(cdiv(k, self.splits), self.block_k) * self.block_k

    def for_rows(self, m: float, k: int, n: int, tiles: RowTiles | None = None) -> TileConfig:
        """These K chunks of a (K, N) weight with the tile M rows run fastest on (`tiles`, by
        default `ROW_TILES`): its BLOCK_K only where it divides the chunk, its columns only where
        they divide N."""
        kc = self.chunk(k)
        for rows, shape in ROW_TILES if tiles is None else tiles:
            if m > rows:
                continue
            if not shape or n % shape["block_n"]:
                return self
            block_k = shape["block_k"]
            while kc % block_k and block_k > self.block_k:
                block_k //= 2
            return replace(self, **{**shape, "block_k": block_k}, chunk_k=kc)
        return self

    def fitted(self, itemsize: int) -> TileConfig:
        """The same tiles with a pipeline shallow enough for the shared memory at this dtype."""
        stage = (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize
        return replace(self, num_stages=max(2, min(self.num_stages, SMEM_BYTES // stage)))


DEFAULT = TileConfig()

# Tile shapes by row count (`TileConfig.for_rows`): the first bucket whose bound M is within;
# {} keeps the weight's own shape; BLOCK_K halves until it divides the chunk. The fastest of
# tile_bits.py's candidates on V2-Lite's six projections (H100, benchmarks/RESULTS.md "Tiles by
# row count"): 32 x 64 beats the weight's 64 x 128 by 15-35% at 17-32 rows, 64 x 256 by 10-22% at
# 2,000 rows; at 64 rows none wins on every weight. Up to 16 rows: 16 x 32 with 256-deep K steps,
# within 2% of the best tile of each of V2-Lite's decode weights read cold (decode_matmul.py).
RowTiles = tuple[tuple[float, dict], ...]  # (largest M, tile shape) buckets, smallest M first
ROW_TILES: RowTiles = (
    (16, dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)),
    (32, dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (512, {}),
    (float("inf"), dict(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3)),
)
# float32 (the router's gate): `ieee` dots are FMA chains over K in order, so the tile does not
# enter a row's sum (decode_matmul.py `router`: seven tiles, four chunk lengths, all bit-equal at
# 1 and 64 rows with 64 x 64 at 2,000; H100, run-gpu27-1). The weight's own 64 x 64 tile over a
# 64-expert gate is 8 programs a decode step, 27 us a layer; 16 x 16 K64 tiles over 128-deep
# chunks, 6.6 us (cuBLAS 4.4).
FP32_ROW_TILES: RowTiles = (
    (64, dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=3)),
    (float("inf"), {}),
)

# Measured per weight shape (K, N): the weight's own tile (32-512 rows) from
# benchmarks/gpu/kernel_checks.py `tune_matmul` (H200, run 8-2), and the K chunks from
# decode_matmul.py (H100, run-gpu26-1: the chunk whose 16-row tiles read the weight fastest
# cold, where it costs 64 and 2,000 rows under 4%). Shapes not listed take `heuristic`.
_WIDE = TileConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)
TUNED: dict[tuple[int, int], TileConfig] = {
    (2048, 3648): TileConfig(splits=4),  # V2-Lite's x_proj: [q | kv_a] (no q_lora)
    (2048, 2048): replace(_WIDE, splits=4),  # o_proj
    (2048, 5632): TileConfig(splits=2),  # the shared experts' gate_up
    (2816, 2048): replace(_WIDE, splits=4),  # the shared experts' down
    (10944, 2048): TileConfig(splits=11),  # the dense layer's down: 1,024-deep chunks
    (512, 128): TileConfig(),  # the absorbed W_UV per head (bmm): one chunk
    (2048, 64): TileConfig(block_n=64, block_k=64, num_warps=4, num_stages=4, splits=16),  # router
}


def heuristic(k: int, n: int) -> TileConfig:
    """Narrow weights get K chunks so that N tiles x chunks is about one wave of programs."""
    block_n = 64 if n <= 8192 else 128
    tiles_n = cdiv(n, block_n)
    splits = 1
    while tiles_n * splits * 2 <= FILL_PROGRAMS and k // (splits * 2) >= 256:
        splits *= 2
    return TileConfig(block_n=block_n, splits=splits)


def config_for(k: int, n: int, dtype: torch.dtype, rows: int | None = None) -> TileConfig:
    """The configuration of a (K, N) weight: its K chunks a function of the weight alone, never
    of M; with `rows`, the tile shape for that many rows (`TileConfig.for_rows`)."""
    tiles = _row_tiles(dtype)
    bucket = None if rows is None else next(bound for bound, _ in tiles if rows <= bound)
    return _bucket_config(k, n, dtype, bucket)


def _row_tiles(dtype: torch.dtype) -> RowTiles:
    return FP32_ROW_TILES if dtype == torch.float32 else ROW_TILES


@functools.cache
def _bucket_config(k: int, n: int, dtype: torch.dtype, rows: float | None) -> TileConfig:
    """`config_for` per row bucket, built once: every launch asks for one."""
    cfg = TUNED.get((k, n)) or heuristic(k, n)
    if rows is not None:
        cfg = cfg.for_rows(rows, k, n, _row_tiles(dtype))
    return cfg.fitted(dtype.itemsize)


@jit(do_not_specialize=["M", "CHUNKS_PER_PROGRAM", "s_ab", "s_cb", "s_wb", "s_ws", "s_wm"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, count_ptr, M, N, K, KC, CHUNKS_PER_PROGRAM,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_wb, s_ws, s_wm,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr,
    GROUP_M: constexpr, EVEN_K: constexpr, EVEN_N: constexpr, PRECISION: constexpr,
    SPLIT_MODE: constexpr,
):  # fmt: skip
    pid, part, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (pid % in_group) % group_rows
    pn = (pid % in_group) // group_rows
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ra = tl.minimum(rm, M - 1)  # rows past M repeat a real row: no mask in the K loop
    # no clamp when BLOCK_N divides N: loads along N (B's contiguous dim in bmm) stay vectorized
    rb = rn if EVEN_N else tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + batch * s_ab + ra[:, None] * s_am
    b_base = b_ptr + batch * s_bb + rb[None, :] * s_bn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_chunk = part * CHUNKS_PER_PROGRAM
    for c in range(first_chunk, first_chunk + CHUNKS_PER_PROGRAM):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum(c * KC + KC, K)
        for k0 in range(c * KC, k_end, BLOCK_K):
            ka = k0 + rk
            if EVEN_K:
                a = tl.load(a_base + ka[None, :] * s_ak)
                b = tl.load(b_base + ka[:, None] * s_bk)
            else:
                a = tl.load(a_base + ka[None, :] * s_ak, mask=ka[None, :] < K, other=0.0)
                b = tl.load(b_base + ka[:, None] * s_bk, mask=ka[:, None] < K, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        total = total + acc  # chunk partials in chunk order, from 0 (split mode: 0 + p_c)
    keep = (rm[:, None] < M) & (rn[None, :] < N)
    out = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    if SPLIT_MODE:  # the partial
        ws = ws_ptr + batch * s_wb + rm[:, None] * s_wm + rn[None, :]
        tl.store(ws + part * s_ws, total, mask=keep)
        tl.debug_barrier()  # every thread's partial stored before the count releases them
        count = count_ptr + batch * tl.num_programs(0) + pid
        chunks = tl.num_programs(1)
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            # the tile's last program adds the partials in chunk order, from 0, as inline does
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for c in range(0, chunks):
                total = total + tl.load(ws + c * s_ws, mask=keep, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(c_ptr.dtype.element_ty), mask=keep)
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out, total.to(c_ptr.dtype.element_ty), mask=keep)


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cfg: TileConfig,
    split_mode: bool | None = None,
) -> torch.Tensor:
    """c[B, M, N] = a[B, M, K] @ b[B, K, N], any strides. `split_mode` None: split mode when the
    tiles alone leave the GPU idle (it changes where partials are added, never their order)."""
    batch, m, k = a.shape
    n = b.shape[2]
    if m == 0 or n == 0:
        return c
    kc = cfg.chunk(k)
    chunks = cdiv(k, kc)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split_mode is None:
        split_mode = chunks > 1 and tiles * batch < FILL_PROGRAMS
    split_mode = split_mode and chunks > 1
    parts = chunks if split_mode else 1
    # inline mode: 1-element stand-ins for the partials and counters it never touches
    ws_shape = (batch, chunks, m, n) if split_mode else (1, 1, 1, 1)
    ws = torch.empty(ws_shape, device=a.device, dtype=torch.float32)
    count = fp8_gemv.counters(a.device, tiles * batch) if split_mode else ws
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _matmul_kernel[(tiles, parts, batch)](
        a, b, c, ws, count, m, n, k, kc, chunks // parts,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        ws.stride(0), ws.stride(1), ws.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        PRECISION=precision, SPLIT_MODE=split_mode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def linear(x: torch.Tensor, w: torch.Tensor, cfg: TileConfig | None = None) -> torch.Tensor:
    """x[..., in] @ w[out, in].T"""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    if w.dtype != flat.dtype:
        flat = flat.to(w.dtype)
    out = torch.empty(flat.shape[0], w.shape[0], device=x.device, dtype=w.dtype)
    cfg = cfg or config_for(k, w.shape[0], w.dtype, flat.shape[0])
    _launch(flat[None], w.t()[None], out[None], cfg)
    return out.reshape(*lead, w.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig | None = None) -> torch.Tensor:
    """torch.matmul(a, b) for a [..., M, K] and b [..., K, N] (leading dims broadcast)."""
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.empty(a3.shape[0], a3.shape[1], b3.shape[2], device=a.device, dtype=a.dtype)
    cfg = cfg or config_for(b3.shape[1], b3.shape[2], b3.dtype, a3.shape[1])
    _launch(a3, b3, out, cfg)
    return out.reshape(*lead, a.shape[-2], b.shape[-1])
