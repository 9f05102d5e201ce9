"""N-gram (prompt lookup) drafting: propose what followed the most recent earlier occurrence of the
sequence's last n tokens, trying n from `ngram_max` down to `ngram_min`.

When that continuation runs into the sequence's end (the occurrence is less than n + k tokens
back, as in a run of one token or a short loop), the draft goes on with the same period: the
hypothesis n-gram drafting makes, that the text repeats, says what follows. Cut at the end
instead, a run of one token drafted one token a step, half the steps of a repeat.

Costs one vectorized comparison over the token history per n; no model, no state between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    ngram_min: int = 2
    ngram_max: int = 4
    max_history: int | None = None  # look back at most this many tokens; None: the whole sequence

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens continuing `token_ids` (empty when no n-gram repeats)."""
        if num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        if self.max_history is not None:
            tokens = tokens[-self.max_history :]
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = _last_earlier_match(tokens, n)
            if start is not None:
                begin = start + n
                period = len(tokens) - begin
                return tokens[begin + np.arange(num_tokens) % period].tolist()
        return []


def _last_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window tokens[i:i+n] equal to the last n tokens, with i + n < len."""
    # Windows that start before len - n, so the match is an earlier occurrence with a continuation.
    history = tokens[:-1]
    if len(history) < n:
        return None
    windows = sliding_window_view(history, n)
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else None
