"""Async scheduling: which decode steps may run one step ahead of their sampled ids, and how.

With it on, a plain decode step is left in flight: its samples stay on the device while the
engine schedules and launches the next step, assuming every running sequence continues. Each
such sequence holds a placeholder (`PLACEHOLDER`, `Sequence.sample_pending`) as its last token
id, so the scheduler, the block manager and the sampling batch see exactly the lengths,
positions and output counts they would see with the token known; the next step's input ids are
the in-flight step's sampled ids, copied device to device in stream order (`feed_ids`). Only
then does the host wait for the in-flight ids and apply them (engine/llm_engine.py), while the
GPU runs the next step. The outputs are the same as without it: nothing the next step computes
depends on the unknown token except through the device copy.

What needs the last token on the host falls back to the plain synchronous step: a grammar's
mask, penalties (counts of the output so far), speculative drafts (a verification step, and the
step after which a sequence drafts: with speculation only sequences whose draft throttle is
paused run ahead, `SpeculativeDecoder.may_run_ahead`, checked by the engine), forks, requests
joining (prefill and mixed steps), preemption. This module decides the rest (`may_run_ahead`,
`continuation`); it holds no state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepserve.engine.model_runner import LaunchedStep
from deepserve.engine.request import Sequence
from deepserve.engine.sampler import to_device
from deepserve.engine.scheduler import SchedulerOutput

# A token id no model has: any read of it instead of the fed id fails loudly (an index error).
PLACEHOLDER = -1


@dataclass
class OverlapStats:
    """How often decode steps ran one step ahead, and why not."""

    ahead: int = 0  # steps launched before the previous step's ids were on the host
    fallbacks: int = 0  # steps after an in-flight one that had to wait for its ids first
    wasted_rows: int = 0  # rows run ahead for a sequence that had stopped (their samples dropped)


def may_run_ahead(out: SchedulerOutput) -> bool:
    """A step may be left in flight: plain decode rows (one token each, sampled) whose sampling
    the unknown token cannot change."""
    if out.is_empty or out.forks or out.block_copies:
        return False
    return all(
        item.num_new_tokens == 1 and item.sample and _history_free(item.seq)
        for item in out.scheduled
    )


def _history_free(seq: Sequence) -> bool:
    """Nothing of this row's sampling is built from its output tokens (only their count)."""
    p = seq.params
    return (
        seq.matcher is None
        and not seq.spec_token_ids
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1
    )


def continuation(
    out: SchedulerOutput, stops_for_sure: Callable[[Sequence], bool]
) -> SchedulerOutput | None:
    """The part of `out` to launch before the in-flight ids are known; None when `out` is not a
    plain continuation of the in-flight step (every row a sequence with a pending sample,
    nothing joined, forked or preempted). A row whose pending token ends it whatever its value
    (max_tokens, the context) is left out rather than run for nothing."""
    if out.is_empty or out.forks or out.block_copies or out.preempted:
        return None
    kept = []
    for item in out.scheduled:
        if not item.seq.sample_pending or item.num_new_tokens != 1 or not item.sample:
            return None
        if not stops_for_sure(item.seq):
            kept.append(item)
    return SchedulerOutput(kept) if kept else None


def feed_ids(launched: LaunchedStep, out: SchedulerOutput) -> torch.Tensor:
    """The in-flight step's sampled ids on the device, in the row order of `out` (whose rows
    are some of the in-flight step's, in the same order while nothing joined)."""
    ids = launched.token_ids
    row_of = {id(seq): i for i, seq in enumerate(launched.seqs)}
    rows = [row_of[id(item.seq)] for item in out.scheduled]
    if rows == list(range(len(rows))):
        return ids[: len(rows)]
    return ids[to_device(rows, torch.int64, ids.device)]


def hold_placeholders(seqs: list[Sequence]) -> None:
    """Stand in for the samples still on the device (they replace these once read back)."""
    for seq in seqs:
        seq.token_ids.append(PLACEHOLDER)
        seq.sample_pending = True


def drop_placeholder(seq: Sequence) -> None:
    if seq.sample_pending:
        seq.token_ids.pop()
        seq.sample_pending = False
