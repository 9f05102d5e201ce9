"""Counters for speculative decoding: drafted and accepted tokens, acceptance by draft position and
mean accepted length. One `SpecDecodeStats` per engine; the metrics exporter reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rounds that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts + one target token per round
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Record one sequence's verification round: `num_drafted` proposed, the first
        `num_accepted` of them accepted."""
        assert 0 <= num_accepted <= num_drafted
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        _grow(self.drafted_per_position, num_drafted)
        _grow(self.accepted_per_position, num_drafted)
        for pos in range(num_drafted):
            self.drafted_per_position[pos] += 1
            self.accepted_per_position[pos] += pos < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the target's own token)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rate_by_position(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        ]


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))
