"""A request and its sequences as the engine tracks them: token ids, progress, blocks, state.

A `Request` is what a caller submitted (one prompt, one `SamplingParams`). Each of its `n` samples
is a `Sequence`, the unit the scheduler, block manager and sampler work on. Before its prompt is
computed a request with n > 1 has a single sequence; it is forked into n when the prompt's last
chunk is scheduled. Scheduling policy, block bookkeeping and sampling math live elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepserve.engine.outputs import TokenLogprob
from deepserve.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed` (sample 0 keeps the seed itself)."""
    if index == 0:
        return seed & _MASK64
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens and how far its KV is computed."""

    seq_id: int
    request: Request
    index: int  # sample index within the request (0..n-1)
    seed: int  # 64-bit sampling seed of this sample
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # keys of the full blocks, in order
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    matcher: Any = None  # engine.structured.GrammarMatcherState, when constrained
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens already delivered to the caller
    num_emitted_logprobs: int = 0
    finish_emitted: bool = False
    # Speculative decoding (engine/spec_decode): draft tokens to verify next step, never part of
    # token_ids until accepted; and the drafter's per-sequence progress (reset on preemption).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_state: Any = None
    # How many drafts this sequence proposes (spec_decode/throttle.py); kept across preemption,
    # since it follows the sequence's own history only.
    draft_throttle: Any = None
    # Async scheduling (engine/async_scheduling.py): the last token id is a placeholder for a
    # sample still on the device, never delivered or checked as a token.
    sample_pending: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass(eq=False)
class Request:
    """What one caller asked for: a prompt, its sampling params, and the sequences serving it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed (drawn at admission when params.seed is None)
    max_tokens: int  # resolved: never beyond the context limit
    arrival: float
    first_scheduled: float | None = None  # monotonic time of its first step; queue time's end
    compiled_grammar: Any = None  # engine.structured.CompiledGrammar, when constrained
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served from cache on first admission; -1 unknown
    num_device_cached_tokens: int = 0  # of which from the device pool (the rest: lower tiers)
    forked: bool = False
    error: str | None = None  # why the engine failed it (engine/step_isolation.py)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def needs_fork(self) -> bool:
        return self.n > 1 and not self.forked

    @property
    def is_finished(self) -> bool:
        return (not self.needs_fork) and all(s.is_finished for s in self.sequences)
