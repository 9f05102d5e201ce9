"""What DeepSeek-V4 keeps per token in the engine's one paged KV tensor, and where a step reads it.

A token owns one row of `kv_cache[0]` (`[num_blocks, block_size, width]`), and every layer (the
MTP's too) a run of that row's columns as wide as its own kind needs (`RowLayout`): a sliding
layer's 512 next to a CSA layer's ~3,700, so no layer pays for the widest kind's columns. The
row holds what later queries need from the token, so prefix caching, the KV tiers and the
prefill/decode hand-off move V4's blocks as bytes, unchanged, and a block carries everything a
request needs to resume at its boundary. `KVRow` names a layer's columns, per layer kind (D =
head_dim, Di = index_head_dim, s = 2 for CSA's overlapping windows, 1 for HCA):

    window    D      the token's latent K=V (normed, rotated): the sliding-window branch
    comp_kv   s*D    the compressor's inputs for this token (kv and gate projections), so a
    comp_gate s*D    group still open at a block boundary is rebuilt from its tokens' rows
    idx_kv    2*Di   (CSA) the indexer compressor's inputs, likewise
    idx_gate  2*Di
    entry     D      in a group's LAST token's row: the group's compressed entry, computed once
    idx_key   Di     when the group closes; (CSA) its indexer key likewise

A sliding-window layer has `window` only. Rows past the window and of closed groups stay
readable (the block manager keeps whole sequences); per-kind pools that drop them (entries every
4 / 128 tokens, the window as a ring) are not built.

`StepPlan` turns one step's `AttentionMetadata` into device tensors of slots: each token's window
keys, each sequence's entry rows and how many of them each token sees, and the groups this step
pools (each with its tokens' slots and, for CSA's overlap, the previous group's). Built once per
forward, shared by every layer; no host loop over sequences in a decode step.
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


ROW_ALIGN = 64  # elements: each layer's columns start 128 bytes apart in bf16 (vector loads)


@dataclass(frozen=True)
class RowLayout:
    """Each layer's columns in a token's row: layer i owns `[offsets[i], offsets[i] + widths[i])`."""

    offsets: tuple[int, ...]
    widths: tuple[int, ...]
    width: int  # the whole row

    def layer(self, kv_cache: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i's `[num_blocks, block_size, widths[i]]` view of `kv_cache [1, ...]`."""
        return kv_cache[0, ..., self.offsets[i] : self.offsets[i] + self.widths[i]]


def row_layout(widths: list[int]) -> RowLayout:
    offsets, end = [], 0
    for w in widths:
        offsets.append(end)
        end += -(-w // ROW_ALIGN) * ROW_ALIGN
    return RowLayout(tuple(offsets), tuple(widths), end)


@dataclass(frozen=True)
class ClosingGroups:
    """The compressed groups a step pools (G of them, `ratio` tokens each)."""

    tokens: torch.Tensor  # [G, ratio] slots of the group's tokens
    previous: torch.Tensor  # [G, ratio] slots of the group before it (itself for group 0)
    has_previous: torch.Tensor  # [G] bool
    last: torch.Tensor  # [G] slot where its entry is written
    first_position: torch.Tensor  # [G] position of its first token: where its entry is rotated


class StepPlan:
    """Where one step's tokens read, as device tensors built from the step's metadata: the
    shapes come from host values only (exact lengths in eager steps, upper bounds inside a CUDA
    graph's capture) and every choice from device tensors, so a decode step can be replayed."""

    def __init__(self, attn: AttentionMetadata, window: int, positions: torch.Tensor) -> None:
        self.attn = attn
        self.block_size = attn.block_size
        self.tables = attn.block_tables.long()
        self.step_slots = attn.slot_mapping
        self.positions = positions
        self.device = self.tables.device
        self.window = window
        self.max_len = max(attn.seq_lens_cpu)  # every position of the step is below it
        # a decode step pools each token's own group (no host decision): see `closing`
        self.decode = all(n == 1 for n in attn.query_lens_cpu)
        rows = torch.arange(positions.shape[0], device=self.device)
        starts = attn.query_start_loc[1:].long()
        self.token_seq = torch.searchsorted(starts, rows, right=True)  # [T]
        self._token_tables = self.tables[self.token_seq]  # [T, max_blocks]
        self._memo: dict = {}

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of `positions [R, n]` in the sequences whose block tables are `tables [R, B]`."""
        bs = self.block_size
        return tables.gather(1, positions // bs) * bs + positions % bs

    def window_slots(self) -> torch.Tensor:
        """`[T, W]`: slots of positions pos-W+1 .. pos of each token's sequence, -1 before 0."""
        if "window" not in self._memo:
            offsets = torch.arange(1 - self.window, 1, device=self.device)
            pos = self.positions[:, None] + offsets
            slots = self._slots(self._token_tables, pos.clamp(min=0))
            self._memo["window"] = torch.where(pos >= 0, slots, -1)
        return self._memo["window"]

    def entries(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[S, Gmax]` slots of each sequence's entry rows (group j's last token's; past the
        sequence's end: its last token's, never read) and `[T]` how many entries each token sees
        (the groups complete at its position)."""
        key = ("entries", ratio)
        if key not in self._memo:
            groups = self.max_len // ratio
            last = (torch.arange(groups, device=self.device) + 1) * ratio - 1
            ends = self.attn.seq_lens.long()[:, None] - 1
            slots = self._slots(self.tables, torch.minimum(last[None, :], ends))
            self._memo[key] = (slots, (self.positions + 1) // ratio)
        return self._memo[key]

    def token_entries(self, ratio: int) -> torch.Tensor:
        """`[T, Gmax]`: the slots of every entry each token sees, -1 past them."""
        key = ("token_entries", ratio)
        if key not in self._memo:
            slots, visible = self.entries(ratio)
            seen = torch.arange(slots.shape[1], device=self.device)[None, :] < visible[:, None]
            self._memo[key] = torch.where(seen, slots[self.token_seq], -1)
        return self._memo[key]

    def closing(self, ratio: int) -> ClosingGroups | None:
        """The groups this step pools. Decode: every token its own group (positions up to its own,
        the entry written in its own row: only a group's last token's entry is ever read, so the
        others are harmless). Otherwise the groups whose last token is in this step, from the
        host's exact lengths."""
        key = ("closing", ratio)
        if key not in self._memo:
            self._memo[key] = self._decode_groups(ratio) if self.decode else self._closing(ratio)
        return self._memo[key]

    def _decode_groups(self, ratio: int) -> ClosingGroups:
        pos = self.positions
        first = pos // ratio * ratio
        tokens = torch.minimum(
            first[:, None] + torch.arange(ratio, device=self.device), pos[:, None]
        )
        return self._groups(self._token_tables, tokens, first, last=self.step_slots)

    def _closing(self, ratio: int) -> ClosingGroups | None:
        attn = self.attn
        seqs, groups = [], []
        for i, (ctx, total) in enumerate(
            zip(attn.context_lens_cpu, attn.seq_lens_cpu, strict=True)
        ):
            closed = range(ctx // ratio, total // ratio)
            seqs += [i] * len(closed)
            groups += closed
        if not groups:
            return None
        g = torch.tensor(groups, device=self.device)
        table = self.tables[torch.tensor(seqs, device=self.device)]
        tokens = g[:, None] * ratio + torch.arange(ratio, device=self.device)
        return self._groups(table, tokens, g * ratio, last=None)

    def _groups(
        self,
        table: torch.Tensor,
        tokens: torch.Tensor,
        first: torch.Tensor,
        last: torch.Tensor | None,
    ) -> ClosingGroups:
        has_previous = first > 0
        previous = torch.where(has_previous[:, None], tokens - tokens.shape[1], tokens)
        slots = self._slots(table, tokens)
        return ClosingGroups(
            tokens=slots,
            previous=self._slots(table, previous),
            has_previous=has_previous,
            last=slots[:, -1] if last is None else last,
            first_position=first,
        )
