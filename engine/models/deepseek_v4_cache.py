"""What DeepSeek-V4 keeps per token in the engine's one paged KV tensor, and where a step reads it.

Every row of `kv_cache[layer]` (`[num_blocks, block_size, width]`) belongs to one token and holds
what later queries need from it, so prefix caching, the KV tiers and the prefill/decode hand-off
move V4's blocks as bytes, unchanged, and a block carries everything a request needs to resume at
its boundary. `KVRow` names the columns, per layer kind (D = head_dim, Di = index_head_dim,
s = 2 for CSA's overlapping windows, 1 for HCA):

    window    D      the token's latent K=V (normed, rotated): the sliding-window branch
    comp_kv   s*D    the compressor's inputs for this token (kv and gate projections), so a
    comp_gate s*D    group still open at a block boundary is rebuilt from its tokens' rows
    idx_kv    2*Di   (CSA) the indexer compressor's inputs, likewise
    idx_gate  2*Di
    entry     D      in a group's LAST token's row: the group's compressed entry, computed once
    idx_key   Di     when the group closes; (CSA) its indexer key likewise

A sliding-window layer uses `window` only; the tensor's width is the widest kind's (CSA's). Rows
past the window and of closed groups stay readable (the block manager keeps whole sequences);
the per-kind pools that drop them are the GPU step's.

`StepPlan` turns one step's `AttentionMetadata` into the slots each sequence reads: its window's
keys, its closed groups' entry rows, and the groups this step closes (each with its tokens' slots
and, for CSA's overlap, the previous group's). Built once per forward, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.engine.models.deepseek_v4_config import CSA, SLIDING
from deepserve.kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class KVRow:
    window: slice
    written: slice  # the columns a token's own step writes (window and compressor inputs)
    comp_kv: slice | None = None
    comp_gate: slice | None = None
    idx_kv: slice | None = None
    idx_gate: slice | None = None
    entry: slice | None = None
    idx_key: slice | None = None

    @property
    def width(self) -> int:
        return max(s.stop for s in vars(self).values() if s is not None)


def kv_row(kind: str, head_dim: int, index_head_dim: int) -> KVRow:
    cols: dict[str, slice] = {}
    end = 0

    def take(name: str, n: int) -> None:
        nonlocal end
        cols[name] = slice(end, end + n)
        end += n

    take("window", head_dim)
    if kind != SLIDING:
        series = 2 if kind == CSA else 1
        take("comp_kv", series * head_dim)
        take("comp_gate", series * head_dim)
    if kind == CSA:
        take("idx_kv", 2 * index_head_dim)
        take("idx_gate", 2 * index_head_dim)
    written = slice(0, end)
    if kind != SLIDING:
        take("entry", head_dim)
    if kind == CSA:
        take("idx_key", index_head_dim)
    return KVRow(written=written, **cols)


@dataclass(frozen=True)
class Span:
    """One sequence of the step: its query rows, and its length before and after the step."""

    rows: slice
    ctx: int
    total: int


@dataclass(frozen=True)
class ClosingGroups:
    """The compressed groups this step closes, over all sequences (G of them, `ratio` tokens each)."""

    tokens: torch.Tensor  # [G, ratio] slots of the group's tokens
    previous: torch.Tensor  # [G, ratio] slots of the group before it (itself for group 0)
    has_previous: torch.Tensor  # [G] bool
    last: torch.Tensor  # [G] slot of the group's last token: where its entry is written
    first_position: torch.Tensor  # [G] position of its first token: where its entry is rotated


class StepPlan:
    def __init__(self, attn: AttentionMetadata, window: int) -> None:
        self.block_size = attn.block_size
        self.tables = attn.block_tables.long()
        self.step_slots = attn.slot_mapping
        self.device = self.tables.device
        self.window = window
        starts = [0]
        for n in attn.query_lens_cpu:
            starts.append(starts[-1] + n)
        self.spans = [
            Span(slice(starts[i], starts[i + 1]), attn.context_lens_cpu[i], attn.seq_lens_cpu[i])
            for i in range(attn.num_seqs)
        ]
        self.max_len = max(attn.seq_lens_cpu)  # every position of the step is below it
        self._memo: dict = {}

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.tables[seq, positions // bs] * bs + positions % bs

    def query_positions(self, seq: int) -> torch.Tensor:
        s = self.spans[seq]
        return torch.arange(s.ctx, s.total, device=self.device)

    def window_keys(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and slots of every key some query of `seq` sees in its window."""
        key = ("window", seq)
        if key not in self._memo:
            s = self.spans[seq]
            pos = torch.arange(max(0, s.ctx - self.window + 1), s.total, device=self.device)
            self._memo[key] = (pos, self.slots(seq, pos))
        return self._memo[key]

    def entry_slots(self, seq: int, ratio: int) -> torch.Tensor:
        """Slots of the rows holding `seq`'s closed groups' entries (group g's last token's)."""
        key = ("entries", seq, ratio)
        if key not in self._memo:
            closed = self.spans[seq].total // ratio
            last = (torch.arange(closed, device=self.device) + 1) * ratio - 1
            self._memo[key] = self.slots(seq, last)
        return self._memo[key]

    def closing(self, ratio: int) -> ClosingGroups | None:
        """The groups whose last token is in this step: g in [ctx // ratio, total // ratio)."""
        key = ("closing", ratio)
        if key not in self._memo:
            self._memo[key] = self._closing(ratio)
        return self._memo[key]

    def _closing(self, ratio: int) -> ClosingGroups | None:
        seqs, groups = [], []
        for i, s in enumerate(self.spans):
            g = torch.arange(s.ctx // ratio, s.total // ratio, device=self.device)
            seqs.append(torch.full_like(g, i))
            groups.append(g)
        g, seq = torch.cat(groups), torch.cat(seqs)
        if g.numel() == 0:
            return None
        offsets = torch.arange(ratio, device=self.device)
        tokens = g[:, None] * ratio + offsets
        previous = torch.where(g[:, None] > 0, tokens - ratio, tokens)
        bs = self.block_size
        table = self.tables[seq]

        def slots(pos: torch.Tensor) -> torch.Tensor:
            return table.gather(1, pos // bs) * bs + pos % bs

        return ClosingGroups(
            tokens=slots(tokens),
            previous=slots(previous),
            has_previous=g > 0,
            last=slots(tokens[:, -1:])[:, 0],
            first_position=g * ratio,
        )
