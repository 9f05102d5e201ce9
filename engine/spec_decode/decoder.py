"""`SpeculativeDecoder`: the engine's one handle on speculative decoding.

How a step goes with speculation on (the engine, scheduler and runner call in here):
1. A decoding sequence carries drafts in `seq.spec_token_ids`. The scheduler gives it 1 + k query
   rows (its last token and the drafts, cut to the step's budget); the runner verifies all of them in
   one forward over the paged KV cache and samples every row with the ordinary sampler, row j seeing
   the sequence as if drafts 0..j-1 were accepted (`sampling_views`, `fill_draft_bitmasks`).
2. `verify` accepts the drafts that equal the target's own samples, so the output is token for token
   what plain decoding gives (greedy or seeded). The engine appends the emitted tokens one by one
   through its usual stop checks (stop tokens, max_tokens, grammar termination).
3. `commit_accepted` makes the accepted drafts' KV count as computed, registers blocks that are now
   full of verified tokens, and gives back blocks holding only rejected positions.
4. `propose` drafts the next step's tokens: n-gram lookup over the token ids, or the MTP layer fed
   with this step's target hidden states (it also writes the MTP layer's own KV for every newly
   verified position, so prefix-cache blocks carry it). How many per sequence is its
   `DraftThrottle`'s call (throttle.py); a throttled sequence runs no MTP rows at all, and an
   MTP sequence's first round drafts one token (the length grows as drafts are accepted).

Not here: the KV tensor (runner), block bookkeeping (block manager), stop rules (engine).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from deepserve.engine.block_manager import BlockManager
from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.request import Sequence
from deepserve.engine.scheduler import SchedulerOutput
from deepserve.engine.spec_decode.mtp import MtpProposer, MtpRows
from deepserve.engine.spec_decode.ngram import NgramProposer
from deepserve.engine.spec_decode.stats import SpecDecodeStats
from deepserve.engine.spec_decode.throttle import DraftThrottle, RecentRounds
from deepserve.engine.spec_decode.verifier import num_matching

logger = logging.getLogger(__name__)

MAX_SPECULATIVE_TOKENS = 5  # as DeepInfer: longer MTP chains are rarely accepted


class TokenProposer(Protocol):
    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]: ...


@dataclass
class MtpState:
    """Per-sequence MTP progress: positions below `computed` hold valid MTP KV."""

    computed: int


@dataclass
class StepHidden:
    """The target's hidden states of one step, for the MTP drafter."""

    hidden: torch.Tensor  # [T, hidden]: every query row of the flattened batch
    starts: list[int]  # per scheduled sequence, the position of its first query row


def create_speculative_decoder(
    config: EngineConfig, model, block_manager: BlockManager, max_model_len: int
) -> SpeculativeDecoder | None:
    """The decoder the config asks for, or None when speculation is off."""
    spec = config.speculative
    if spec is None:
        return None
    decoder = SpeculativeDecoder(spec, model, block_manager, max_model_len)
    logger.info(
        "speculative decoding: %s with %d draft tokens", spec.method, spec.num_speculative_tokens
    )
    return decoder


class SpeculativeDecoder:
    def __init__(
        self, spec: SpeculativeConfig, model, block_manager: BlockManager, max_model_len: int
    ) -> None:
        if not 1 <= spec.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {spec.num_speculative_tokens}"
            )
        self.method = spec.method
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.adaptive = spec.adaptive
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self.recent = RecentRounds()  # MTP's rounds: the prior for new sequences (throttle.py)
        # Drafts from the token ids alone: `propose(token_ids, num_tokens) -> list[int]`.
        self.token_proposer: TokenProposer | None = None
        self._mtp: MtpProposer | None = None
        if spec.method == "ngram":
            self.token_proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        elif spec.method == "mtp":
            if not getattr(model, "num_mtp_layers", 0):
                raise UnsupportedModelError(
                    "--speculative mtp needs a checkpoint with MTP layers "
                    "(num_nextn_predict_layers > 0); use --speculative ngram"
                )
            self._mtp = MtpProposer(model, block_manager.block_size)
        else:
            raise ValueError(f"unknown speculative method {spec.method!r} (mtp | ngram)")

    @property
    def needs_hidden(self) -> bool:
        return self._mtp is not None

    # ---- verification (runner and engine) -------------------------------------------------

    def verify(self, seq: Sequence, sampled: list[int]) -> list[int]:
        """Tokens to emit for `seq`: its accepted drafts and the target's token after them.

        `sampled` is the target's sample at each of the 1 + len(drafts) verified rows.
        """
        drafts = seq.spec_token_ids
        assert len(sampled) == len(drafts) + 1
        accepted = num_matching(drafts, sampled)
        self.stats.observe(len(drafts), accepted)
        if self._mtp is not None:
            self.recent.observe(len(drafts), accepted)
        if self.adaptive:
            self._throttle(seq).observe(len(drafts), accepted)
        return sampled[: accepted + 1]

    def commit_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """After the emitted tokens are appended: count the accepted drafts' KV as computed,
        register blocks now full of verified tokens, free blocks beyond the sequence."""
        seq.spec_token_ids = []
        if seq.is_finished:
            return
        seq.num_computed_tokens += num_accepted
        assert seq.num_computed_tokens == seq.num_tokens - 1
        self.block_manager.register_computed(seq)
        self.block_manager.trim(seq, seq.num_tokens)

    # ---- drafting ---------------------------------------------------------------------------

    def propose(
        self, out: SchedulerOutput, step: StepHidden | None, kv_cache: torch.Tensor
    ) -> None:
        """Set `spec_token_ids` for every sequence that sampled this step and is still running."""
        self.recent.tick()
        if self.token_proposer is not None:
            for seq in _sampled_seqs(out):
                if not seq.is_finished:
                    seq.spec_token_ids = self._token_drafts(seq)
            return
        assert step is not None
        self._propose_mtp(out, step, kv_cache)

    def draft_budget(self, seq: Sequence) -> int:
        """Drafts that can still be verified without passing max_tokens or the context limit."""
        room = min(
            seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        return max(0, min(self.num_speculative_tokens, room - 1))

    def may_run_ahead(self, seqs: list[Sequence]) -> bool:
        """No sequence drafts at its next opportunity (its drafting is paused, or for MTP the
        engine's cold window grants no probe now), so the step after this one needs none of this
        step's ids on the host (async scheduling)."""
        if not self.adaptive:
            return False
        held = self._mtp is not None and not self.recent.probe_due()  # once a step, not a row
        return all(s.draft_throttle is not None and (held or s.draft_throttle.paused) for s in seqs)

    def skip_opportunities(self, seqs: list[Sequence]) -> None:
        """The opportunities of a step run ahead (`may_run_ahead`), which `propose` never sees:
        sequences skip them as they would have there (MTP rows too); one whose draft was due
        defers it, as `_drafts_wanted` does when no probe is granted."""
        self.recent.tick()
        for seq in seqs:
            if seq.draft_throttle.take_opportunity():
                seq.draft_throttle.defer()

    def _throttle(self, seq: Sequence) -> DraftThrottle:
        if seq.draft_throttle is None:
            # Each MTP draft costs a forward and a device-to-host copy before the verification
            # can start (an n-gram draft costs neither): its length grows from one by acceptance,
            # and a new sequence starts paused while the MTP layer is being refused everywhere.
            k = self.num_speculative_tokens
            if self._mtp is None:
                seq.draft_throttle = DraftThrottle(k)
            elif self.recent.cold:
                seq.draft_throttle = DraftThrottle.cold(k)
            else:
                seq.draft_throttle = DraftThrottle(k, allowed=1)
        return seq.draft_throttle

    def _drafts_wanted(self, seq: Sequence) -> int:
        """Drafts to propose for a decoding sequence at this opportunity (0: skip drafting, and
        for MTP its rows too). Consumes the opportunity: call once per sequence and step."""
        budget = self.draft_budget(seq)
        if not self.adaptive:
            return budget
        throttle = self._throttle(seq)
        drafts = min(budget, throttle.take_opportunity())
        if drafts and self._mtp is not None and not self.recent.grant_probe():
            throttle.defer()
            return 0
        return drafts

    def _token_drafts(self, seq: Sequence) -> list[int]:
        assert self.token_proposer is not None
        budget = self._drafts_wanted(seq)
        if not budget:
            return []
        drafts = self.token_proposer.propose(seq.token_ids, budget)[:budget]
        if not drafts and self.adaptive:
            self._throttle(seq).nothing_proposed()
        return grammar_prefix(seq, drafts)

    def _propose_mtp(self, out: SchedulerOutput, step: StepHidden, kv_cache: torch.Tensor) -> None:
        assert self._mtp is not None
        work: list[MtpRows] = []
        owners: list[Sequence] = []
        for seq, rows in self._mtp_rows(out, step):
            work.append(rows)
            owners.append(seq)
        drafts = self._mtp.propose(work, kv_cache)
        for seq, rows, seq_drafts in zip(owners, work, drafts, strict=True):
            seq.draft_state = MtpState(rows.start + len(rows.token_ids))
            if rows.num_drafts:
                seq.spec_token_ids = grammar_prefix(seq, seq_drafts)

    def _mtp_rows(
        self, out: SchedulerOutput, step: StepHidden
    ) -> Iterator[tuple[Sequence, MtpRows]]:
        """(sequence, MtpRows) for every scheduled sequence with newly verified positions."""
        children = {id(f.parent): f.children for f in out.forks}
        offset = 0
        for item, start in zip(out.scheduled, step.starts, strict=True):
            seq, n = item.seq, item.num_new_tokens
            rows_hidden = step.hidden[offset : offset + n]
            offset += n
            for target in [seq, *children.get(id(seq), [])]:
                if target.is_finished:
                    continue
                rows = self._catch_up(target, start, rows_hidden, own=target is seq)
                if rows is not None:
                    yield target, rows

    def _catch_up(
        self, seq: Sequence, start: int, step_hidden: torch.Tensor, own: bool
    ) -> MtpRows | None:
        """MTP rows from the first position without MTP KV up to the newest known token.

        `step_hidden[i]` is the target hidden state at position start + i (this step's queries).
        """
        state = seq.draft_state if own else None
        valid = seq.num_computed_tokens - start  # verified target rows this step
        first = state.computed if state is not None and state.computed >= start else start
        if not own:  # a forked sample: redo only its private partial block, then its own head
            block_size = self.block_manager.block_size
            first = max(start, (seq.num_computed_tokens // block_size) * block_size)
        last = min(seq.num_tokens - 1, start + valid)  # the token at p and hidden at p-1 known
        if last < first:
            return None
        is_decoding = seq.num_computed_tokens == seq.num_tokens - 1
        num_drafts = self._drafts_wanted(seq) if is_decoding else 0
        if is_decoding and self.adaptive and not num_drafts:
            # Throttled (or at the end): no MTP forward at all. Positions skipped here never get
            # MTP KV, which only lowers the quality of later drafts, as a prefix-cache hit's
            # zero hidden state does.
            return None
        prev = _prev_hidden(first, last, start, step_hidden)
        num_drafts = self._reserve_mtp_slots(seq, num_drafts)
        if num_drafts < 0:
            return None
        return MtpRows(
            block_table=seq.block_table,
            start=first,
            token_ids=seq.token_ids[first : last + 1],
            prev_hidden=prev,
            num_drafts=num_drafts,
        )

    def _reserve_mtp_slots(self, seq: Sequence, num_drafts: int) -> int:
        """Blocks for the MTP rows up to the newest token plus the chained drafts' positions.
        Returns the drafts that fit (-1: not even the newest token's row fits)."""
        for n in (num_drafts, 0) if num_drafts else (0,):
            # Slots needed up to position num_computed + max(n, 1) - 1.
            if self.block_manager.allocate(seq, max(n, 1)):
                return n
        return -1


def _prev_hidden(first: int, last: int, start: int, step_hidden: torch.Tensor) -> torch.Tensor:
    """Target hidden states at positions first-1 .. last-1 (this step's rows begin at `start`)."""
    if first > start:
        return step_hidden[first - 1 - start : last - start]
    # Position 0, or the first token after a prefix-cache hit: the target's hidden state before it
    # was never computed by this sequence. A zero vector only lowers draft quality.
    zero = torch.zeros_like(step_hidden[:1])
    return torch.cat([zero, step_hidden[: last - start]])


def sampling_views(seq: Sequence) -> list[Sequence]:
    """One sequence per verified row: row j sees drafts 0..j-1 as already generated, so its
    output position (the RNG counter), penalties and min_tokens are those plain decoding has."""
    drafts = seq.spec_token_ids
    views = [seq]
    for j in range(1, len(drafts) + 1):
        views.append(dataclasses.replace(seq, token_ids=seq.token_ids + drafts[:j]))
    return views


def fill_draft_bitmasks(seq: Sequence, bitmask: torch.Tensor, first_row: int) -> None:
    """Fill the grammar masks of a sequence's verified rows: row first_row + j after drafts 0..j-1.

    The matcher is advanced through the drafts and rolled back, so it ends where it started.
    """
    matcher = seq.matcher
    advanced = 0
    for j, token in enumerate([*seq.spec_token_ids, None]):
        # Rows after an accepted stop token are never used: the sequence ends there.
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, first_row + j)
        if token is None or not matcher.accept(token):
            break
        advanced += 1
    matcher.rollback(advanced)


def grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the sequence's grammar allows (all of them if unconstrained)."""
    matcher = seq.matcher
    if matcher is None or not drafts:
        return drafts
    n = 0
    while n < len(drafts) and not matcher.is_terminated() and matcher.accept(drafts[n]):
        n += 1
    matcher.rollback(n)
    return drafts[:n]


def _sampled_seqs(out: SchedulerOutput) -> list[Sequence]:
    children = {id(f.parent): f.children for f in out.forks}
    seqs: list[Sequence] = []
    for item in out.scheduled:
        if item.sample:
            seqs += [item.seq, *children.get(id(item.seq), [])]
    return seqs
