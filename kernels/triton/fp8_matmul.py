"""Block-scaled FP8 GEMM: `y = x @ dequant(w).T` for an `Fp8Weight` (kernels/block_quant.py), the
DeepGEMM / vLLM `w8a8_block_fp8_matmul` scheme.

- `quantize_groups(x)`: per row and per 128 columns, amax -> scale = amax / 448, x / scale cast to
  float8_e4m3fn; one float32 scale per (row, group). Dynamic (from the step's own activations),
  and per row, so a row's codes never depend on the other rows of the batch.
- `fp8_linear(x, w)`: K walked in 128-steps, each step one tensor-core dot of the fp8 tiles into
  float32 (wgmma on Hopper), times a_scale[m, kb] * b_scale[nb, kb], added in K order; output in
  x's dtype. Up to INLINE_QUANT_ROWS rows (decode) the GEMM quantizes its own x tiles, by the
  same formula as `quantize_groups` (so the same bits): one launch, not two, where every
  program's redundant quantization of a few rows costs less than a launch. UE8M0 weight scales
  (DeepSeek-V4) are float32 powers of two after load: the same kernel. With K walked whole
  in 128-steps on mma-sized tiles (`--batch-invariant` takes `invariant_config`: 16 or 32 rows,
  never split-K) a row's sum is the same chain of K steps for any M, so rows are batch invariant.
- Split-K (the default set's `SPLIT` tiles, 17-128 rows where whole-K tiles leave SMs idle): K is
  cut into runs fixed by the shape, each program sums one run in float32 and the last of a
  tile's programs adds the runs in order (fp8_gemv.py's one-launch scheme): deterministic, and
  capturable in a CUDA graph.

Which path a set's `linear` takes (`linear_or`, `path`): the default set sends up to GEMV_ROWS
rows to fp8_gemv.py's weight-streaming kernel (x unquantized, split-K where N is narrow) and more
rows here; its rows' bits may change with the row count, as cuBLAS's do when it picks kernels by
shape. `--batch-invariant` takes this GEMM at every M with the tile fixed by the weight: one
scheme, so a row's bits never depend on the batch. Weights whose K block is not 128 are not this
kernel's: `linear_or` sends them to their dequantized fallback. What does not live here: the
weight type and its torch reference (kernels/block_quant.py), FP8 experts (fused_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deepserve.kernels import block_quant
from deepserve.kernels.block_quant import FP8_MAX, Fp8Weight
from deepserve.kernels.triton import fp8_gemv
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, tl

GROUP = 128  # activation group and weight K block: one scale pair per K step
QUANT_GROUPS = 8  # groups per program of the quantize kernel
AMAX_FLOOR = 1e-10  # an all-zero group gets this amax: scale > 0, codes 0
INLINE_QUANT_ROWS = 16  # up to this many rows the GEMM quantizes x itself
FILL_PROGRAMS = 132  # programs of one H200 wave: what a decode launch's N tiles should reach
# the narrowest decode tile (tl.dot's least N); the GPU job times it beside wider ones
# (kernel_checks `time_fp8_decode_tiles`)
MIN_DECODE_BLOCK_N = 16
# the default set's rows through fp8_gemv (the GPU job times both paths up to 64 rows:
# kernel_checks `time_fp8_paths`)
GEMV_ROWS = 16


@dataclass(frozen=True)
class Fp8TileConfig:
    block_m: int = 16
    block_n: int = 64
    group_m: int = 8  # tiles of group_m row-blocks share their weight columns in L2
    num_warps: int = 4
    num_stages: int = 4
    # split K until the launch reaches this many waves of FILL_PROGRAMS (0: one run per tile)
    waves: int = 0


# decode: few rows, the weight streamed once; N tiles alone fill the GPU on the wide projections
DECODE = Fp8TileConfig()
MEDIUM = Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)
LARGE = Fp8TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
# 17-128 rows of a weight MEDIUM's tiles leave SMs idle on (a batch-64 step's projections), K
# cut into runs until the launch fills the GPU: 64-row tiles, each weight tile read once, for
# wide weights; 16-row tiles (more programs, short runs) for narrow ones. The GPU job's sweep
# (kernel_checks `time_fp8_batch_tiles`, run-gpu21-1) chose both and the bounds below.
SPLIT = Fp8TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=4, waves=1)
SPLIT_NARROW = Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=4, waves=2)
SPLIT_MIN_K = 4096  # up to 64 rows, shorter K runs whole (16-row tiles): a split gained nothing
NARROW_N = 1024
# `--batch-invariant` past 64 rows: mma's largest e4m3 tile that sums as DECODE's (tile_bits.py:
# 20-22% under DECODE's time at 2,000 rows, V2-Lite's and V4's projections)
INVARIANT_PREFILL = Fp8TileConfig(block_m=32)


def decode_config(n: int, m: int = 1) -> Fp8TileConfig:
    """DECODE's rows with columns narrowed (to MIN_DECODE_BLOCK_N) until the tiles of M rows
    fill the GPU: without split-K, a narrow weight's tiles are its only parallelism. With m left
    at 1 a function of the weight alone, so the invariant set uses it at every M."""
    block_n = DECODE.block_n
    row_blocks = cdiv(m, DECODE.block_m)
    while block_n > MIN_DECODE_BLOCK_N and row_blocks * cdiv(n, block_n) < FILL_PROGRAMS:
        block_n //= 2
    return replace(DECODE, block_n=block_n)


def default_config(m: int, n: int, k: int) -> Fp8TileConfig:
    """The fast set's tile for M rows of an [N, K] weight. Up to 128 rows MEDIUM's 64 x 128
    tiles, unless they leave SMs idle: a batch-64 decode step's projections (V4's 1,024-column
    q_a: 8 programs on 132 SMs; its 4,096-column wo_b: 32 programs walking K = 8,192) then cut
    K into runs (SPLIT, SPLIT_NARROW), or up to 64 rows of a short K take 16-row whole-K tiles."""
    if m <= 16:
        return decode_config(n)
    if m > 128:
        return LARGE
    if cdiv(m, MEDIUM.block_m) * cdiv(n, MEDIUM.block_n) >= FILL_PROGRAMS:
        return MEDIUM
    if k < SPLIT_MIN_K and m <= 64:
        return decode_config(n, m)
    return SPLIT_NARROW if n <= NARROW_N else SPLIT


@jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, s_sm,
    GROUP: constexpr, GROUPS: constexpr, FP8_MAX: constexpr, AMAX_FLOOR: constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    scale = tl.math.div_rn(amax, FP8_MAX)  # IEEE: the same bits in both kernels and torch
    # IEEE division: the codes are torch's `(x / scale).to(float8)` exactly
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * s_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_sm + g, scale, mask=g * GROUP < K)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (float8_e4m3fn `[M, K]`, float32 scales `[M, ceil(K/128)]`)."""
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, cdiv(k, GROUP), device=x.device, dtype=torch.float32)
    if m:
        grid = (m, cdiv(cdiv(k, GROUP), QUANT_GROUPS))
        _quantize_kernel[grid](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
            GROUP=GROUP, GROUPS=QUANT_GROUPS, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR,
        )  # fmt: skip
    return q, s


def quantize_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups` in torch: the tests' oracle."""
    m, k = x.shape
    groups = cdiv(k, GROUP)
    padded = torch.zeros(m, groups * GROUP, device=x.device)
    padded[:, :k] = x.float()
    g = padded.view(m, groups, GROUP)
    # a tensor divisor: CUDA divides by a scalar as a multiply by its reciprocal, not IEEE
    scale = g.abs().amax(-1).clamp(min=AMAX_FLOOR) / torch.full((), FP8_MAX, device=x.device)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(1)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


@jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, count_ptr, M, N, K, steps_per_split, n_split,
    s_am, s_asm, s_bn, s_bsn, s_cm,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr, SCALE_N: constexpr,
    GROUP_M: constexpr, EVEN_K: constexpr,
    QUANT_A: constexpr, FP8_MAX: constexpr, AMAX_FLOOR: constexpr, GROUP_N: constexpr,
    SPLIT_K: constexpr,
):  # fmt: skip
    """a: e4m3 codes with scales at as_ptr, or with QUANT_A x itself, quantized per 128-step.
    With GROUP_N, b's rows come in groups of GROUP_N and group g reads a's g-th run of K
    columns (and of K / 128 scales). With SPLIT_K, program (tile, s) sums K run s into
    part_ptr[s] (float32 [n_split, M, N]) and the tile's last program to finish adds the runs in
    order into c (fp8_gemv.py's one-launch scheme, on the same counters)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (pid % in_group) % group_rows
    pn = (pid % in_group) // group_rows
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ra = tl.minimum(rm, M - 1)  # rows past M repeat a real row (never stored): no row mask
    rb = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + ra[:, None].to(tl.int64) * s_am
    b_base = (
        b_ptr + rb[None, :].to(tl.int64) * s_bn
    )  # w [N, K]: the tile is K-major, as wgmma wants
    a_scale = as_ptr + ra * s_asm
    if GROUP_N:
        group = pn * BLOCK_N // GROUP_N
        a_base += group * K
        a_scale += group * tl.cdiv(K, BLOCK_K)
    b_scale = bs_ptr + (rb // SCALE_N) * s_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT_K:
        first = tl.program_id(1) * steps_per_split
        last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    else:
        first, last = 0, tl.cdiv(K, BLOCK_K)
    for kb in range(first, last):
        kk = kb * BLOCK_K + rk
        if EVEN_K:
            a = tl.load(a_base + kk[None, :])
            b = tl.load(b_base + kk[:, None])
        else:
            a = tl.load(a_base + kk[None, :], mask=kk[None, :] < K, other=0.0)
            b = tl.load(b_base + kk[:, None], mask=kk[:, None] < K, other=0.0)
        if QUANT_A:  # _quantize_kernel's arithmetic on this tile's rows
            x = a.to(tl.float32)
            sa = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR), FP8_MAX)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, sa[:, None]), -FP8_MAX), FP8_MAX)
            a = q.to(tl.float8e4nv)
        else:
            sa = tl.load(a_scale + kb)
        sb = tl.load(b_scale + kb)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    keep = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K:
        _sum_runs(acc, part_ptr, count_ptr, pid, c_ptr + rm[:, None] * s_cm + rn[None, :],
                  rm[:, None].to(tl.int64) * N + rn[None, :], M * N, n_split, keep)  # fmt: skip
    else:
        out = c_ptr + rm[:, None] * s_cm + rn[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=keep)


@jit
def _sum_runs(acc, part_ptr, count_ptr, tile, out, offs, run_size, n_split, keep):
    """Store this program's K run; the tile's last program adds the runs into `out`."""
    run = tl.program_id(1).to(tl.int64)
    tl.store(part_ptr + run * run_size + offs, acc, mask=keep)
    fp8_gemv.add_runs_when_last(count_ptr + tile, part_ptr + offs, run_size, n_split, out, keep)


def invariant_config(m: int, n: int) -> Fp8TileConfig:
    """`--batch-invariant`'s tile: up to 64 rows DECODE's 16 rows with columns by M
    (`decode_config(n, m)`), past them INVARIANT_PREFILL's 32 rows; never split-K, so a row's K
    steps stay one chain from 0 in K order. A tile's columns do not enter a row's bits, its rows
    do from 64 on, where Triton issues e4m3 wgmma, whose sums differ from the mma's (16 and 32
    rows agree: benchmarks/gpu/tile_bits.py on an H100, MEDIUM and LARGE against DECODE)."""
    return INVARIANT_PREFILL if m > 64 else decode_config(n, m)


def supports(w: Fp8Weight) -> bool:
    """Whether the kernel reads `w`: one weight scale per 128 inputs, a 2-D matrix."""
    return w.data.dim() == 2 and w.block[1] == GROUP


def fp8_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    cfg: Fp8TileConfig | None = None,
    inline_quant: bool | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """x[..., K] @ dequant(w)[N, K].T in x's dtype, x quantized per row and 128 columns (in the
    GEMM with `inline_quant`; None: up to INLINE_QUANT_ROWS rows; the bits are the same). With
    `groups` G: x[..., G * K] and w's rows in G equal groups, group g against x's g-th K columns
    (DeepSeek-V4's grouped output projection, without splitting x): `[..., N]`."""
    lead, n, k = x.shape[:-1], w.data.shape[0], w.data.shape[1]
    assert x.shape[-1] == groups * k and (groups == 1 or k % GROUP == 0)
    flat = x.reshape(-1, groups * k)
    if flat.stride(-1) != 1:  # the kernels read rows of unit stride
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    cfg = cfg or default_config(m, n, k)
    assert n % (groups * cfg.block_n) == 0 or groups == 1, "a tile's columns span two groups"
    inline = m <= INLINE_QUANT_ROWS if inline_quant is None else inline_quant
    q, qs = (flat, flat) if inline else quantize_groups(flat)
    tiles, steps = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), cdiv(k, GROUP)
    split = fp8_gemv.split_runs(tiles, steps, cfg.waves) if cfg.waves else 1
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    count = fp8_gemv.counters(x.device, tiles) if split > 1 else out
    _fp8_gemm_kernel[(tiles, split)](
        q, qs, w.data, w.scale, out, part, count, m, n, k, cdiv(steps, split), split,
        q.stride(0), 0 if inline else qs.stride(0), w.data.stride(0), w.scale.stride(0),
        out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, SCALE_N=w.block[0],
        GROUP_M=cfg.group_m, EVEN_K=k % GROUP == 0,
        QUANT_A=inline, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR,
        GROUP_N=n // groups if groups > 1 else 0, SPLIT_K=split > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out.reshape(*lead, n)


def path(rows: int, w: Fp8Weight, batch_invariant: bool = False) -> str:
    """Which kernel a set's `linear` runs for `rows` rows of x against `w`: "gemv"
    (fp8_gemv.py, default set, few rows), "gemm" (this module's), or "dequantized"."""
    if not supports(w):
        return "dequantized"
    if not batch_invariant and rows <= GEMV_ROWS and fp8_gemv.supports(rows, w):
        return "gemv"
    return "gemm"


def linear_or(
    base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch_invariant: bool = False
) -> Callable[..., torch.Tensor]:
    """A set's `linear`: `Fp8Weight`s by `path` (the GEMM's tiles by M, or with
    `batch_invariant` by the weight alone), other quantized weights dequantized, plain tensors
    through `base`."""

    def linear(x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, Fp8Weight) and supports(w):
            return _by_path(x, w, batch_invariant)
        if isinstance(w, Fp8Weight | block_quant.Mxfp4Weight):
            return block_quant.linear(x, w)
        return base(x, w)

    return linear


def grouped_linear_or_none(batch_invariant: bool = False) -> Callable[..., torch.Tensor | None]:
    """A set's `grouped_linear`: (x [..., G * K], w [N, K] with rows in G groups, G) ->
    `[..., N]`, group g's rows against x's g-th K columns, for an `Fp8Weight` by `path` as
    `linear_or` sends it; None for a weight it does not take (the model's bmm runs it then):
    groups of whole 128-row blocks over whole 128-column steps, so no tile spans two groups."""

    def grouped_linear(x: torch.Tensor, w, groups: int) -> torch.Tensor | None:
        if not isinstance(w, Fp8Weight) or not supports(w):
            return None
        n, k = w.shape
        if n % groups or (n // groups) % GROUP or k % GROUP:
            return None
        return _by_path(x, w, batch_invariant, groups)

    return grouped_linear


def _by_path(x: torch.Tensor, w: Fp8Weight, batch_invariant: bool, groups: int = 1) -> torch.Tensor:
    """x against a weight this module's kernels read, through the kernel `path` picks (the
    GEMM's tile by M, or with `batch_invariant` by the weight alone)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if path(rows, w, batch_invariant) == "gemv":
        return fp8_gemv.fp8_gemv(x, w, groups=groups)
    cfg = invariant_config(rows, w.shape[0]) if batch_invariant else None
    return fp8_linear(x, w, cfg, groups=groups)
