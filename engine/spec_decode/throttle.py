"""Per-sequence draft length: drafting turns itself down for a sequence whose drafts are rejected.

A rejected draft costs its verification rows, and an MTP draft also the MTP forward that made it;
a sequence that never accepts should cost about what plain decoding costs. The policy, per
sequence, from its own verification rounds and its own proposal opportunities (never the batch or
the clock; acceptance is exact, so drafting changes no output under `--batch-invariant`), with one
prior shared by the engine's sequences (`RecentRounds`, below):

- it starts at the drafter's first length: the configured k for n-gram lookup, one for MTP (each
  MTP draft is a forward of the MTP layer and a device-to-host copy, paid before verification
  starts; with drafts never accepted, a first round of k = 3 made 2 of the 8 eager MTP forwards
  of a 96-token request, and the only verification of 4 rows);
- a round whose drafts were all accepted lets the next round draft one more (up to k); after a
  round with some drafts accepted the next drafts `accepted + 1`;
- a round with none accepted is a miss: the next round drafts one token; an opportunity at which
  the drafter finds nothing (no n-gram match) is a miss too, the length kept and its pause always
  the shortest; after `MISSES_TO_PAUSE` misses in a row drafting pauses for `MIN_PAUSE` proposal opportunities, then probes with one
  draft; each further miss doubles the pause, up to `MAX_PAUSE`. Any accepted draft ends the
  pausing (the next pause starts at `MIN_PAUSE` again).

So a sequence that accepts nothing drafts one token about once every `MAX_PAUSE + 1` steps in the
long run. A proposal opportunity is a step in which the sequence sampled (its `propose` call, or,
under async scheduling, the launch of a step run ahead: only a paused sequence's steps run ahead,
engine/async_scheduling.py). A paused sequence needs no token on the host before its next step.

The shared prior, MTP only: whether an MTP draft is accepted is a property of the checkpoint's MTP
layer more than of one prompt (a fine-tune that left the MTP layer behind, random MTP weights),
while an n-gram draft's fate is the prompt's content. When none of the engine's last `COLD_ROUNDS`
MTP rounds accepted a draft, a new sequence starts in the longest pause (`DraftThrottle.cold`):
it probes once `MAX_PAUSE` steps in instead of paying its first rounds' MTP forwards and
synchronous steps, which on a short request were most of its cost. Its probes still feed the
window, so one accepted draft anywhere warms the next sequences again. While the window is cold
the engine also grants at most one MTP round per `COLD_PROBE_STEPS` of its steps, whichever
sequence asks (`RecentRounds.grant_probe`; a refused sequence pauses again, `DraftThrottle.defer`):
a probe costs the whole batch a synchronous step, an eager MTP forward and a verification step,
so per-sequence pauses alone made eight sequences probe eight times as often as one (tiny-deepseek
at batch 8 on the H200: 24 rounds in a 480-token run, 0.87x plain decoding, run-gpu17-1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MISSES_TO_PAUSE = 2
MIN_PAUSE = 4
MAX_PAUSE = 128
COLD_ROUNDS = 8  # rounds with nothing accepted before new sequences start paused
COLD_PROBE_STEPS = 1024  # engine steps between two MTP rounds while the rounds are cold


@dataclass
class DraftThrottle:
    max_drafts: int
    allowed: int = 0  # drafts the next round may propose (0 at creation: max_drafts)
    misses: int = 0  # misses in a row (nothing accepted, or nothing proposed)
    waiting: int = 0  # proposal opportunities still to skip
    pause: int = MIN_PAUSE  # the next pause's length

    def __post_init__(self) -> None:
        if not self.allowed:
            self.allowed = self.max_drafts

    @classmethod
    def cold(cls, max_drafts: int) -> DraftThrottle:
        """A throttle that starts as if its sequence had already missed its way to the longest
        pause: one draft a probe, the first after `MAX_PAUSE` opportunities."""
        return cls(max_drafts, allowed=1, misses=MISSES_TO_PAUSE, waiting=MAX_PAUSE,
                   pause=MAX_PAUSE)  # fmt: skip

    @property
    def paused(self) -> bool:
        return self.waiting > 0

    def take_opportunity(self) -> int:
        """Called once per proposal opportunity: how many drafts to propose now (0: none)."""
        if self.waiting > 0:
            self.waiting -= 1
            return 0
        return self.allowed

    def observe(self, drafted: int, accepted: int) -> None:
        """One verification round of this sequence: `drafted` proposed, `accepted` kept."""
        if drafted == 0:
            return
        if accepted == 0:
            self.allowed = 1
            self._miss()
            return
        self.misses = 0
        self.pause = MIN_PAUSE
        grown = max(self.allowed, drafted) + 1 if accepted == drafted else accepted + 1
        self.allowed = min(self.max_drafts, grown)

    def nothing_proposed(self) -> None:
        """The drafter had nothing to propose at an opportunity it was given (no n-gram match):
        a miss for pausing, though the draft length stays and the pause is always the shortest
        (finding nothing costs no verification; pausing only lets steps run ahead, and a long
        pause would miss the start of a repeat)."""
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.waiting = MIN_PAUSE

    def defer(self) -> None:
        """The draft due now was refused (the engine's probe budget, `RecentRounds`): pause
        again as long as the last pause."""
        self.waiting = self.pause

    def _miss(self) -> None:
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.waiting = self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)


@dataclass
class RecentRounds:
    """The engine's last `COLD_ROUNDS` verification rounds (drafted, accepted), all sequences."""

    rounds: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=COLD_ROUNDS))
    steps: int = 0  # engine steps seen (`tick`)
    last_probe: int | None = None  # the step of the last round granted while cold

    def tick(self) -> None:
        """One engine step (synchronous or run ahead)."""
        self.steps += 1

    def probe_due(self) -> bool:
        """A round may run now: the window is warm, or no round ran in the last
        `COLD_PROBE_STEPS` steps."""
        if not self.cold or self.last_probe is None:
            return True
        return self.steps - self.last_probe >= COLD_PROBE_STEPS

    def grant_probe(self) -> bool:
        """`probe_due`, and while cold the grant is recorded (the next one waits its turn)."""
        if not self.probe_due():
            return False
        if self.cold:
            self.last_probe = self.steps
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rounds.append((drafted, accepted))

    @property
    def cold(self) -> bool:
        """A full window of rounds and not one accepted draft in it."""
        return len(self.rounds) == COLD_ROUNDS and not any(a for _, a in self.rounds)
