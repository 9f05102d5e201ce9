"""Which sequences of a step take MLA's prefill in the decompressed form, and the per-step plan for
them (`plan_step`): the chunks of at least `DECOMPRESS_MIN_TOKENS` fresh tokens, their query rows,
the cache rows of their whole contexts (gathered, then decompressed by the model), and the
metadata of the other rows (decodes and small chunks), which stay in the absorbed form.

What does not live here: the attention itself (engine/models/deepseek_v3.py composes it from the
KernelSet's `flash_prefill` and `paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata, CausalVarlen

# Decompressing a context key costs 2 * kv_lora * (nope + v) = 2 * 512 * 256 flops per head, paid
# once per chunk for every key the chunk sees; the decompressed form then saves
# 2 * ((kv_lora + rope) + kv_lora - (nope + rope) - v) = 2 * 768 flops per (query, key, head) over
# the absorbed form, on tensor cores at a higher rate. Below ~170 fresh queries the decompression
# is not paid back even at equal rates; 256 leaves a margin. Decode rows and small chunks
# (speculative drafts, a long prompt's last piece) stay absorbed, in their own launch, so a mixed
# step never decompresses the contexts of its decodes.
DECOMPRESS_MIN_TOKENS = 256


@dataclass
class DecompressPlan:
    """One step's split, built once and reused by every layer (kept in `attn.scratch`)."""

    varlen: CausalVarlen  # the long chunks: queries in step order, keys = their whole contexts
    key_slots: torch.Tensor  # [L] int64 cache rows (block * block_size + offset) of those keys
    rows: torch.Tensor | None  # [T_long] their query rows in the step; None: every row
    short_rows: torch.Tensor | None  # the other rows; None when there are none
    short_attn: AttentionMetadata | None  # the other sequences' metadata (absorbed form)


def plan_step(attn: AttentionMetadata, min_tokens: int) -> DecompressPlan | None:
    """The step's plan, or None when no sequence brings `min_tokens` fresh tokens."""
    key = ("mla_decompress", min_tokens)
    if key not in attn.scratch:
        long = [i for i, n in enumerate(attn.query_lens_cpu) if n >= min_tokens]
        attn.scratch[key] = _build(attn, long) if long else None
    return attn.scratch[key]


def _build(attn: AttentionMetadata, long: list[int]) -> DecompressPlan:
    device = attn.query_start_loc.device
    starts = [0, *accumulate(attn.query_lens_cpu)]
    short = [i for i in range(attn.num_seqs) if i not in set(long)]
    rows = [r for i in long for r in range(starts[i], starts[i + 1])]
    short_rows = [r for i in short for r in range(starts[i], starts[i + 1])]

    def on_device(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    qlens = [attn.query_lens_cpu[i] for i in long]
    varlen = CausalVarlen(
        query_start_loc=on_device([0, *accumulate(qlens)]),
        key_start_loc=on_device([0, *accumulate(attn.seq_lens_cpu[i] for i in long)]),
        context_lens=on_device([attn.context_lens_cpu[i] for i in long]),
        query_lens_cpu=qlens,
    )
    return DecompressPlan(
        varlen=varlen,
        key_slots=torch.cat([_context_slots(attn, i) for i in long]),
        rows=on_device(rows, torch.int64) if short else None,
        short_rows=on_device(short_rows, torch.int64) if short else None,
        short_attn=_subset(attn, short, short_rows, on_device) if short else None,
    )


def _context_slots(attn: AttentionMetadata, seq: int) -> torch.Tensor:
    """Cache rows of sequence `seq`'s keys 0 .. seq_len - 1 (its cached context and this step's)."""
    pos = torch.arange(attn.seq_lens_cpu[seq], device=attn.block_tables.device)
    blocks = attn.block_tables[seq].long()[pos // attn.block_size]
    return blocks * attn.block_size + pos % attn.block_size


def _subset(
    attn: AttentionMetadata, seqs: list[int], rows: list[int], on_device
) -> AttentionMetadata:
    """The metadata of sequences `seqs` alone, their query rows `rows` renumbered from 0."""
    qlens = [attn.query_lens_cpu[i] for i in seqs]
    index = on_device(seqs, torch.int64)
    return AttentionMetadata(
        query_start_loc=on_device([0, *accumulate(qlens)]),
        seq_lens=attn.seq_lens[index],
        context_lens=attn.context_lens[index],
        slot_mapping=attn.slot_mapping[on_device(rows, torch.int64)],
        block_tables=attn.block_tables[index],
        block_size=attn.block_size,
        query_lens_cpu=qlens,
        seq_lens_cpu=[attn.seq_lens_cpu[i] for i in seqs],
        context_lens_cpu=[attn.context_lens_cpu[i] for i in seqs],
    )
