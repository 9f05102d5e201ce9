"""Row-per-program kernels: RMSNorm (alone and fused with the residual add), SwiGLU's
silu(gate) * up, softmax and log_softmax over the last dim.

One program owns one row and reduces it in a fixed order (a vector of per-lane partials over
fixed-size chunks, then one tree sum), so a row's result depends on its length and values only.
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl

CHUNK = 2048  # columns per step in softmax rows (vocabularies run to 129K)


@jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, s_x, s_y, eps, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride may pass 2^31
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    # cast back before the weight, as the reference (and HF) do
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, (w * y).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _softmax_kernel(x_ptr, y_ptr, D, s_x, s_y, LOG: constexpr, CHUNK: constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride may pass 2^31
    cols = tl.arange(0, CHUNK)
    x_row = x_ptr + row * s_x
    peak = tl.full((CHUNK,), float("-inf"), tl.float32)
    for c0 in range(0, D, CHUNK):
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < D, other=float("-inf")).to(tl.float32)
        peak = tl.maximum(peak, x)
    m = tl.max(peak, axis=0)  # exact in any order
    total = tl.zeros((CHUNK,), tl.float32)
    for c0 in range(0, D, CHUNK):
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < D, other=float("-inf")).to(tl.float32)
        total += tl.exp(x - m)
    s = tl.sum(total, axis=0)
    for c0 in range(0, D, CHUNK):
        mask = c0 + cols < D
        x = tl.load(x_row + c0 + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = (x - m) - tl.log(s) if LOG else tl.exp(x - m) / s
        tl.store(y_ptr + row * s_y + c0 + cols, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat = _rows(x)
    out = torch.empty_like(flat, dtype=torch.promote_types(x.dtype, weight.dtype))
    if flat.shape[0]:
        block = next_power_of_2(flat.shape[1])
        _rms_norm_kernel[(flat.shape[0],)](
            flat, weight, out, flat.shape[1], flat.stride(0), out.stride(0), eps, BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out.view(x.shape)


@jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, y_ptr, D, s_h, s_d, s_y, eps, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride may pass 2^31
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = tl.load(h_ptr + row * s_h + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * s_d + cols, mask=mask, other=0.0).to(tl.float32)
    s = (h + d).to(h_ptr.dtype.element_ty)  # rounded as torch's `h + delta` rounds
    tl.store(h_ptr + row * s_h + cols, s, mask=mask)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, (w * y).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """`h += delta` in place and rms_norm of the result, in one launch (the same values as the
    add then `rms_norm`); None (h untouched) unless both are row-contiguous of one shape and
    dtype."""
    if delta.shape != h.shape or delta.dtype != h.dtype or not h.is_contiguous():
        return None
    if delta.stride(-1) != 1 or h.dim() < 1 or h.numel() == 0:
        return None
    flat, d = h.view(-1, h.shape[-1]), delta.reshape(-1, h.shape[-1])
    out = torch.empty_like(flat, dtype=torch.promote_types(h.dtype, weight.dtype))
    block = next_power_of_2(flat.shape[1])
    _add_rms_norm_kernel[(flat.shape[0],)](
        flat, d, weight, out, flat.shape[1], flat.stride(0), d.stride(0), out.stride(0), eps,
        BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return out.view(h.shape)


SILU_BLOCK = 1024


@jit
def _silu_mul_kernel(x_ptr, y_ptr, N, s_x, s_y, limit, LIMIT: constexpr, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x stride may pass 2^31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    if LIMIT:  # clamping is exact, so in float32 it equals torch's clamp of the stored values
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu
    tl.store(y_ptr + row * s_y + cols, (act * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor | None:
    """silu(gate) * up for `gate_up = [gate | up]` in one launch; None for a strided last dim.
    `limit` (DeepSeek-V4's clamped SwiGLU): gate clamped above and up on both sides at it first."""
    if gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        return None
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    n = flat.shape[1] // 2
    out = torch.empty(flat.shape[0], n, device=flat.device, dtype=flat.dtype)
    if flat.shape[0]:
        grid = (flat.shape[0], -(-n // SILU_BLOCK))
        _silu_mul_kernel[grid](
            flat, out, n, flat.stride(0), out.stride(0), float(limit or 0.0),
            LIMIT=bool(limit), BLOCK=SILU_BLOCK,
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], n)


def _softmax(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    moved = x.movedim(dim, -1)
    flat = _rows(moved)
    out = torch.empty(flat.shape, device=x.device, dtype=torch.float32)
    if flat.shape[0]:
        _softmax_kernel[(flat.shape[0],)](
            flat, out, flat.shape[1], flat.stride(0), out.stride(0), LOG=log,
            CHUNK=min(CHUNK, next_power_of_2(flat.shape[1])), num_warps=8,
        )  # fmt: skip
    return out.view(moved.shape).movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _softmax(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _softmax(x, dim, log=True)
