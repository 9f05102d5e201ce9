"""Per-sequence draft length: drafting turns itself down for a sequence whose drafts are rejected.

A rejected draft costs its verification rows, and an MTP draft also the MTP forward that made it;
a sequence that never accepts should cost about what plain decoding costs. The policy, per
sequence, from its own verification rounds and its own proposal opportunities only (never other
sequences, the batch or the clock; under `--batch-invariant` the output does not depend on drafting
at all, since acceptance is exact, but drafting stays a function of the request alone too):

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
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_TO_PAUSE = 2
MIN_PAUSE = 4
MAX_PAUSE = 64


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

    def _miss(self) -> None:
        self.misses += 1
        if self.misses >= MISSES_TO_PAUSE:
            self.waiting = self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)
