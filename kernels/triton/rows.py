"""Row-per-program kernels: RMSNorm, softmax and log_softmax over the last dim.

One program owns one row and reduces it in a fixed order (a vector of per-lane partials over
fixed-size chunks, then one tree sum), so a row's result depends on its length and values only.
"""

from __future__ import annotations

import torch

from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl

CHUNK = 2048  # columns per step in softmax rows (vocabularies run to 129K)


@jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, s_x, s_y, eps, BLOCK: constexpr):
    row = tl.program_id(0)
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
    row = tl.program_id(0)
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
