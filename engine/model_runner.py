"""How a scheduled step runs: the KV cache tensor, one flattened batch, the forward, the sampler.

The runner owns the device KV cache (`[num_layers, num_blocks, block_size, width]`, allocated from
the model's `KVCacheSpec`), turns a `SchedulerOutput` into one variable-length batch (no padding:
input ids, positions, slot mapping, block tables, query start offsets, sequence lengths), runs the
model, computes logits only for rows that are sampled, and samples them. Structured-output masks
are filled on a helper thread while the forward runs. What to run is the scheduler's business;
which blocks hold what is the block manager's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepserve.engine.cuda_graphs import DecodeGraphs, decode_rows
from deepserve.engine.host_tensors import host_tensor
from deepserve.engine.models.base import CausalLM
from deepserve.engine.request import Sequence
from deepserve.engine.sampler import DeviceSample, Sampler, SamplerOutput, SamplingBatch
from deepserve.engine.scheduler import SchedulerOutput
from deepserve.kernels import kv_quant
from deepserve.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from deepserve.engine.spec_decode.decoder import StepHidden


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [N] row of the flattened batch whose logits each sample uses
    sample_seqs: list[Sequence]
    sample_views: list[Sequence]  # what the sampler sees per row (drafts as if accepted)


@dataclass
class StepResult:
    seqs: list[Sequence]  # one per sampled row, in row order (a speculating sequence: 1 + drafts)
    sampled: SamplerOutput
    hidden: StepHidden | None = None  # the target's hidden states, kept for the MTP drafter


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its samples are read back by `result()`."""

    seqs: list[Sequence]  # one per sampled row, in row order
    sample: DeviceSample | None  # None when no row is sampled
    hidden: StepHidden | None = None

    @property
    def token_ids(self) -> torch.Tensor:
        """The sampled ids on the device, one per row (what a next decode step feeds in)."""
        return self.sample.token_ids

    def result(self) -> StepResult:
        if self.sample is None:
            return StepResult([], SamplerOutput([], []), self.hidden)
        return StepResult(self.seqs, self.sample.result(), self.hidden)


def num_kv_blocks(model: CausalLM, block_size: int, kv_cache_bytes: int) -> int:
    spec = model.kv_cache_spec
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    per_block = spec.num_layers * block_size * spec.width * itemsize
    return max(1, kv_cache_bytes // per_block)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        keep_hidden: bool = False,
        graph_rows: int = 0,
        max_blocks_per_seq: int = 0,
    ) -> None:
        self.model = model
        self.keep_hidden = keep_hidden  # MTP speculation drafts from the target's hidden states
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        spec = model.kv_cache_spec
        # CUDA graphs pad their batches with rows that write to one reserved block past the
        # block manager's range.
        extra = 1 if graph_rows else 0
        shape = (spec.num_layers, num_blocks + extra, block_size, spec.width)
        self.kv_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.graphs: DecodeGraphs | None = None
        if graph_rows:
            self.graphs = DecodeGraphs(
                model, self.kv_cache, block_size, graph_rows, max_blocks_per_seq, num_blocks
            )
            if device.type == "cuda":  # elsewhere (tests) the same steps run eagerly
                self.graphs.capture_all()
        self.sampler = Sampler(model.vocab_size, device)
        self._pin = device.type == "cuda"
        self._mask_pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)
            self._mask_pool = None

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, on_launched: Callable[[], None] | None = None
    ) -> StepResult:
        """Run one step. `on_launched` is called once the step's GPU work is queued and before
        the host waits for the sampled ids: host work done there overlaps the GPU. On the CPU,
        where the forward runs to its end on the caller's thread, it is called before it."""
        return self.launch(out, on_launched).result()

    @torch.inference_mode()
    def launch(
        self,
        out: SchedulerOutput,
        on_launched: Callable[[], None] | None = None,
        feed: torch.Tensor | None = None,
        keep_hidden: bool = True,
    ) -> LaunchedStep:
        """Queue one step and its sampling; wait for nothing but a structured output's masks.
        `feed`: a plain decode step's input ids already on the device, one per row (the previous
        step's samples under async scheduling); the rows' own last token ids are then not read.
        `keep_hidden` False: no drafter reads this step's hidden states (a step run ahead, every
        sequence's drafting paused), so none is copied out of the graph's buffers."""
        keep = self.keep_hidden and keep_hidden
        if self._replayable(out):
            return self._launch_graph(out, on_launched, feed, keep)
        inputs = self.prepare(out)
        if feed is not None:
            inputs.input_ids = feed
        batch = SamplingBatch.build(
            inputs.sample_views, self.eos_token_ids, self.model.vocab_size, self.device
        )
        masks = self._start_masks(inputs.sample_seqs)
        if on_launched is not None and self.device.type != "cuda":
            # The forward below runs on this thread to its end (nothing is queued): called after
            # it, the previous step's tokens would wait a whole step more (a long prompt's
            # prefill chunk: seconds of TTFT), so they go before it.
            on_launched()
            on_launched = None
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache)
        self._copy_blocks(out.block_copies)
        kept = _keep_hidden(hidden, inputs.attn) if keep else None
        if not inputs.sample_seqs:
            return LaunchedStep([], None, kept)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        if on_launched is not None:
            on_launched()
        if masks is not None:
            batch.bitmask = masks.result()
        return LaunchedStep(inputs.sample_seqs, self.sampler.sample_on_device(logits, batch), kept)

    def _replayable(self, out: SchedulerOutput) -> bool:
        """A decode step (every sequence brings its last token and its drafts, if any, all
        sampled; no forks) whose rows one of the captured buckets covers."""
        if self.graphs is None or out.forks or out.block_copies:
            return False
        if not all(_is_decode_row(item) for item in out.scheduled):
            return False
        rows = sum(item.num_new_tokens for item in out.scheduled)
        widest = max(len(item.seq.block_table) for item in out.scheduled)
        return self.graphs.covers(rows, widest)

    def _launch_graph(
        self,
        out: SchedulerOutput,
        on_launched: Callable[[], None] | None,
        feed: torch.Tensor | None,
        keep_hidden: bool,
    ) -> LaunchedStep:
        """A decode step from the graphs; a verification's rows as decode rows (cuda_graphs.py)."""
        seqs = [item.seq for item in out.scheduled]
        sample_seqs = [s for s in seqs for _ in range(1 + len(s.spec_token_ids))]
        views = [v for s in seqs for v in _sampling_views(s)]
        batch = SamplingBatch.build(views, self.eos_token_ids, self.model.vocab_size, self.device)
        masks = self._start_masks(sample_seqs)
        logits, hidden = self.graphs.run(decode_rows(seqs, self.block_size), feed)
        kept = None
        if keep_hidden:  # a copy: the graph's output is overwritten by the next replay
            kept = _step_hidden(hidden.clone(), [s.num_computed_tokens for s in seqs])
        if on_launched is not None:
            on_launched()
        if masks is not None:
            batch.bitmask = masks.result()
        return LaunchedStep(sample_seqs, self.sampler.sample_on_device(logits, batch), kept)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled chunks into one batch (built on the host, moved once)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        context_lens: list[int] = []
        rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_views: list[Sequence] = []
        fork_children = {id(f.parent): f.children for f in out.forks}
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_table
            input_ids += (
                seq.token_ids[start:end] + seq.spec_token_ids[: max(0, end - seq.num_tokens)]
            )
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + item.num_new_tokens)
            seq_lens.append(end)
            context_lens.append(start)
            if item.sample:
                children = fork_children.get(id(seq), [])
                num_drafts = len(seq.spec_token_ids)  # speculation: verify every draft row too
                rows += range(query_start[-1] - 1 - num_drafts, query_start[-1])
                rows += [query_start[-1] - 1] * len(children)
                sample_seqs += [seq] * (1 + num_drafts) + children
                sample_views += _sampling_views(seq) + children
        width = max(len(item.seq.block_table) for item in out.scheduled)
        tables = [i.seq.block_table + [0] * (width - len(i.seq.block_table)) for i in out.scheduled]
        attn = AttentionMetadata(
            query_start_loc=self._to_device(query_start, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(tables, torch.int32),
            block_size=bs,
            query_lens_cpu=[item.num_new_tokens for item in out.scheduled],
            seq_lens_cpu=seq_lens,
            context_lens_cpu=context_lens,
            prompt_lens_cpu=[item.seq.num_prompt_tokens for item in out.scheduled],
        )
        return StepInputs(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            attn=attn,
            sample_rows=self._to_device(rows, torch.int64),
            sample_seqs=sample_seqs,
            sample_views=sample_views,
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        t = host_tensor(values, dtype)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Forked samples get their own copy of the parent's partial last block."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        cache = kv_quant.byte_view(self.kv_cache)  # e4m3 lacks index kernels on some devices
        cache[:, dst] = cache[:, src]
        copy_elsewhere = getattr(self.model, "copy_blocks", None)  # tensor parallel: other ranks
        if copy_elsewhere is not None:
            copy_elsewhere(copies)

    # ---- structured outputs ---------------------------------------------------------------

    def _start_masks(self, seqs: list[Sequence]) -> Future | None:
        """Fill grammar bitmasks on a helper thread; the forward releases the GIL meanwhile."""
        # A speculating sequence's rows are consecutive; its first row fills them all.
        rows = [
            (i, s)
            for i, s in enumerate(seqs)
            if s.matcher is not None and (i == 0 or seqs[i - 1] is not s)
        ]
        if not rows:
            return None
        from deepserve.engine.structured import allocate_bitmask

        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="deepserve-mask")
        bitmask = allocate_bitmask(len(seqs), self.model.vocab_size)

        def fill() -> torch.Tensor:
            for row, seq in rows:
                if seq.spec_token_ids:
                    from deepserve.engine.spec_decode.decoder import fill_draft_bitmasks

                    fill_draft_bitmasks(seq, bitmask, row)
                else:
                    seq.matcher.fill_bitmask(bitmask, row)
            return bitmask

        return self._mask_pool.submit(fill)


def _sampling_views(seq: Sequence) -> list[Sequence]:
    if not seq.spec_token_ids:
        return [seq]
    from deepserve.engine.spec_decode.decoder import sampling_views

    return sampling_views(seq)


def _is_decode_row(item) -> bool:
    """A sampled chunk of a sequence's last token and all its drafts (maybe none), past its
    prompt: a prompt's last token, alone in its chunk after a prefix hit, is a prompt row, which
    a graph's decode rows are not (AttentionMetadata.prompt_lens_cpu)."""
    seq = item.seq
    drafts = len(seq.spec_token_ids)
    if not item.sample or item.num_new_tokens != 1 + drafts:
        return False
    if seq.num_computed_tokens < seq.num_prompt_tokens:
        return False
    return drafts == 0 or seq.num_computed_tokens == seq.num_tokens - 1


def _keep_hidden(hidden: torch.Tensor, attn: AttentionMetadata) -> StepHidden:
    return _step_hidden(hidden, list(attn.context_lens_cpu))


def _step_hidden(hidden: torch.Tensor, starts: list[int]) -> StepHidden:
    from deepserve.engine.spec_decode.decoder import StepHidden

    return StepHidden(hidden, starts)
