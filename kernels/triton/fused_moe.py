"""Fused MoE for the GPU: every routed expert of a layer in two grouped-GEMM launches, no host sync.

The (token, slot) pairs of a step are sorted by expert on the device and laid out in blocks of
`block_m` rows that each belong to one expert (`align`); one program computes one block's rows
against one tile of that expert's weights, so an expert's weights are read once per block rather
than once per token, and the grid size depends only on the pair count, never on how the router
chose: the launch is capturable in a CUDA graph. Blocks past the used ones see expert id E and
return at once.

A row's result depends only on its own input, its expert and the fixed tile shape (no split-K,
K walked in order), and the top-k outputs are summed in slot order: with a fixed `MoeConfig`
the op is batch invariant (FP8 experts too: their activations are quantized per row). Experts
come plain (bf16 / float32), as block-scaled FP8 (`Fp8Weight`: e4m3 dots scaled per 128-step of
K, as fp8_matmul.py's GEMM; or, with a config's `fp8_inputs` off, the e4m3 tile widened to the
activations' dtype and x left unquantized, as fp8_gemv.py: the default set's decode-sized calls,
two quantize launches fewer and x's own values) or as MXFP4 (`Mxfp4Weight`: e2m1 codes dequantized to the
activations' dtype in the K loop, since Hopper has no FP4 tensor cores; bf16 activations on E8M0
scales on the GPU by a few PTX bit operations a pair of codes, `E2M1_BF16_PTX`, the same values
as the integer decode's). What does not live
here: routing (the model's) and the shared experts (only their output is added, in the slot
sum's launch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deepserve.kernels.block_quant import Fp8Weight, Mxfp4Weight
from deepserve.kernels.triton.fp8_matmul import GROUP, quantize_groups, quantize_groups_reference
from deepserve.kernels.triton.lang import (
    HAVE_TRITON,
    cdiv,
    compiled,
    constexpr,
    jit,
    next_power_of_2,
    tl,
)
from deepserve.kernels.triton.rows import silu_mul

# [E, N, K] stacked experts: plain (bf16 / float32), block-scaled FP8 or MXFP4
ExpertWeight = torch.Tensor | Fp8Weight | Mxfp4Weight


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # FP8 experts: quantize the activations per 1 x 128 group for e4m3 dots (w8a8), or widen
    # the weights to the activations' dtype (w8a16). Fixed per config: `--batch-invariant`'s
    # one config keeps one scheme at every size.
    fp8_inputs: bool = True
    # MXFP4 experts with E8M0 scales under bf16 activations on the GPU: decode the e2m1 codes
    # with `E2M1_BF16_PTX` (a few bit ops per pair) instead of `_e2m1`'s integer path; both are
    # exact, so the results are the same bits (the GPU job checks and times both:
    # kernel_checks `check_quantized_moe`)
    e2m1_ptx: bool = True
    # ... with the 2^126 renormalisation folded into the scales where the weight's scales allow
    # it (`E2M1_BF16_PTX_FOLDED`, `Mxfp4Weight.small_scales`): the same bits, fewer instructions
    e2m1_fold: bool = True


DECODE = MoeConfig()
# the default set's decode-sized calls: memory bound, so w8a16 costs nothing and saves the two
# activation-quantize launches (the GPU job times both: kernel_checks `check_quantized_moe`)
DECODE_W8A16 = MoeConfig(fp8_inputs=False)
PREFILL = MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
PREFILL_MIN_PAIRS = 1024  # from here on, the wide tile (tensor-core bound) wins over the narrow one
# Once the experts average a full block of 128 rows each: V2-Lite's 2,000-token prefill (12,000
# pairs over 64 experts) ran its MoE in 0.75 ms against PREFILL's 0.82 (H200, run-kern-1)
LARGE = MoeConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
# MXFP4 experts past decode sizes: the e2m1 decode is paid once per weight per row block, so
# PREFILL's 64-row tiles with a 64-deep K step decode too much per product. V4-Flash's experts
# at 1,024 tokens (H200, run-gpu15-2 `mxfp4_moe_tile`): 2.64 ms against PREFILL's 10.6 (bf16
# experts 3.63); 16 x 128 x 128 and 64 x 64 x 128 took 3.66, LARGE's shape 5.2. From LARGE's
# threshold on LARGE still wins (the V4 slice's 8,192-token prefill: 48,120 tok/s with LARGE,
# 40,947 with this tile; run-gpu15-3).
MXFP4_PREFILL = MoeConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)


def default_config(pairs: int, num_experts: int, mxfp4: bool = False) -> MoeConfig:
    """The tile for a call of `pairs` (token, slot) pairs when the caller fixes none."""
    if pairs >= LARGE.block_m * num_experts:
        return LARGE
    if mxfp4 and pairs >= PREFILL_MIN_PAIRS:
        return MXFP4_PREFILL
    return PREFILL if pairs >= PREFILL_MIN_PAIRS else DECODE_W8A16


def invariant_config(pairs: int, w: ExpertWeight) -> MoeConfig:
    """`--batch-invariant`'s tile for a call of `pairs` pairs against experts `w`, from what
    benchmarks/gpu/tile_bits.py found to keep a row's bits on an H100 (against DECODE, 1 to
    2,000 tokens). bf16 experts: `default_config`'s shapes with K always in 128-steps (a tile's
    rows, columns, warps and stages do not enter a bf16 row's bits). MXFP4 experts: 64-row tiles
    and 64-deep K steps change them, so DECODE, and MXFP4_PREFILL's 32 x 128-deep tiles from
    PREFILL_MIN_PAIRS. FP8 experts: DECODE at every size (e4m3 dots differ from 64 rows, where
    Triton issues FP8 wgmma). float32 experts: DECODE (not checked)."""
    if isinstance(w, Mxfp4Weight):
        return MXFP4_PREFILL if pairs >= PREFILL_MIN_PAIRS else DECODE
    if not (isinstance(w, torch.Tensor) and w.element_size() == 2):
        return DECODE
    return replace(default_config(pairs, w.shape[0]), block_k=DECODE.block_k, fp8_inputs=True)


# the expert weights' format, the GEMM kernel's WFMT (written as literals inside the kernel:
# a jitted function may read no module global that is not a constexpr)
PLAIN, FP8, MXFP4, FP8_W8A16 = 0, 1, 2, 3


@jit
def _e2m1(code):
    """float32 values of e2m1 codes (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6, in integer ops
    (exact: no exp2)."""
    mag = (code & 7).to(tl.int32)
    e, m = mag >> 1, mag & 1
    value = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -value, value)


# Four code bytes (8 weights) -> their low nibbles as 4 bf16 ($0, $1) and high nibbles ($2, $3),
# element i of a pack in byte i of $4 (codes), in half i % 2 of $5 / $6 (i // 2) (the scales as
# bf16 powers of two: an E8M0 byte S << 7 is 2^(S - 127)'s bf16 bits) and in the low (even i)
# or high (odd i) half of an output register. An e2m1 nibble s|e1 e0|m placed at a bf16's bits
# 15 | 8 7 | 6 is exactly its value times 2^-126 (e = 0: a bf16 subnormal, exact): prmt spreads
# two bytes into the 16-bit lanes with each byte's sign bit (its bit 7, the high nibble's s)
# copied over the lane's upper byte, so one shift by 2 and one mask place a high nibble; the low
# ones take the same steps from the codes shifted up by a nibble first. One mul by 2^126 makes
# it the e2m1 value, one by the scale scales it, both exact (sm_90's bf16 mul keeps
# subnormals). S = 0 gives zeros and S = 255 inf, as `_e2m1`'s path reads those bytes.
# Folded (`E2M1_BF16_PTX_FOLDED`): the scales come as 2^(S - 1) = 2^126 * 2^(S - 127) and one
# mul does both, a quarter of the decode's instructions fewer; the product is the same real
# number rounded once, so the same bits, but 2^(S - 1) leaves bf16's range past S = 128
# (`Mxfp4Weight.small_scales` says whether a weight has such a scale: no real checkpoint does).
# tests/test_kernels_e2m1_ptx.py runs both texts through a model of their instructions over
# every code and scale byte.
def e2m1_bf16_ptx(folded: bool) -> str:
    """`E2M1_BF16_PTX`'s text, with the 2^126 mul (`folded` False) or without it."""
    lines = [".reg .b32 k, r, t, v;", "mov.b32 k, 0x7E807E80;", "shl.b32 r, $4, 4;"]
    for out, src, sel, scale in (
        ("$0", "r", "0x9180", "$5"), ("$2", "$4", "0x9180", "$5"),
        ("$1", "r", "0xB3A2", "$6"), ("$3", "$4", "0xB3A2", "$6"),
    ):  # fmt: skip
        lines += [f"prmt.b32 t, {src}, 0, {sel};", "shl.b32 t, t, 2;", "and.b32 v, t, 0x81C081C0;"]
        if not folded:
            lines.append("mul.rn.bf16x2 v, v, k;")
        lines.append(f"mul.rn.bf16x2 {out}, v, {scale};")
    return "{\n" + "\n".join(lines) + "\n}"


E2M1_BF16_PTX = e2m1_bf16_ptx(folded=False)
E2M1_BF16_PTX_FOLDED = e2m1_bf16_ptx(folded=True)
_E2M1_BF16_PTX = constexpr(E2M1_BF16_PTX) if HAVE_TRITON else E2M1_BF16_PTX
_E2M1_BF16_PTX_FOLDED = constexpr(E2M1_BF16_PTX_FOLDED) if HAVE_TRITON else E2M1_BF16_PTX_FOLDED
# the MXFP4 decode a launch takes (the kernel's PTX constexpr)
E2M1_INTEGER, E2M1_PTX, E2M1_PTX_FOLDED = 0, 1, 2


@jit
def _e2m1_bf16(byte, scale, FOLDED: constexpr):
    """(low nibbles, high nibbles) of code bytes as bf16, times their `scale`s (bf16, same
    shape: 2^(S - 127), or 2^(S - 1) when FOLDED), in `E2M1_BF16_PTX` / `_FOLDED`: sm_90 only,
    never in the interpreter."""
    if FOLDED:
        return tl.inline_asm_elementwise(
            _E2M1_BF16_PTX_FOLDED, "=r,=r,=r,=r,r,r,r", [byte, scale], (tl.bfloat16, tl.bfloat16),
            True, 4,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        _E2M1_BF16_PTX, "=r,=r,=r,=r,r,r,r", [byte, scale], (tl.bfloat16, tl.bfloat16), True, 4
    )


@jit
def _mxfp4_scales(ws_base, rn, k0, N, K, s_wsn, s_wsk, BLOCK_K: constexpr):
    """The scale bytes (or float32 scales) of the BLOCK_K step at k0, `[BLOCK_K // 32, BLOCK_N]`,
    zeros past K: loaded a step ahead of their use (`_moe_gemm_kernel`), since the compiler's
    pipelining takes only the dots' operands and left this load's latency in every step."""
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    ok = (rn[None, :] < N) & (kg[:, None] * 32 < K)
    return tl.load(ws_base + kg[:, None] * s_wsk + rn[None, :] * s_wsn, mask=ok, other=0)


@jit
def _mxfp4_step(
    a_ptr, w_base, s, rows, ok, rn, k0, N, K, s_am, s_wn, s_wk,
    acc, E8M0: constexpr, PTX: constexpr, EVEN_K: constexpr, PRECISION: constexpr,
    BLOCK_M: constexpr, BLOCK_K: constexpr, BLOCK_N: constexpr,
):  # fmt: skip
    """One BLOCK_K step on MXFP4 weights: the tile's bytes loaded once, as a contiguous run of K/2
    (an index of kk // 2 hides that contiguity from the compiler, which then loaded every code on
    its own, byte by byte across rows a whole row of K/2 apart; so does a mask along K, hence
    EVEN_K: K a multiple of BLOCK_K, no K mask, 16-byte pipelined copies), their low nibbles (even
    K) and high nibbles (odd K) dotted with a's even and odd columns, the step's scales `s`
    (`_mxfp4_scales`) broadcast over their groups' 16 bytes."""
    HALF: constexpr = BLOCK_K // 2
    GROUPS: constexpr = BLOCK_K // 32
    kj = k0 // 2 + tl.arange(0, HALF)  # byte index along K/2
    kk = k0 + tl.arange(0, BLOCK_K)
    byte_ok, a_ok = rn[None, :] < N, ok[:, None]
    if not EVEN_K:
        byte_ok = byte_ok & (2 * kj[:, None] < K)
        a_ok = a_ok & (kk[None, :] < K)
    byte = tl.load(w_base + kj[:, None] * s_wk + rn[None, :] * s_wn, mask=byte_ok, other=0)
    if PTX == 2:  # 2^(byte - 1) in bf16 (byte 0: 0, as the other decodes read it): once a group
        s = s.to(tl.int16)
        s = (tl.where(s == 0, s, s + 126) << 7).to(tl.bfloat16, bitcast=True)
    elif PTX == 1:  # 2^(byte - 127) in bf16, before the broadcast: once a group
        s = (s.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
    elif E8M0:  # 2^(byte - 127): the byte is a float32's exponent field
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (GROUPS, 16, BLOCK_N)), (HALF, BLOCK_N))
    # a's row loaded whole (contiguous, vectorized) and split into even and odd columns
    a = tl.load(a_ptr + rows[:, None] * s_am + kk[None, :], mask=a_ok, other=0.0)
    a_lo, a_hi = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))
    if PTX:
        b_lo, b_hi = _e2m1_bf16(byte, s, PTX == 2)
    else:  # exact: 2 significant bits times a power of two
        b_lo = (_e2m1(byte & 0xF) * s).to(a.dtype)
        b_hi = (_e2m1(byte >> 4) * s).to(a.dtype)
    acc = tl.dot(a_lo, b_lo, acc, input_precision=PRECISION)
    return tl.dot(a_hi, b_hi, acc, input_precision=PRECISION)


@jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pair_ptr, block_expert_ptr, scale_ptr, as_ptr, ws_ptr,
    num_pairs, N, K, s_am, s_we, s_wn, s_wk, s_cm, s_asm, s_wse, s_wsn, s_wsk,
    A_DIV: constexpr, SCALE: constexpr, PRECISION: constexpr,
    WFMT: constexpr, SCALE_N: constexpr, E8M0: constexpr, PTX: constexpr, EVEN_K: constexpr,
    BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr,
):  # fmt: skip
    """WFMT PLAIN: a and w of one dtype. FP8: a e4m3 with one scale per (row, BLOCK_K = 128
    columns), w e4m3 with one per (SCALE_N rows, 128 columns); each K step's dot scaled by both.
    MXFP4: w's bytes hold two e2m1 codes along K (low nibble first), one scale per 32 of K
    (E8M0 bytes or float32), dequantized to a's dtype in the loop (Hopper has no FP4 MMA), by
    `E2M1_BF16_PTX` under PTX 1 (E8M0 scales, bf16 a, compiled for the GPU), its folded text
    under PTX 2 (every scale byte at most 128), `_e2m1` under 0.
    FP8_W8A16: w as FP8's, widened to a's dtype (exact), each K step's dot scaled by w's scale."""
    block, pn = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    # 64-bit: pairs x a row's stride passes 2^31 on large steps of wide models
    pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = pairs < num_pairs
    rows = pairs // A_DIV  # gate/up reads the token's row; down reads the pair's own
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * s_we
    ws_base = ws_ptr + expert.to(tl.int64) * s_wse
    if WFMT == 2:
        s_next = _mxfp4_scales(ws_base, rn, 0, N, K, s_wsn, s_wsk, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if WFMT == 2:  # MXFP4
            s = s_next
            s_next = _mxfp4_scales(ws_base, rn, k0 + BLOCK_K, N, K, s_wsn, s_wsk, BLOCK_K)
            acc = _mxfp4_step(
                a_ptr, w_base, s, rows, ok, rn, k0, N, K, s_am, s_wn, s_wk,
                acc, E8M0, PTX, EVEN_K, PRECISION, BLOCK_M, BLOCK_K, BLOCK_N,
            )  # fmt: skip
        else:
            kk = k0 + rk
            a = tl.load(
                a_ptr + rows[:, None] * s_am + kk[None, :],
                mask=ok[:, None] & (kk[None, :] < K),
                other=0.0,
            )
            b_mask = (kk[:, None] < K) & (rn[None, :] < N)
            b = tl.load(w_base + kk[:, None] * s_wk + rn[None, :] * s_wn, mask=b_mask, other=0.0)
            if WFMT == 1:  # FP8
                kb = k0 // BLOCK_K
                sa = tl.load(as_ptr + rows * s_asm + kb, mask=ok, other=0.0)
                sb = tl.load(ws_base + (rn // SCALE_N) * s_wsn + kb * s_wsk, mask=rn < N, other=0.0)
                acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
            elif WFMT == 3:  # FP8 weights, a as it is
                kb = k0 // BLOCK_K
                sb = tl.load(ws_base + (rn // SCALE_N) * s_wsn + kb * s_wsk, mask=rn < N, other=0.0)
                d = tl.dot(a, b.to(a.dtype), out_dtype=tl.float32, input_precision=PRECISION)
                acc += d * sb[None, :]
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=ok, other=0.0)[:, None]
    c = c_ptr + pairs[:, None] * s_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok[:, None] & (rn[None, :] < N))


@jit
def _sum_slots_kernel(
    y_ptr, add_ptr, o_ptr, H, s_add, TOPK: constexpr, ADD: constexpr, BLOCK: constexpr
):
    """o[t] = y[t, 0] + y[t, 1] + ... in slot order, in float32, then `+ add[t]` (the shared
    experts' output) rounded as torch's separate add would round it."""
    t, ph = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = ph * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(o_ptr.dtype.element_ty)
    if ADD:
        extra = tl.load(add_ptr + t * s_add + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + extra).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + t * H + cols, out, mask=mask)


@jit
def _running_max(a, b):
    return tl.maximum(a, b)


@jit
def _align_kernel(
    ids_ptr, table_ptr, block_expert_ptr, num_pairs, E, NBLOCKS,
    CHUNK: constexpr, BLOCK_E: constexpr, BLOCK_B: constexpr, BLOCK_M: constexpr,
):  # fmt: skip
    """`align` in one program, O(pairs log pairs): counts by histogram, each expert's first row
    from the running sum of its padded count, and, per chunk of pairs, each pair's rank among its
    expert's from a sort of (expert, pair) keys, after the ranks of earlier chunks (`cursor`);
    block b's expert is the last one whose first block is <= b (a running max of markers)."""
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        valid = p0 + c < num_pairs
        ids = tl.load(ids_ptr + p0 + c, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    begin = tl.cumsum(padded, axis=0) - padded
    rows = NBLOCKS * BLOCK_M
    for r0 in range(0, rows, CHUNK):
        tl.store(table_ptr + r0 + c, num_pairs, mask=r0 + c < rows)
    b = tl.arange(0, BLOCK_B)
    for b0 in range(0, NBLOCKS, BLOCK_B):
        tl.store(block_expert_ptr + b0 + b, -1, mask=b0 + b < NBLOCKS)
    tl.debug_barrier()  # the padding first, then the pairs and markers over it
    tl.store(block_expert_ptr + begin // BLOCK_M, e, mask=(padded > 0) & (e < E))
    cursor = begin
    for p0 in range(0, num_pairs, CHUNK):
        valid = p0 + c < num_pairs
        ids = tl.load(ids_ptr + p0 + c, mask=valid, other=E).to(tl.int32)
        key = tl.sort(ids * CHUNK + c)  # by expert, then pair: the pairs past the end last
        expert = key // CHUNK
        hist = tl.histogram(ids, BLOCK_E, mask=valid)
        first = cursor - (tl.cumsum(hist, axis=0) - hist)  # row of sorted position 0, per expert
        dest = tl.gather(first, tl.minimum(expert, BLOCK_E - 1), 0) + c
        tl.store(table_ptr + dest, p0 + key % CHUNK, mask=expert < E)
        cursor += hist
    tl.debug_barrier()  # the markers, then their running max
    used = tl.sum(padded, axis=0) // BLOCK_M
    carry = tl.full([], -1, tl.int32)
    for b0 in range(0, NBLOCKS, BLOCK_B):
        mask = b0 + b < NBLOCKS
        marks = tl.load(block_expert_ptr + b0 + b, mask=mask, other=-1)
        run = tl.maximum(tl.associative_scan(marks, 0, _running_max), carry)
        carry = tl.max(run, axis=0)
        tl.store(block_expert_ptr + b0 + b, tl.where(b0 + b < used, run, -1), mask=mask)


ALIGN_CHUNK = 1024  # pairs sorted at a time: registers stay bounded at prefill sizes
# Above this many pairs (prefill) `align` takes the torch path: the one program walks the pairs
# in ALIGN_CHUNK steps on one SM, a sort per chunk, while torch's radix sort and scatters spread
# over the GPU for a fixed ~10 launches, so past some size torch wins (kernel_checks
# `time_moe_align` times both up to 65,536 pairs to move this limit).
ALIGN_KERNEL_MAX_PAIRS = 8192


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks `align` fills: each used expert wastes under one block."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids `[T, k]` -> (pair index per row `[blocks * block_m]`, padded with T*k;
    expert per block `[blocks]`, -1 past the used ones). Device ops only, no sync. A pair's
    rows within its expert's follow the pair index (the grouped GEMM's order)."""
    if ids.numel() <= ALIGN_KERNEL_MAX_PAIRS:
        return align_kernel(ids, num_experts, block_m)
    return align_reference(ids, num_experts, block_m)


def align_kernel(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` by `_align_kernel`, one launch of one program, at any size."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    nblocks = max_blocks(pairs, num_experts, block_m)
    table = torch.empty(nblocks * block_m, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=ids.device)
    launch = align_launch(pairs, num_experts, block_m)
    _align_kernel[(1,)](flat, table, block_expert, pairs, num_experts, nblocks, **launch)
    return table, block_expert


def align_launch(num_pairs: int, num_experts: int, block_m: int) -> dict:
    """`_align_kernel`'s constants and warps for a call (compile_check.py builds from it too)."""
    chunk = min(next_power_of_2(max(num_pairs, 16)), ALIGN_CHUNK)
    nblocks = max_blocks(num_pairs, num_experts, block_m)
    return dict(
        CHUNK=chunk, BLOCK_E=next_power_of_2(num_experts),
        BLOCK_B=min(next_power_of_2(nblocks), ALIGN_CHUNK), BLOCK_M=block_m,
        num_warps=4 if chunk <= 512 else 8,
    )  # fmt: skip


def align_reference(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` in torch ops (a stable argsort by expert): the kernel's oracle and large calls' path."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    nblocks = max_blocks(pairs, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # where each expert's pairs begin in `order`
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=ids.device) - start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    table = torch.full((nblocks * block_m,), pairs, dtype=torch.int64, device=ids.device)
    table.scatter_(0, dest, order)
    block_start = torch.arange(nblocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return table, block_expert.to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    w: ExpertWeight,
    out: torch.Tensor,
    table: torch.Tensor,
    block_expert: torch.Tensor,
    a_div: int,
    scale: torch.Tensor | None,
    cfg: MoeConfig,
) -> None:
    """out[pair] = a[pair // a_div] @ w[expert].T (times `scale[pair]`), per block of the table;
    FP8 experts walk K in 128-steps, `a` quantized per 1 x 128 group first if `cfg.fp8_inputs`."""
    n, k = w.shape[1], w.shape[2]
    fmt, data, w_scale, a_scale = PLAIN, w, out, out  # stand-ins where a format has no scales
    if isinstance(w, Fp8Weight):
        fmt, data, w_scale = (FP8 if cfg.fp8_inputs else FP8_W8A16), w.data, w.scale
        if cfg.fp8_inputs:
            a, a_scale = quantize_groups(a)
        cfg = replace(cfg, block_k=GROUP)
    elif isinstance(w, Mxfp4Weight):
        fmt, data, w_scale = MXFP4, w.data.view(torch.uint8), w.scale
        if w_scale.dtype == getattr(torch, "float8_e8m0fnu", None):
            w_scale = w_scale.view(torch.uint8)
    e8m0 = w_scale.dtype == torch.uint8
    decode = E2M1_INTEGER
    if (
        fmt == MXFP4 and e8m0 and cfg.e2m1_ptx and a.dtype == torch.bfloat16 and a.is_cuda
        and compiled(_moe_gemm_kernel)
    ):  # fmt: skip
        decode = E2M1_PTX_FOLDED if cfg.e2m1_fold and w.small_scales else E2M1_PTX
    grid = (block_expert.numel(), cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, data, out, table, block_expert, scale if scale is not None else out, a_scale, w_scale,
        out.shape[0], n, k, a.stride(0), data.stride(0), data.stride(1), data.stride(2),
        out.stride(0), a_scale.stride(0), *(w_scale.stride() if fmt else (0, 0, 0)),
        A_DIV=a_div, SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32: unused by 16-bit inputs
        WFMT=fmt, SCALE_N=w.block[0] if fmt in (FP8, FP8_W8A16) else 1, E8M0=e8m0, PTX=decode,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    gate_up: ExpertWeight,
    down: ExpertWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    cfg: MoeConfig | None = None,
    add: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    configs: Callable[[int, ExpertWeight], MoeConfig] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down[e](silu(gate[e] x_t) * up[e] x_t) over e = ids[t, j].
    x `[T, H]`, gate_up `[E, 2I, H]` (gate rows first), down `[E, H, I]`, weights/ids `[T, k]`.
    `cfg` None: `configs(pairs, gate_up)`'s (None: `default_config`'s, narrow for decode-sized
    calls, wider for prefill). `add` `[T, H]` (the shared experts' output) is added to the
    result in the same launch as the slot sum,
    with the values of a separate `out + add`. `swiglu_limit` (DeepSeek-V4): gate clamped above
    and up on both sides at it before silu(gate) * up. gate_up and down may be kernels/
    block_quant.py's `Fp8Weight` (activations then quantized per 1 x 128 group, K in 128-steps)
    or `Mxfp4Weight` (dequantized to x's dtype in the kernel), each of the same [E, N, K]."""
    tokens, topk = ids.shape
    pairs = tokens * topk
    if cfg is None:
        if configs is None:
            cfg = default_config(pairs, gate_up.shape[0], isinstance(gate_up, Mxfp4Weight))
        else:
            cfg = configs(pairs, gate_up)
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype or add.stride(-1) != 1):
        return fused_moe(x, gate_up, down, weights, ids, cfg, swiglu_limit=swiglu_limit) + add
    if pairs == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    x = x.contiguous()
    table, block_expert = align(ids, gate_up.shape[0], cfg.block_m)
    inter = torch.empty(pairs, gate_up.shape[1], device=x.device, dtype=x.dtype)
    _grouped_gemm(x, gate_up, inter, table, block_expert, topk, None, cfg)
    # silu(gate) * up in its own launch: fused into the down GEMM's loads it is recomputed for
    # every column tile, which measured slower at every batch size
    act = silu_mul(inter, swiglu_limit)
    y = torch.empty(pairs, down.shape[1], device=x.device, dtype=x.dtype)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, down, y, table, block_expert, 1, scale, cfg)
    out = torch.empty(tokens, down.shape[1], device=x.device, dtype=x.dtype)
    block = min(1024, next_power_of_2(out.shape[1]))
    _sum_slots_kernel[(tokens, cdiv(out.shape[1], block))](
        y, out if add is None else add, out, out.shape[1], 0 if add is None else add.stride(0),
        TOPK=topk, ADD=add is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: ExpertWeight,
    down: ExpertWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    swiglu_limit: float | None = None,
    fp8_inputs: bool = True,
) -> torch.Tensor:
    """The same function as a loop over (token, slot) in float32: the tests' oracle. Quantized
    experts are dequantized; FP8 ones also see their inputs as e4m3 per 1 x 128 group, as the
    kernel does under a config's `fp8_inputs`."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    quantized = isinstance(gate_up, Fp8Weight) and fp8_inputs
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = _expert(gate_up, e) @ _as_fp8_groups(x[t].float(), quantized)
            gate, up = gu.chunk(2)
            if swiglu_limit:
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            act = _as_fp8_groups(F.silu(gate) * up, quantized)
            out[t] += float(weights[t, j]) * (_expert(down, e) @ act)
    return out


def _expert(w: ExpertWeight, e: int) -> torch.Tensor:
    """Expert e's matrix in float32, dequantized alone (a whole layer's would not fit)."""
    return w[e].float() if isinstance(w, torch.Tensor) else w[e].dequantize()


def _as_fp8_groups(v: torch.Tensor, quantized: bool) -> torch.Tensor:
    """A row as the FP8 kernel reads it: its per-128 e4m3 codes times their scales."""
    if not quantized:
        return v
    q, s = quantize_groups_reference(v[None])
    return (q.float() * s.repeat_interleave(GROUP, dim=1)[:, : v.shape[0]])[0]
