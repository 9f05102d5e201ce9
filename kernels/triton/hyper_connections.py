"""DeepSeek-V4's hyper-connections in one launch each: the mixes (the RMS-normed streams times
`fn`), the collapse of the residual streams into a block's input (with the Sinkhorn-normalised
stream mix), the expansion of the block's output back into the streams, and the hyper head's
collapse.

They mirror `DeepseekV4ForCausalLM._hc_mixes`, `_hc_collapse`, `_hc_expand` and `_hyper_head`
(engine/models/deepseek_v4.py), which compose the same maths from ~90 small torch ops per
hyper-connection (the Sinkhorn passes are most of them). The mixes are a skinny GEMM (`fn` has
(2 + n) * n = 24 rows over n * hidden = 16,384 inputs): the composition ran a float32 cast, a norm
and cuBLAS's sgemm + split-K reduce (4 launches, ~24 us a call at batch 64 on the H200); here one
launch cuts K into MIX_SPLITS fixed runs, each program also sums its rows' squares, and the last
program of a row block adds the partials in split order and applies the norm's scale (the
counters of fp8_gemv.py). The norm's scale is applied after the product, not to each input: the
same sum up to rounding.

Every program owns one token (and one block of hidden columns): the 4 x 4 Sinkhorn tile lives in
registers, stream sums run in stream order, so a token's result never depends on the batch.
Sums over the n streams are in float32 and rounded once to the streams' dtype (the torch
composition rounds each bf16 product and partial sum; float32 inputs give its results).
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.fp8_gemv import counters
from deepserve.kernels.triton.lang import cdiv, constexpr, jit, next_power_of_2, tl

BLOCK = 1024  # hidden columns per program: V4-Flash's 4096 spreads a decode token over 4 SMs
# The mixes: K runs a row block's sum is cut into, fixed whatever the rows (so a row's bits never
# depend on its batch): 32 x 4 steps of 128 at V4-Flash's 16,384 inputs, 128 programs at batch 64
MIX_SPLITS = 32
MIX_BLOCK_M = 16  # rows per program: tl.dot's least M
MIX_BLOCK_K = 128
# float32 products on tensor cores, each operand split in two TF32 halves (three products): float32's
# accuracy; the "ieee" FMA dot ran a V4-Flash decode call in ~27 us on the H100 (run-gpu19-1)
MIX_PRECISION = "tf32x3"


@jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def _sinkhorn(mix_ptr, scale_ptr, base_ptr, comb_ptr, iters, eps, N: constexpr, N_P2: constexpr):
    """comb = softmax(mixes' n x n block, rows) + eps, then `iters` column passes and
    `iters - 1` row passes between them, each `comb / (sum + eps)`: the model's `_sinkhorn`."""
    r = tl.arange(0, N_P2)[:, None]
    c = tl.arange(0, N_P2)[None, :]
    valid = (r < N) & (c < N)
    at = 2 * N + r * N + c
    logit = tl.load(mix_ptr + at, mask=valid, other=0.0) * tl.load(
        scale_ptr + at, mask=valid, other=0.0
    ) + tl.load(base_ptr + at, mask=valid, other=0.0)
    logit = tl.where(valid, logit, float("-inf"))
    p = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    comb = p / tl.sum(p, axis=1)[:, None] + eps
    comb = tl.where(valid, comb, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + r * N + c, comb, mask=valid)


@jit
def _collapse_kernel(
    mix_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, x_ptr, HIDDEN, s_m, s_ht, s_hn,
    s_xt, iters, eps, N: constexpr, N_P2: constexpr, MIX: constexpr, BLOCK: constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    mix_ptr += t * s_m
    i = tl.arange(0, N_P2)
    valid = i < N
    m = tl.load(mix_ptr + i, mask=valid, other=0.0)
    pre = _sigmoid(m * tl.load(scale_ptr + i, mask=valid) + tl.load(base_ptr + i, mask=valid))
    pre = pre + eps
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(N):  # stream order, as the model's sum over dim 1
        weight = tl.sum(tl.where(i == s, pre, 0.0), axis=0)
        h = tl.load(h_ptr + t * s_ht + s * s_hn + cols, mask=in_row, other=0.0).to(tl.float32)
        acc += weight * h
    tl.store(x_ptr + t * s_xt + cols, acc.to(x_ptr.dtype.element_ty), mask=in_row)
    if MIX:  # noqa: SIM102  (a constexpr: Triton resolves it at compile time)
        if blk == 0:  # one program a token writes post and the Sinkhorn mix
            at = N + i
            m = tl.load(mix_ptr + at, mask=valid, other=0.0)
            post = 2 * _sigmoid(
                m * tl.load(scale_ptr + at, mask=valid) + tl.load(base_ptr + at, mask=valid)
            )
            tl.store(post_ptr + t * N + i, post, mask=valid)
            _sinkhorn(mix_ptr, scale_ptr, base_ptr, comb_ptr + t * N * N, iters, eps, N, N_P2)


@jit(do_not_specialize=["T"])
def _mixes_kernel(
    h_ptr, fn_ptr, part_ptr, sq_ptr, y_ptr, count_ptr, T, M, K, steps, s_ht, s_fm, eps,
    SPLITS: constexpr, BLOCK_M: constexpr, BLOCK_K: constexpr, M_P2: constexpr,
    PRECISION: constexpr,
):  # fmt: skip
    """Partial products and squares of rows `program_id(0)`'s block over K run `program_id(1)`;
    the last program of a row block to finish adds the SPLITS partials in split order and
    writes `y = (sum x * fn) * rsqrt(sum x^2 / K + eps)`, then zeroes its counter."""
    pm, split = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < T
    rows = tl.minimum(rm, T - 1).to(tl.int64)  # rows past T repeat a real one (never stored)
    cols = tl.arange(0, M_P2)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, M_P2), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    first = split * steps
    for kb in range(first, tl.minimum(first + steps, tl.cdiv(K, BLOCK_K))):
        kk = kb * BLOCK_K + rk
        x = tl.load(h_ptr + rows[:, None] * s_ht + kk[None, :], mask=kk[None, :] < K, other=0.0)
        x = x.to(tl.float32)
        w_ok = (kk[:, None] < K) & (cols[None, :] < M)
        w = tl.load(fn_ptr + cols[None, :] * s_fm + kk[:, None], mask=w_ok, other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32)
        sq += tl.sum(x * x, axis=1)
    part = split * T + rm  # partials [SPLITS, T, M_P2] and squares [SPLITS, T]
    tl.store(part_ptr + part[:, None] * M_P2 + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + part, sq, mask=row_ok)
    tl.debug_barrier()  # every thread's partial stored before the count releases them
    done = tl.atomic_add(count_ptr + pm, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        at = rm[:, None] * M_P2 + cols[None, :]
        total = tl.load(part_ptr + at, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        squares = tl.load(sq_ptr + rm, mask=row_ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):  # unrolled: the loads in flight together
            total += tl.load(
                part_ptr + s * T * M_P2 + at, mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
            )
            squares += tl.load(sq_ptr + s * T + rm, mask=row_ok, other=0.0, cache_modifier=".cg")
        scale = 1.0 / tl.sqrt_rn(squares / K + eps)
        keep = row_ok[:, None] & (cols[None, :] < M)
        tl.store(y_ptr + rm[:, None] * M + cols[None, :], total * scale[:, None], mask=keep)
        tl.atomic_xchg(count_ptr + pm, 0, sem="relaxed", scope="gpu")


@jit
def _expand_kernel(
    h_ptr, out_ptr, post_ptr, comb_ptr, y_ptr, HIDDEN, s_ht, s_hn, s_ot, s_yt, s_yn,
    N: constexpr, N_P2: constexpr, BLOCK: constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    j = tl.arange(0, N_P2)
    valid = j < N
    comb_ptr += t * N * N
    h = tl.load(h_ptr + t * s_ht + cols, mask=in_row, other=0.0).to(tl.float32)
    mixed = tl.load(comb_ptr + j, mask=valid, other=0.0)[:, None] * h[None, :]
    for i in tl.static_range(1, N):  # stream order, as the model's `_hc_expand`
        h = tl.load(h_ptr + t * s_ht + i * s_hn + cols, mask=in_row, other=0.0).to(tl.float32)
        mixed = mixed + tl.load(comb_ptr + i * N + j, mask=valid, other=0.0)[:, None] * h[None, :]
    post = tl.load(post_ptr + t * N + j, mask=valid, other=0.0)
    out = tl.load(out_ptr + t * s_ot + cols, mask=in_row, other=0.0).to(tl.float32)
    y = post[:, None] * out[None, :] + mixed
    at = y_ptr + t * s_yt + j[:, None] * s_yn + cols[None, :]
    tl.store(at, y.to(y_ptr.dtype.element_ty), mask=valid[:, None] & in_row[None, :])


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _collapse(mixes, scale, base, h, iters, eps, mix: bool):
    tokens, n, hidden = h.shape
    h, mixes = _inner_contiguous(h), _inner_contiguous(mixes.float())
    x = torch.empty(tokens, hidden, device=h.device, dtype=h.dtype)
    post = torch.empty(tokens, n, device=h.device, dtype=torch.float32)
    comb = torch.empty(tokens, n, n, device=h.device, dtype=torch.float32)
    if tokens:
        block = min(BLOCK, next_power_of_2(hidden))
        _collapse_kernel[(tokens, cdiv(hidden, block))](
            mixes, scale, base, h, post, comb, x, hidden, mixes.stride(0), h.stride(0),
            h.stride(1), x.stride(0), iters, eps, N=n, N_P2=next_power_of_2(n), MIX=mix,
            BLOCK=block,
        )  # fmt: skip
    return post, comb, x


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Streams h `[T, n, hidden]` (any float dtype), fn `[M, n * hidden]` float32 ->
    `rms_norm(h.flatten(1).float()) @ fn.T`, `[T, M]` float32, the norm unweighted."""
    tokens = h.shape[0]
    flat = _inner_contiguous(h.reshape(tokens, -1))
    m, k = fn.shape
    y = torch.empty(tokens, m, device=h.device, dtype=torch.float32)
    if tokens == 0:
        return y
    m_p2 = max(16, next_power_of_2(m))
    part = torch.empty(MIX_SPLITS, tokens, m_p2, device=h.device, dtype=torch.float32)
    sq = torch.empty(MIX_SPLITS, tokens, device=h.device, dtype=torch.float32)
    blocks = cdiv(tokens, MIX_BLOCK_M)
    fn = _inner_contiguous(fn.float())
    _mixes_kernel[(blocks, MIX_SPLITS)](
        flat, fn, part, sq, y, counters(h.device, blocks), tokens, m, k,
        cdiv(cdiv(k, MIX_BLOCK_K), MIX_SPLITS), flat.stride(0), fn.stride(0), eps,
        SPLITS=MIX_SPLITS, BLOCK_M=MIX_BLOCK_M, BLOCK_K=MIX_BLOCK_K, M_P2=m_p2,
        PRECISION=MIX_PRECISION,
    )  # fmt: skip
    return y


def hc_collapse(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    h: torch.Tensor,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes `[T, (2 + n) * n]` f32 (the normed streams times `fn`), scale and base
    `[(2 + n) * n]` f32 (the pre, post and comb scales spread over the mixes' columns, as the
    model holds them), streams h `[T, n, hidden]` -> (post `[T, n]` f32, comb `[T, n, n]` f32,
    the block's input `[T, hidden]` in h's dtype)."""
    return _collapse(mixes, scale, base, h, iters, eps, mix=True)


def hc_head(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, h: torch.Tensor, eps: float
) -> torch.Tensor:
    """The hyper head: mixes `[T, n]`, scale and base `[n]`, streams h `[T, n, hidden]` ->
    `sum_i (sigmoid(mixes * scale + base)_i + eps) * h_i`, `[T, hidden]` in h's dtype."""
    return _collapse(mixes, scale, base, h, 0, eps, mix=False)[2]


def hc_expand(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Streams h `[T, n, hidden]`, the block's output `[T, hidden]`, post `[T, n]` and comb
    `[T, n, n]` f32 -> stream j = `post[j] * out + sum_i comb[i, j] * h[i]`, `[T, n, hidden]`."""
    tokens, n, hidden = h.shape
    h, out = _inner_contiguous(h), _inner_contiguous(out)
    post, comb = post.float().contiguous(), comb.float().contiguous()
    y = torch.empty(tokens, n, hidden, device=h.device, dtype=h.dtype)
    if tokens:
        block = min(BLOCK // next_power_of_2(n), next_power_of_2(hidden))
        _expand_kernel[(tokens, cdiv(hidden, block))](
            h, out, post, comb, y, hidden, h.stride(0), h.stride(1), out.stride(0), y.stride(0),
            y.stride(1), N=n, N_P2=next_power_of_2(n), BLOCK=block,
        )  # fmt: skip
    return y
