"""Prefill attention of a bfloat16 model through torch's SDPA on CPUs with AMX, for the default CPU
set: a sequence's run of at least `SDPA_MIN_QUERIES` queries in a step gathers its keys and values
from the paged cache and takes `F.scaled_dot_product_attention` (torch's flash kernel, on AMX
tiles there); every other sequence of the step (decode rows, short chunks) takes the native
kernel in one call, as before.

Measured on a 2-core Xeon with AMX (one thread, CPU time, 9 query / 3 KV heads of 64, bf16):
a fresh 1,024-token prompt 5.9 ms a layer against the native kernel's 14.1, 4,096 tokens 68
against 218; 1,024 queries after 1,024 cached tokens 19.8 ms (the mask path); 128 queries
0.21 against 0.26. In float32 the native kernel is as fast or faster (11.7 vs 15.7 ms at
1,024), so float32 models keep it.

What does not live here: the native kernel (kernels/cpu/csrc/attention.cpp), the choice of the
set (kernels/cpu/kernelset.py), and anything of `--batch-invariant`: SDPA's reduction order
depends on the query count, so the flag's sets never route here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels.attention_metadata import AttentionMetadata

SDPA_MIN_QUERIES = 128  # from here on SDPA was faster (128 queries: 0.21 vs 0.26 ms a layer)

Attention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


def covers(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bfloat16 queries over a bfloat16 cache whose K and V rows have one shape (MHA / GQA; an
    MLA cache, V a slice of K's latent, keeps the native kernel)."""
    return (
        q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        and k_cache.shape[2:] == v_cache.shape[2:]
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    native: Attention,
) -> torch.Tensor:
    """`native`'s function: sequences with `SDPA_MIN_QUERIES` queries or more through SDPA, the
    rest through `native` in one call over their own metadata."""
    plan = attn.scratch.get("sdpa_prefill")
    if plan is None:  # once per step, shared by every layer
        plan = attn.scratch["sdpa_prefill"] = _plan(attn)
    if not plan.long:
        return native(q, k_cache, v_cache, attn, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for i, mask in zip(plan.long, plan.masks, strict=True):
        rows = slice(plan.starts[i], plan.starts[i + 1])
        out[rows] = _sdpa(q[rows], k_cache, v_cache, attn, i, mask, scale)
    if plan.short is not None:
        out[plan.short_rows] = native(q[plan.short_rows], k_cache, v_cache, plan.short, scale)
    return out


@dataclass(frozen=True)
class _Plan:
    """One step's split between SDPA and the native kernel."""

    long: list[int]  # sequences of `SDPA_MIN_QUERIES` queries or more
    starts: list[int]  # each sequence's first row of the step (and the end)
    masks: list[torch.Tensor | None]  # per long run: None, causal from position 0
    short: AttentionMetadata | None  # the other sequences' own metadata, if any beside long runs
    short_rows: torch.Tensor | None  # ... and their rows of the step


def _plan(attn: AttentionMetadata) -> _Plan:
    long = [i for i, n in enumerate(attn.query_lens_cpu) if n >= SDPA_MIN_QUERIES]
    starts = list(itertools.accumulate(attn.query_lens_cpu, initial=0))
    # with context, the lower-right mask: query r sees keys up to ctx + r
    masks = [
        None
        if attn.context_lens_cpu[i] == 0
        else torch.ones(attn.query_lens_cpu[i], attn.seq_lens_cpu[i], dtype=torch.bool).tril(
            diagonal=attn.context_lens_cpu[i]
        )
        for i in long
    ]
    others = sorted(set(range(attn.num_seqs)) - set(long))
    short, rows = _subset(attn, others, starts) if others and long else (None, None)
    return _Plan(long, starts, masks, short, rows)


def _sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    seq: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Sequence `seq`'s queries `q [n, Hq, D]` over its cached keys: causal (the flag, whose
    kernel skips masked blocks) without context, under `mask` with it."""
    total = attn.seq_lens_cpu[seq]
    blocks = attn.block_tables[seq, : -(-total // attn.block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:total].transpose(0, 1)  # [Hkv, total, D]
    v = v_cache[blocks].flatten(0, 1)[:total].transpose(0, 1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


def _subset(
    attn: AttentionMetadata, seqs: list[int], starts: list[int]
) -> tuple[AttentionMetadata, torch.Tensor]:
    """`attn` restricted to sequences `seqs` (their query rows renumbered from 0), and the rows
    of the step they own (`starts`: each sequence's first row)."""
    index = torch.tensor(seqs, dtype=torch.long)
    query_lens = [attn.query_lens_cpu[i] for i in seqs]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
    sub = AttentionMetadata(
        query_start_loc=torch.tensor(
            list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32
        ),
        seq_lens=attn.seq_lens[index],
        context_lens=attn.context_lens[index],
        slot_mapping=attn.slot_mapping[rows],
        block_tables=attn.block_tables[index],
        block_size=attn.block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=[attn.seq_lens_cpu[i] for i in seqs],
        context_lens_cpu=[attn.context_lens_cpu[i] for i in seqs],
    )
    return sub, rows
