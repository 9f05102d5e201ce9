"""Which rows of a step are fresh prompts: sequences with nothing in the KV cache before this step
(no prefix-cache hit, not a later chunk), whose attention needs only their own new tokens. MLA runs
those in the decompressed multi-head form and the other rows in the absorbed paged form; this
module splits one step's `AttentionMetadata` between the two, once per step.

A fresh prompt of one token stays with the other rows: it gains nothing from the split, and a
decode step captured in a CUDA graph (all query lengths 1) then never takes the fresh path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata

_SCRATCH_KEY = "fresh_prefill_split"


@dataclass(frozen=True)
class FreshSplit:
    spans: list[tuple[int, int]]  # each fresh prompt's rows within the fresh rows, in order
    slots: torch.Tensor  # [Tf] the fresh rows' KV cache slots
    fresh_rows: torch.Tensor | None  # [Tf] their rows in the step; None: every row is fresh
    other_rows: torch.Tensor | None  # [To] the other rows, in order; None when there are none
    other: AttentionMetadata | None  # the other rows' sequences alone


def fresh_split(attn: AttentionMetadata) -> FreshSplit | None:
    """The step's split, built on the first call and kept in `attn.scratch` for the other layers;
    None when no row is a fresh prompt."""
    if _SCRATCH_KEY not in attn.scratch:
        attn.scratch[_SCRATCH_KEY] = _build(attn)
    return attn.scratch[_SCRATCH_KEY]


def _build(attn: AttentionMetadata) -> FreshSplit | None:
    lens, contexts = attn.query_lens_cpu, attn.context_lens_cpu
    fresh = [n > 1 and c == 0 for n, c in zip(lens, contexts, strict=True)]
    if not any(fresh):
        return None
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    fresh_rows: list[int] = []
    other_rows: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, is_fresh in enumerate(fresh):
        rows = range(starts[i], starts[i + 1])
        if is_fresh:
            spans.append((len(fresh_rows), len(fresh_rows) + len(rows)))
        (fresh_rows if is_fresh else other_rows).extend(rows)
    device = attn.slot_mapping.device
    if not other_rows:
        return FreshSplit(spans, attn.slot_mapping, None, None, None)
    fresh_index = torch.tensor(fresh_rows, dtype=torch.long, device=device)
    other_index = torch.tensor(other_rows, dtype=torch.long, device=device)
    others = [i for i, is_fresh in enumerate(fresh) if not is_fresh]
    return FreshSplit(
        spans=spans,
        slots=attn.slot_mapping[fresh_index],
        fresh_rows=fresh_index,
        other_rows=other_index,
        other=_select(attn, others, other_index),
    )


def _select(attn: AttentionMetadata, seqs: list[int], rows: torch.Tensor) -> AttentionMetadata:
    """The metadata of sequences `seqs` alone (their rows `rows` of the step)."""
    device = attn.slot_mapping.device
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    lens = [attn.query_lens_cpu[i] for i in seqs]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=attn.seq_lens[index],
        context_lens=attn.context_lens[index],
        slot_mapping=attn.slot_mapping[rows],
        block_tables=attn.block_tables[index],
        block_size=attn.block_size,
        query_lens_cpu=lens,
        seq_lens_cpu=[attn.seq_lens_cpu[i] for i in seqs],
        context_lens_cpu=[attn.context_lens_cpu[i] for i in seqs],
    )
