"""What rank 0 sends the other ranks each step: the batch's inputs and KV bookkeeping, on the host.

A `StepMessage` is small (token ids, positions, the attention metadata's index tensors, block
copies) and pickled once per step over the control group; every rank then runs the same forward on
its own shard and KV cache. `None` tells the ranks to stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepserve.kernels.attention_metadata import AttentionMetadata


@dataclass
class StepMessage:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    num_blocks: int  # blocks in rank 0's KV cache: every rank's cache has as many
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        num_blocks: int,
        block_copies: list[tuple[int, int]],
    ) -> StepMessage:
        return cls(
            input_ids.cpu(), positions.cpu(), _attn_to(attn, "cpu"), num_blocks, block_copies
        )

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.input_ids.to(device), self.positions.to(device), _attn_to(self.attn, device)


def _attn_to(a: AttentionMetadata, device) -> AttentionMetadata:
    """A fresh metadata (empty scratch) with its tensors on `device`."""
    return AttentionMetadata(
        query_start_loc=a.query_start_loc.to(device),
        seq_lens=a.seq_lens.to(device),
        context_lens=a.context_lens.to(device),
        slot_mapping=a.slot_mapping.to(device),
        block_tables=a.block_tables.to(device),
        block_size=a.block_size,
        query_lens_cpu=list(a.query_lens_cpu),
        seq_lens_cpu=list(a.seq_lens_cpu),
        context_lens_cpu=list(a.context_lens_cpu),
        prompt_lens_cpu=None if a.prompt_lens_cpu is None else list(a.prompt_lens_cpu),
    )
