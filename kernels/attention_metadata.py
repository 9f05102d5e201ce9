"""Per-step attention metadata for one flattened, variable-length batch (no padding).

The model runner builds one `AttentionMetadata` per step; models and attention backends only read it.
Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]` of the flattened batch; its
queries sit at positions `context_lens[i] .. seq_lens[i]-1`; its KV lives in the blocks listed in
`block_tables[i]`. New tokens' KV is written to `slot_mapping` (block_id * block_size + offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32: tokens in KV after this step
    context_lens: torch.Tensor  # [B] int32: tokens already in KV before this step
    slot_mapping: torch.Tensor  # [T] int64: where each new token's KV is written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    # Host copies, so reference backends can loop without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # Per sequence, its prompt's length: rows at positions below it are prompt rows, the rest
    # generated ones (a decode, a draft, a recompute after preemption). None: not told (the
    # graphs' decode steps, MTP's drafts), every row generated. Read where a row's arithmetic
    # follows its role (engine/models/mla_prefill.py `plan_by_role`).
    prompt_lens_cpu: list[int] | None = None
    # Values an attention backend derives from the fields above once per step and reuses in every
    # layer (e.g. the reference's gathered block ids and padding mask). Build a new
    # AttentionMetadata per step rather than mutating one, or this goes stale.
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))


@dataclass
class CausalVarlen:
    """Sequences whose queries and keys sit in plain (unpaged) rows, for a varlen attention over
    gathered keys (kernels/triton/flash_prefill.py): sequence i's queries are rows
    `query_start_loc[i]:query_start_loc[i+1]` at positions `context_lens[i] + r`, its keys rows
    `key_start_loc[i]:key_start_loc[i+1]`, key j at position j; a query sees keys up to its own."""

    query_start_loc: torch.Tensor  # [B+1] int32
    key_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    query_lens_cpu: list[int]
    # what a kernel derives once per step (tile layouts), reused by every layer
    scratch: dict = field(default_factory=dict, repr=False, compare=False)
