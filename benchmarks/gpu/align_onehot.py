"""The fused MoE's previous `align` kernel (one program over a [pairs, experts] one-hot, up to
`CELLS` cells), kept only as the baseline kernel_checks.py's `time_moe_align` times the
sort-based `_align_kernel` against; not used by the engine."""

from __future__ import annotations

import torch

from deepserve.kernels.triton.fused_moe import max_blocks
from deepserve.kernels.triton.lang import constexpr, jit, next_power_of_2, tl

CELLS = 32768  # one-hot cells up to which `align` took this kernel


@jit
def _align_onehot_kernel(
    ids_ptr, table_ptr, block_expert_ptr, num_pairs, E, NBLOCKS,
    BLOCK_P: constexpr, BLOCK_E: constexpr, BLOCK_B: constexpr, BLOCK_M: constexpr,
):  # fmt: skip
    p = tl.arange(0, BLOCK_P)
    e = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    begin = padded_end - padded
    rank = tl.cumsum(onehot, axis=0) - 1
    dest = tl.sum(onehot * (begin[None, :] + rank), axis=1)
    for r0 in range(0, NBLOCKS * BLOCK_M, BLOCK_P):
        tl.store(table_ptr + r0 + p, num_pairs, mask=r0 + p < NBLOCKS * BLOCK_M)
    tl.debug_barrier()
    tl.store(table_ptr + dest, p, mask=p < num_pairs)
    b = tl.arange(0, BLOCK_B)
    ends = tl.where(e[None, :] < E, padded_end[None, :], 1 << 30)
    expert = tl.sum((ends <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b < NBLOCKS)


def fits(pairs: int, num_experts: int) -> bool:
    return next_power_of_2(pairs) * next_power_of_2(num_experts) <= CELLS


def align_onehot(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old one-program `align`, only where `fits`."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    nblocks = max_blocks(pairs, num_experts, block_m)
    table = torch.empty(nblocks * block_m, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(nblocks, dtype=torch.int32, device=ids.device)
    _align_onehot_kernel[(1,)](
        flat, table, block_expert, pairs, num_experts, nblocks,
        BLOCK_P=next_power_of_2(pairs), BLOCK_E=next_power_of_2(num_experts),
        BLOCK_B=next_power_of_2(nblocks), BLOCK_M=block_m, num_warps=8,
    )  # fmt: skip
    return table, block_expert
