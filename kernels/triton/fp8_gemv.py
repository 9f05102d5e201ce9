"""The weight-streaming kernel for few rows (decode): `y = x @ w.T` with w an `Fp8Weight`
(kernels/block_quant.py, x NOT quantized: w8a16) or a plain bf16 / float32 tensor.

At M = 1..16 a linear is a read of the weight: the work is streaming N x K weight bytes (plus the
scales) once at HBM speed, not tensor-core FLOPs. So each program owns BLOCK_N rows of w and walks
a fixed range of K in 128-steps (for FP8 one weight scale per step and row block, the fp8 tile
dequantized with it), multiplying the tile by x in float32:

- `rows == 1` (GEMV): on CUDA cores, the float32 products of the tile and x's 128 values summed
  per row; no tensor-core padding of one row to sixteen.
- `rows > 1` (skinny): one dot per step of x in its own dtype (bf16 or float32 on the ieee path)
  against the tile widened to that dtype; every e4m3 value is exact in bf16, so the products are
  the dequantized ones exactly and only the float32 accumulation order differs.

Split-K, fixed by the shape: where N's row blocks alone cannot fill the GPU (V2-Lite's 576 and
2,048-row projections), K is cut into `split` runs of whole 128-steps and each program writes its
float32 partial sums to a `[split, M, N]` buffer. One launch: a program then counts itself done on
its row block's counter (an acq_rel atomic at GPU scope, after a CTA barrier so all its threads'
stores are ordered before it); the program that counts last adds the row block's partials in split
order, writes y and sets the counter back to 0. So the sum is deterministic (the same bits as the
two-launch scheme, `GemvConfig(one_launch=False)`: a second kernel adding the partials, kept for
the GPU job's comparison), and a call needs no memset and no host sync: the counters are one
buffer per device, allocated once and left at zero by every call, so the launch is CUDA-graph
capturable. Calls must not run concurrently on two streams of one device (they would share
counters): the engine's steps run on one stream.

x is not quantized, so a row's result is not the w8a8 GEMM's bits (fp8_matmul.py), and the scheme
changes with the row count (as cuBLAS changes kernels by shape): only the default KernelSet takes
this path (`streaming_linear_or` for plain weights, fp8_matmul.linear_or for FP8 ones).
`--batch-invariant` keeps its fixed-tile kernels at every M. What does not live here: the FP8
GEMM for more rows (fp8_matmul.py) and the weight types (block_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepserve.kernels.block_quant import Fp8Weight
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, next_power_of_2, tl

GROUP = 128  # the weights' K block: one scale per row block and K step
FILL_PROGRAMS = 132  # programs of one H200 wave
MAX_ROWS = 64  # the kernel takes up to this many rows of x (the dot path pads to a power of 2)
SUM_BLOCK = 1024  # outputs per program of the two-launch scheme's partials' sum
MIN_COUNTERS = 4096  # row-block counters per device: V3's 129,280-row head has 2,020 blocks
# plain (bf16 / float32) weights: rows up to which the default set streams them here instead of
# cuBLAS, and the least weight size worth it (a 2048 x 64 router is launch-bound either way).
# The GPU job decides (kernel_checks `time_gemv_one_launch`; run-gpu15-3): in a CUDA graph at
# one row this kernel matched cuBLAS on V2-Lite's projections (a V2-Lite step's dense linears
# 785 us against 757; engine batch 1 337 tok/s against 348 with all of them streamed here) and
# beat it only on weights of tens of millions of elements (V2-Lite's head 103 us against 110,
# V3's dense gate_up 121 against 134); at 2-16 rows cuBLAS won everywhere.
PLAIN_ROWS = 1
PLAIN_MIN_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # rows of w per program: a 64 x 128 step reads 8 KiB of fp8
    num_warps: int = 4
    num_stages: int = 4
    # split K until the launch has this many waves of FILL_PROGRAMS (if K allows): a program
    # has one 8 KiB step in flight, so an SM needs several to cover HBM's latency
    waves: int = 4
    one_launch: bool = True  # the last program of a row block adds its partials (else 2 kernels)
    # one row: x loaded as a [BLOCK_N, 128] tile in w's layout (each thread its own copy, from
    # L1) instead of once and moved through shared memory (two CTA barriers a step); the GPU
    # job times both (kernel_checks GEMV_CANDIDATES "xtile")
    x_tile: bool = False


GEMV = GemvConfig()


def split_k(n: int, k: int, cfg: GemvConfig = GEMV) -> int:
    """K runs per row block: runs of a whole number of 128-steps, short enough that the launch
    reaches `waves` full waves of programs (never more runs than steps). A function of the shape
    alone: fixed per weight."""
    return split_runs(cdiv(n, cfg.block_n), cdiv(k, GROUP), cfg.waves)


def split_runs(tiles: int, steps: int, waves: int) -> int:
    """Runs of whole K steps per output tile so that `tiles` tiles reach `waves` waves of
    FILL_PROGRAMS programs (never more runs than steps; every run but the last equally long)."""
    wanted = min(steps, max(1, cdiv(waves * FILL_PROGRAMS, tiles)))
    return cdiv(steps, steps // wanted)


def steps_per_split(k: int, split: int) -> int:
    return cdiv(cdiv(k, GROUP), split)


@jit
def _row_partial(x_ptr, w_base, w_scale, first, last, K, BLOCK_K: constexpr, EVEN_K: constexpr,
                 SCALED: constexpr, BLOCK_N: constexpr, X_TILE: constexpr):  # fmt: skip
    """One row of x against BLOCK_N rows of w over K steps [first, last): float32 [BLOCK_N]."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(first, last):
        kk = kb * BLOCK_K + rk
        if X_TILE:  # noqa: SIM108  (x in w's layout, from L1: no conversion, no barrier a step)
            xk = kk[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
        else:
            xk = kk
        if EVEN_K:
            w = tl.load(w_base + kk[None, :])
            x = tl.load(x_ptr + xk)
        else:
            w = tl.load(w_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
            x = tl.load(x_ptr + xk, mask=xk < K, other=0.0)
        if X_TILE:
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
        else:
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if SCALED:
            acc += part * tl.load(w_scale + kb)
        else:
            acc += part
    return acc


@jit
def _rows_partial(x_base, w_base, w_scale, first, last, K, BLOCK_M: constexpr, BLOCK_N: constexpr,
                  BLOCK_K: constexpr, EVEN_K: constexpr, SCALED: constexpr, IEEE: constexpr):  # fmt: skip
    """BLOCK_M rows of x against BLOCK_N rows of w over K steps [first, last), one dot a step:
    float32 [BLOCK_M, BLOCK_N]."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        kk = kb * BLOCK_K + rk
        if EVEN_K:
            w = tl.load(w_base + kk[None, :])
            x = tl.load(x_base + kk[None, :])
        else:
            w = tl.load(w_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
            x = tl.load(x_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
        wt = tl.trans(w.to(x.dtype))  # e4m3 -> bf16 / float32: exact; bf16 / float32: as is
        if IEEE:
            d = tl.dot(x, wt, input_precision="ieee", out_dtype=tl.float32)
        else:
            d = tl.dot(x, wt, out_dtype=tl.float32)
        if SCALED:
            acc += d * tl.load(w_scale + kb)[None, :]
        else:
            acc += d
    return acc


@jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, y_ptr, count_ptr, M, N, K, steps_per_split, n_split,
    s_xm, s_wn, s_wsn, s_os, s_om,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr, SCALE_N: constexpr,
    EVEN_K: constexpr, IEEE: constexpr, SCALED: constexpr, ONE_LAUNCH: constexpr,
    X_TILE: constexpr, GROUP_N: constexpr,
):  # fmt: skip
    """out[split, m, n]: the partial sums of split `program_id(1)`'s K steps (with one split,
    `out` is y itself, in its dtype). With ONE_LAUNCH the last of a row block's programs to
    finish adds its `n_split` partials into y, in split order, and zeroes its counter. With
    GROUP_N, w's rows come in groups of GROUP_N and group g reads x's g-th run of K columns."""
    pn = tl.program_id(0)
    split = tl.program_id(1)
    if GROUP_N:
        x_ptr += (pn * BLOCK_N // GROUP_N) * K
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.minimum(rn, N - 1)  # rows past N repeat a real one (never stored): no row mask
    w_base = w_ptr + rb[:, None].to(tl.int64) * s_wn  # [BLOCK_N, BLOCK_K] tiles, K contiguous
    w_scale = ws_ptr + (rb // SCALE_N) * s_wsn
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    if BLOCK_M == 1:
        acc = _row_partial(x_ptr, w_base, w_scale, first, last, K, BLOCK_K, EVEN_K, SCALED,
                           BLOCK_N, X_TILE)  # fmt: skip
        offs = rn
        keep = rn < N
    else:
        rm = tl.arange(0, BLOCK_M)
        x_base = x_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * s_xm
        acc = _rows_partial(x_base, w_base, w_scale, first, last, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            EVEN_K, SCALED, IEEE)  # fmt: skip
        offs = rm[:, None] * s_om + rn[None, :]
        keep = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + split * s_os + offs, acc.to(out_ptr.dtype.element_ty), mask=keep)
    if ONE_LAUNCH:
        add_runs_when_last(count_ptr + pn, out_ptr + offs, s_os, n_split, y_ptr + offs, keep)


@jit
def add_runs_when_last(count_ptr, part_ptr, run_stride, n_split, out_ptr, keep):
    """After a program stored its partial sums (run r of a tile at part_ptr + r * run_stride):
    count it done on the tile's counter; the last of the tile's `n_split` programs adds the
    runs in run order into out_ptr and sets the counter back to 0."""
    tl.debug_barrier()  # every thread's partial stored before the count releases them
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == n_split - 1:
        total = tl.load(part_ptr, mask=keep, other=0.0, cache_modifier=".cg")
        for s in range(1, n_split):
            total += tl.load(part_ptr + s * run_stride, mask=keep, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr, total.to(out_ptr.dtype.element_ty), mask=keep)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@jit
def _sum_splits_kernel(p_ptr, y_ptr, total, SPLIT: constexpr, BLOCK: constexpr):
    """y = sum of the SPLIT partials `p[s]` (each `total` long), added in split order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * total + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's row-block counters (int32, all zero between calls): allocated on first use,
    grown only outside a CUDA graph capture (a capture must not own them)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv: {tiles} row blocks need the counters grown before capture")
        have = torch.zeros(max(tiles, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def supports(x_rows: int, w: Fp8Weight) -> bool:
    """Whether this kernel takes `x_rows` rows against `w`: a 2-D weight of 128-wide K blocks."""
    return 0 < x_rows <= MAX_ROWS and w.data.dim() == 2 and w.block[1] == GROUP


def supports_plain(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this kernel takes x against a plain weight: 2-D, K contiguous, x's dtype (bf16 or
    float32), at most MAX_ROWS rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        0 < rows <= MAX_ROWS
        and w.dim() == 2
        and w.stride(-1) == 1
        and w.dtype == x.dtype
        and w.dtype in (torch.bfloat16, torch.float32)
        and w.shape[1] == x.shape[-1]
    )


def fp8_gemv(
    x: torch.Tensor, w: Fp8Weight, cfg: GemvConfig = GEMV, groups: int = 1
) -> torch.Tensor:
    """x[..., K] (at most MAX_ROWS rows) @ dequant(w)[N, K].T in x's dtype, x as it is. With
    `groups` G: x[..., G * K] and w's rows in G equal groups, group g against x's g-th K columns
    (a grouped projection without splitting x): `[..., N]`."""
    return _launch(x, w.data, w.scale, w.block[0], cfg, groups)


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig = GEMV) -> torch.Tensor:
    """x[..., K] (at most MAX_ROWS rows) @ w[N, K].T for a plain weight of x's dtype."""
    return _launch(x, w, w, 0, cfg)


def _launch(x, w_data, w_scale, scale_n: int, cfg: GemvConfig, groups: int = 1) -> torch.Tensor:
    lead, n, k = x.shape[:-1], w_data.shape[0], w_data.shape[1]
    assert x.shape[-1] == groups * k and (groups == 1 or n % (groups * cfg.block_n) == 0)
    flat = x.reshape(-1, groups * k)
    if flat.stride(-1) != 1:  # the kernel reads rows of unit stride
        flat = flat.contiguous()
    m = flat.shape[0]
    assert m <= MAX_ROWS, "gemv takes decode-sized calls (the default set's linear sends them)"
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    split, tiles = split_k(n, k, cfg), cdiv(n, cfg.block_n)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    one_launch = cfg.one_launch and split > 1
    count = counters(x.device, tiles) if one_launch else y
    _gemv_kernel[(tiles, split)](
        flat, w_data, w_scale, out, y, count, m, n, k, steps_per_split(k, split), split,
        flat.stride(0), w_data.stride(0), w_scale.stride(0) if scale_n else 0, m * n, n,
        BLOCK_M=1 if m == 1 else max(16, next_power_of_2(m)), BLOCK_N=cfg.block_n,
        BLOCK_K=GROUP, SCALE_N=max(scale_n, 1), EVEN_K=k % GROUP == 0,
        IEEE=x.dtype == torch.float32, SCALED=scale_n > 0, ONE_LAUNCH=one_launch,
        X_TILE=cfg.x_tile and m == 1, GROUP_N=n // groups if groups > 1 else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1 and not one_launch:
        total = m * n
        _sum_splits_kernel[(cdiv(total, SUM_BLOCK),)](out, y, total, SPLIT=split, BLOCK=SUM_BLOCK)
    return y.reshape(*lead, n)


def plain_path(rows: int, w: torch.Tensor) -> bool:
    """Whether the default set streams a plain weight here for `rows` rows (else cuBLAS)."""
    return rows <= PLAIN_ROWS and w.numel() >= PLAIN_MIN_ELEMENTS


def streaming_linear_or(
    base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The default set's plain `linear`: few rows against a large bf16 / float32 weight through
    this kernel (`plain_path`), everything else through `base` (cuBLAS)."""

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plain = isinstance(w, torch.Tensor) and supports_plain(x, w)
        if plain and plain_path(x.numel() // x.shape[-1], w):
            return gemv(x, w)
        return base(x, w)

    return linear
