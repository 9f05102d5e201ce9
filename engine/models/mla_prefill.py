"""Which rows of a step take MLA's prefill in the decompressed form, and the per-step plan for
them: by default (`plan_step`) the chunks of at least `DECOMPRESS_MIN_TOKENS` fresh tokens; under
`--batch-invariant` (`plan_by_role`) every prompt row. A plan holds their query rows, the cache
rows of their whole contexts (gathered, then decompressed by the model), and the metadata of the
other rows (decodes, drafts, small chunks), which stay in the absorbed form.

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


@dataclass(frozen=True)
class _Piece:
    """Query rows `skip .. skip + count - 1` of sequence `seq`'s rows in the step."""

    seq: int
    skip: int
    count: int


def plan_step(attn: AttentionMetadata, min_tokens: int) -> DecompressPlan | None:
    """The step's plan, or None when no sequence brings `min_tokens` fresh tokens."""
    key = ("mla_decompress", min_tokens)
    if key not in attn.scratch:
        lens = attn.query_lens_cpu
        long = [_Piece(i, 0, n) for i, n in enumerate(lens) if n >= min_tokens]
        short = [_Piece(i, 0, n) for i, n in enumerate(lens) if n < min_tokens]
        attn.scratch[key] = _build(attn, long, short) if long else None
    return attn.scratch[key]


def plan_by_role(attn: AttentionMetadata) -> DecompressPlan | None:
    """`--batch-invariant`'s plan: every prompt row decompressed and every generated row absorbed
    (`attn.prompt_lens_cpu`), whatever the chunk's length, so that a row's arithmetic is a
    function of its sequence and position alone, never of the chunking or the batch around it.
    A chunk that crosses its prompt's end (a recompute after preemption) is cut there. None when
    the step has no prompt row."""
    key = ("mla_decompress", "role")
    if key not in attn.scratch:
        long, short = [], []
        prompts = attn.prompt_lens_cpu or [0] * attn.num_seqs
        for i, (n, ctx, prompt) in enumerate(
            zip(attn.query_lens_cpu, attn.context_lens_cpu, prompts, strict=True)
        ):
            fresh = min(max(prompt - ctx, 0), n)  # this step's prompt rows, its first ones
            if fresh:
                long.append(_Piece(i, 0, fresh))
            if n > fresh:
                short.append(_Piece(i, fresh, n - fresh))
        attn.scratch[key] = _build(attn, long, short) if long else None
    return attn.scratch[key]


def _build(attn: AttentionMetadata, long: list[_Piece], short: list[_Piece]) -> DecompressPlan:
    device = attn.query_start_loc.device
    starts = list(accumulate(attn.query_lens_cpu, initial=0))

    def step_rows(pieces: list[_Piece]) -> list[int]:
        return [
            r
            for p in pieces
            for r in range(starts[p.seq] + p.skip, starts[p.seq] + p.skip + p.count)
        ]

    def on_device(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    contexts = [attn.context_lens_cpu[p.seq] + p.skip for p in long]
    qlens = [p.count for p in long]
    varlen = CausalVarlen(
        query_start_loc=on_device([0, *accumulate(qlens)]),
        key_start_loc=on_device(
            [0, *accumulate(c + n for c, n in zip(contexts, qlens, strict=True))]
        ),
        context_lens=on_device(contexts),
        query_lens_cpu=qlens,
    )
    rows, short_rows = step_rows(long), step_rows(short)
    return DecompressPlan(
        varlen=varlen,
        key_slots=torch.cat(
            [_context_slots(attn, p.seq, c + p.count) for p, c in zip(long, contexts, strict=True)]
        ),
        rows=on_device(rows, torch.int64) if short else None,
        short_rows=on_device(short_rows, torch.int64) if short else None,
        short_attn=_subset(attn, short, short_rows, on_device) if short else None,
    )


def _context_slots(attn: AttentionMetadata, seq: int, keys: int) -> torch.Tensor:
    """Cache rows of sequence `seq`'s keys 0 .. keys - 1 (its cached context and this step's)."""
    pos = torch.arange(keys, device=attn.block_tables.device)
    blocks = attn.block_tables[seq].long()[pos // attn.block_size]
    return blocks * attn.block_size + pos % attn.block_size


def _subset(
    attn: AttentionMetadata, pieces: list[_Piece], rows: list[int], on_device
) -> AttentionMetadata:
    """The metadata of `pieces` alone, their query rows `rows` renumbered from 0 (a piece that
    skips its sequence's first rows has them as context: they are in the cache by now)."""
    qlens = [p.count for p in pieces]
    contexts = [attn.context_lens_cpu[p.seq] + p.skip for p in pieces]
    seq_lens = [c + n for c, n in zip(contexts, qlens, strict=True)]
    index = on_device([p.seq for p in pieces], torch.int64)
    return AttentionMetadata(
        query_start_loc=on_device([0, *accumulate(qlens)]),
        seq_lens=on_device(seq_lens),
        context_lens=on_device(contexts),
        slot_mapping=attn.slot_mapping[on_device(rows, torch.int64)],
        block_tables=attn.block_tables[index],
        block_size=attn.block_size,
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=contexts,
    )
