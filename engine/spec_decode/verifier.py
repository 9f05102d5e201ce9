"""Deciding which draft tokens the target model accepts.

The engine's drafters (n-gram, greedy MTP) propose a point mass. The target samples every one of
the k+1 verified positions with its ordinary sampler, whose randomness depends only on (seed,
output position, token id); a draft is accepted while it equals the target's own sample there.
The emitted tokens are then exactly the tokens plain decoding would have produced with that seed,
greedy or not. A drafter with a proposal distribution would need rejection sampling instead
(accept with probability min(1, p/q), resample from max(0, p - q)); none exists here, so neither
does that rule.
"""

from __future__ import annotations


def num_matching(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the target's samples (one sequence, host lists)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n
