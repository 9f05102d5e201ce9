"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step's work depends on the host only through its shapes: with the batch padded up to a
bucket, the step's inputs written into static buffers (token ids, positions, slot mapping,
sequence lengths, block tables) and kernels that read lengths on the device
(`KernelSet.graph_safe`), one captured graph replays the forward and the logits of any step of
that many rows: a few launches instead of thousands. Padding rows attend to one token of a
reserved block that the block manager never hands out, and write their KV there. Every bucket's
graph is captured when the runner is built (`capture_all`), all in one memory pool. Steps outside
the buckets (prefill, chunked prefill, speculation, more rows than the largest bucket) run eagerly
in the runner.
"""

from __future__ import annotations

import torch

from deepserve.engine.models.base import CausalLM
from deepserve.kernels.attention_metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_up_to(max_rows: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_rows} | {max_rows})


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
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def covers(self, rows: int, max_blocks: int) -> bool:
        return rows <= self.max_rows and max_blocks <= self.block_tables.shape[1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` of one decode step (a view valid until the next replay).
        `feed`: the input ids already on the device (then `input_ids` are not read); copied in
        stream order, after the work that wrote them."""
        rows = len(input_ids)
        bucket = next(b for b in self.buckets if b >= rows)
        self._fill(input_ids, positions, slots, tables)
        if feed is not None:
            self.input_ids[:rows].copy_(feed)
        self._pad_rows(rows, bucket)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:rows]

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

    def _fill(
        self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> None:
        rows, width = len(input_ids), max(len(t) for t in tables)
        table = [t + [self.pad_block] * (width - len(t)) for t in tables]
        host = torch.tensor([input_ids, positions, slots], dtype=torch.int64).pin_memory()
        dev = host.to(self.kv_cache.device, non_blocking=True)
        self.input_ids[:rows].copy_(dev[0])
        self.positions[:rows].copy_(dev[1])
        self.slots[:rows].copy_(dev[2])
        self.seq_lens[:rows].copy_(dev[1] + 1)
        self.context_lens[:rows].copy_(dev[1])
        host_tables = torch.tensor(table, dtype=torch.int32).pin_memory()
        self.block_tables[:rows, :width].copy_(host_tables, non_blocking=True)

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

    def _metadata(self, rows: int) -> AttentionMetadata:
        longest = self.block_tables.shape[1] * self.block_size  # an upper bound, never read
        return AttentionMetadata(
            query_start_loc=self.query_start[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            context_lens=self.context_lens[:rows],
            slot_mapping=self.slots[:rows],
            block_tables=self.block_tables[:rows],
            block_size=self.block_size,
            query_lens_cpu=[1] * rows,
            seq_lens_cpu=[longest] * rows,
            context_lens_cpu=[longest - 1] * rows,
        )

    # ---- capture ------------------------------------------------------------------------------

    def _forward(self, rows: int, attn: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.forward(
            self.input_ids[:rows], self.positions[:rows], attn, self.kv_cache
        )
        return self.model.compute_logits(hidden)

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.kv_cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles kernels and creates handles outside the capture
            self._forward(rows, self._metadata(rows))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # A fresh metadata object: per-step values a backend derived for the warm-up (and keeps,
        # keyed by the object) must be derived again inside the capture, in the graph's memory.
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(rows, self._metadata(rows))
        self._pool = graph.pool()
        return graph, logits
