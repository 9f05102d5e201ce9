"""Deciding what runs each step: continuous batching under a token budget, with preemption.

Every step has a budget of `max_num_batched_tokens` new tokens and at most `max_num_seqs` running
sequences. There is no separate prefill or decode phase: each running sequence asks for the tokens
it has not computed yet (one for a decode, many for a prompt), and a long prompt is cut into chunks
that fit what is left of the budget, so prefill chunks ride along with decodes in one step.

Running sequences are served first, oldest first. When the block pool cannot hold a running
sequence's next tokens, the newest running sequence is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue (its prefix may well still be in the cache when
it returns). Waiting sequences are admitted FCFS, and only in steps that preempted nothing.

A request with n > 1 is admitted as one sequence; when its prompt's last chunk is scheduled the
other n - 1 samples are forked from it: they share the full prompt blocks and get a copy of the
partial last one, and sample their first token from the same logits row.
The scheduler does not run the model or sample; the engine applies results through `update_*`.

With `prefill_gather_s` set (engines whose decode steps replay CUDA graphs), requests that arrive
while only decodes run wait up to that long for more arrivals before they join a step: a decode
step replays a graph, but a step carrying a prompt runs eagerly at about the cost of a full one,
so a burst admitted a few requests a step cost many eager steps instead of one (TGI holds new
prefills back the same way, `--waiting-served-ratio` / `--max-waiting-tokens`). They join at once
when they fill every free slot or the step's token budget.

With `prefill_group_tokens` set (the CPU engines), a waiting prompt joins a step that already
computes prompt tokens only while the step's prompt tokens, its own included, stay within it. A
CPU forward's time grows with its rows from a few hundred on (no batching gain left to take), so
a second long prompt in the step would only delay the first one's token: eight 1,024-token prompts
arriving together get their first tokens after 1, 2, ..., 8 prompts' work instead of 2, 4, ..., 8
(the same total work). Short prompts still share a step up to the limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deepserve.engine.block_manager import BlockManager, PrefixMatch
from deepserve.engine.request import Request, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    sample: bool  # this chunk ends at the sequence's last token, so its logits are sampled


@dataclass
class Fork:
    parent: Sequence
    children: list[Sequence]  # they sample from the parent's logits row this step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) after forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_gather_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,  # the clock of `Request.arrival`
        prefill_group_tokens: int | None = None,  # None: prompts fill the whole budget
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_gather_s = prefill_gather_s
        self.clock = clock
        self.prefill_group_tokens = prefill_group_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request's first sequence (the others are forked from it later)."""
        seq = request.sequences[0]
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence now (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted and not self._hold_arrivals(out, budget):
            self._schedule_waiting(out, budget)
        return out

    def _hold_arrivals(self, out: SchedulerOutput, budget: int) -> bool:
        """Keep the waiting queue out of a decode-only step while a burst may still be arriving
        (module docstring): the oldest waiting request is younger than `prefill_gather_s`, and
        the waiting ones fill neither the free slots nor the token budget."""
        if self.prefill_gather_s <= 0 or not self.waiting or not out.scheduled:
            return False
        if any(item.num_new_tokens != 1 + len(item.seq.spec_token_ids) for item in out.scheduled):
            return False  # this step runs eagerly anyway: arrivals ride along for free
        if len(self.waiting) >= self.max_num_seqs - self._num_slots():
            return False
        if sum(seq.num_tokens for seq in self.waiting) >= budget:
            return False
        return self.clock() - self.waiting[0].request.arrival < self.prefill_gather_s

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # forked this step; its first token is sampled from the parent's row
                i += 1
                continue
            n += _fit_drafts(seq, budget - n)
            while not self._allocate(seq, n, None):
                if seq.spec_token_ids:  # drop speculation before preempting anyone
                    n -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            self._commit(out, seq, n)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        prompt_tokens = sum(_prompt_chunk(item) for item in out.scheduled)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slots = seq.request.n if seq.request.needs_fork else 1
            if self._num_slots() + slots > self.max_num_seqs:
                return
            match = self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - match.num_blocks() * self.block_manager.block_size, budget)
            if not self._joins_prompts(prompt_tokens, n):
                return
            if not self._allocate(seq, n, match):
                return
            self.waiting.popleft()
            self._record_cache_hit(seq, match)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._commit(out, seq, n)
            budget -= n
            prompt_tokens += _prompt_chunk(out.scheduled[-1])

    def _joins_prompts(self, prompt_tokens: int, n: int) -> bool:
        """Whether a prompt chunk of `n` tokens joins a step already computing `prompt_tokens`
        prompt tokens (module docstring): always into a step without any."""
        limit = self.prefill_group_tokens
        return limit is None or prompt_tokens == 0 or prompt_tokens + n <= limit

    def _record_cache_hit(self, seq: Sequence, match: PrefixMatch) -> None:
        request = seq.request
        if request.num_cached_tokens < 0:  # only the first admission counts, not re-admissions
            block_size = self.block_manager.block_size
            request.num_cached_tokens = match.num_blocks() * block_size
            request.num_device_cached_tokens = len(match.device_blocks) * block_size

    def _num_slots(self) -> int:
        """Running sequences plus the samples still to be forked from them."""
        pending = sum(s.request.n - 1 for s in self.running if s.request.needs_fork)
        return len(self.running) + pending

    def _completes_prompt_fork(self, seq: Sequence, num_new: int, start: int) -> bool:
        return seq.request.needs_fork and start + num_new == seq.num_tokens

    def _allocate(self, seq: Sequence, n: int, match: PrefixMatch | None) -> bool:
        block_size = self.block_manager.block_size
        start = match.num_blocks() * block_size if match else seq.num_computed_tokens
        extra = 0
        if self._completes_prompt_fork(seq, n, start) and seq.num_tokens % block_size:
            extra = seq.request.n - 1
        return self.block_manager.allocate(seq, n, match, extra_blocks=extra)

    def _commit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        sample = seq.num_computed_tokens + n >= seq.num_tokens  # > when drafts ride along
        out.scheduled.append(ScheduledSeq(seq, n, sample))
        if self._completes_prompt_fork(seq, n, seq.num_computed_tokens):
            self._fork(out, seq)

    def _fork(self, out: SchedulerOutput, parent: Sequence) -> None:
        request = parent.request
        children = request.sequences[1:]
        for child in children:
            copy = self.block_manager.fork(parent, child)
            if copy is not None:
                out.block_copies.append(copy)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        request.forked = True
        out.forks.append(Fork(parent, children))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.draft_state = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _fit_drafts(seq: Sequence, budget: int) -> int:
    """Speculative drafts verified with a decode step (engine/spec_decode), cut to the budget."""
    if len(seq.spec_token_ids) > budget:
        seq.spec_token_ids = seq.spec_token_ids[: max(budget, 0)]
    return len(seq.spec_token_ids)


def _prompt_chunk(item: ScheduledSeq) -> int:
    """The prompt tokens a scheduled item computes: 0 for a decode row and its drafts."""
    decode = 1 + len(item.seq.spec_token_ids)
    return 0 if item.num_new_tokens <= decode else item.num_new_tokens
