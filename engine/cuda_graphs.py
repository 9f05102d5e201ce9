"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step's work depends on the host only through its shapes: with the batch padded up to a
bucket, the step's inputs written into static buffers (token ids, positions, slot mapping,
sequence lengths, block tables) and kernels that read lengths on the device
(`KernelSet.graph_safe`), one captured graph replays the forward and the logits of any step of
that many rows: a few launches instead of thousands. Padding rows attend to one token of a
reserved block that the block manager never hands out, and write their KV there. Every bucket's
graph is captured when the runner is built (`capture_all`), all in one memory pool. Steps outside
the buckets (prefill, chunked prefill, forks, more rows than the largest bucket) run eagerly in
the runner.

Speculative verification replays the same graphs (`decode_rows`): verification row j of a sequence
whose last token is at position p is a decode row at position p + j, with the sequence's block
table, `seq_len` p + j + 1 and its own slot. Every model writes a layer's KV for all rows of the
step (slot_mapping) before that layer's attention reads the cache, and the decode kernels take
each row's length and block table on their own (no row assumes a sequence of its own), so row j
sees the KV rows 0..j-1 wrote in the same step: exactly what the varlen verification computes.
Nothing new is captured; the graph also hands out the hidden states (the MTP drafter's input).
On the CPU (tests) nothing is captured: `run` runs the same forward eagerly over the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve.engine.host_tensors import host_tensor
from deepserve.engine.models.base import CausalLM
from deepserve.engine.request import Sequence
from deepserve.kernels.attention_metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_up_to(max_rows: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_rows} | {max_rows})


@dataclass
class DecodeRows:
    """One step as decode rows (one query each), in the flattened batch's row order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]  # per row: its sequence's block table (repeated for a verification)

    def __len__(self) -> int:
        return len(self.input_ids)


def decode_rows(seqs: list[Sequence], block_size: int) -> DecodeRows:
    """The rows of a step in which each sequence brings its last token and its drafts
    (`spec_token_ids`, maybe none): row j of a sequence whose last token is at position p is the
    decode row at p + j, fed draft j - 1 (the last token for j = 0)."""
    rows = DecodeRows([], [], [], [])
    for seq in seqs:
        p = seq.num_computed_tokens
        assert p == seq.num_tokens - 1, "a decode row continues a fully computed sequence"
        table = seq.block_table
        rows.input_ids += [seq.token_ids[p], *seq.spec_token_ids]
        for pos in range(p, p + 1 + len(seq.spec_token_ids)):
            rows.positions.append(pos)
            rows.slots.append(table[pos // block_size] * block_size + pos % block_size)
            rows.tables.append(table)
    return rows


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_rows: int,
        max_blocks_per_seq: int,
        pad_block: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = buckets_up_to(max_rows)
        self.pad_block = pad_block
        n, dev = self.buckets[-1], kv_cache.device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.slots = zeros(n, dtype=torch.int64)
        self.seq_lens = zeros(n, dtype=torch.int32)
        self.context_lens = zeros(n, dtype=torch.int32)
        self.block_tables = zeros(n, max_blocks_per_seq, dtype=torch.int32)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._pad_rows(0, n)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.steps = 0  # steps run from the graphs
        self._pool = None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def covers(self, rows: int, max_blocks: int) -> bool:
        return rows <= self.max_rows and max_blocks <= self.block_tables.shape[1]

    def run(
        self, rows: DecodeRows, feed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[rows, vocab]` and hidden states `[rows, hidden]` of one step of decode rows
        (views valid until the next replay). `feed`: the input ids already on the device (then
        `rows.input_ids` are not read); copied in stream order, after the work that wrote them."""
        bucket = self.load(rows, feed)
        n = len(rows)
        self.steps += 1
        if self.kv_cache.device.type != "cuda":  # kernels that read host lengths: exact ones
            hidden, logits = self._forward(n, self._metadata(n, rows))
            return logits, hidden
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, hidden, logits = self._graphs[bucket]
        graph.replay()
        return logits[:n], hidden[:n]

    def load(self, rows: DecodeRows, feed: torch.Tensor | None = None) -> int:
        """Write `rows` into the static buffers, pad up to their bucket; returns the bucket."""
        n = len(rows)
        bucket = next(b for b in self.buckets if b >= n)
        self._fill(rows)
        if feed is not None:
            self.input_ids[:n].copy_(feed)
        self._pad_rows(n, bucket)
        return bucket

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the smaller graphs then fit in the memory the
        largest one's pool already holds). Captured on first use instead, a bucket that traffic
        meets for the first time paid its capture inside a served step: 3.7% of the engine
        thread in `bench serve` (benchmarks/RESULTS.md, run 6-5)."""
        for bucket in reversed(self.buckets):
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket)

    # ---- static buffers ---------------------------------------------------------------------

    def _fill(self, r: DecodeRows) -> None:
        rows, width = len(r), max(len(t) for t in r.tables)
        table = [t + [self.pad_block] * (width - len(t)) for t in r.tables]
        host = self._pinned(host_tensor([r.input_ids, r.positions, r.slots], torch.int64))
        dev = host.to(self.kv_cache.device, non_blocking=True)
        self.input_ids[:rows].copy_(dev[0])
        self.positions[:rows].copy_(dev[1])
        self.slots[:rows].copy_(dev[2])
        self.seq_lens[:rows].copy_(dev[1] + 1)
        self.context_lens[:rows].copy_(dev[1])
        host_tables = self._pinned(host_tensor(table, torch.int32))
        self.block_tables[:rows, :width].copy_(host_tables, non_blocking=True)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.kv_cache.device.type == "cuda" else t

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows past the batch: one token at slot 0 of the reserved block."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.pad_block * self.block_size
        self.seq_lens[start:end] = 1
        self.context_lens[start:end] = 0
        self.block_tables[start:end, 0] = self.pad_block

    def _metadata(self, rows: int, exact: DecodeRows | None = None) -> AttentionMetadata:
        """The captured step's metadata: host lengths are upper bounds, never read by a graph-
        safe kernel; `exact`: the true lengths instead (an eager step on the CPU)."""
        longest = self.block_tables.shape[1] * self.block_size
        seq_lens = [p + 1 for p in exact.positions] if exact else [longest] * rows
        return AttentionMetadata(
            query_start_loc=self.query_start[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            context_lens=self.context_lens[:rows],
            slot_mapping=self.slots[:rows],
            block_tables=self.block_tables[:rows],
            block_size=self.block_size,
            query_lens_cpu=[1] * rows,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=[n - 1 for n in seq_lens],
        )

    # ---- capture ------------------------------------------------------------------------------

    def _forward(self, rows: int, attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.forward(
            self.input_ids[:rows], self.positions[:rows], attn, self.kv_cache
        )
        return hidden, self.model.compute_logits(hidden)

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        side = torch.cuda.Stream(self.kv_cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles kernels and creates handles outside the capture
            self._forward(rows, self._metadata(rows))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # A fresh metadata object: per-step values a backend derived for the warm-up (and keeps,
        # keyed by the object) must be derived again inside the capture, in the graph's memory.
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, logits = self._forward(rows, self._metadata(rows))
        self._pool = graph.pool()
        return graph, hidden, logits
