"""Routing policies: given the healthy candidates for a request, pick one worker.

`round_robin`, `least_load` (queue depth, then KV usage), `power_of_two` (the less loaded of two
random picks) and `cache_aware` (the worker holding the longest cached prefix of the request's whole
token sequence, when that prefix is a large enough share of it and the holder is not much busier
than the least loaded worker). Policies keep their own small
state (a counter, a seeded RNG); health and retries are the router's business, not theirs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from deepserve.router.pool import Worker
from deepserve.router.prefix_index import PrefixIndex
from deepserve.router.recent_routes import RecentRoutes, prefix_hashes

POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")


class Policy(Protocol):
    def choose(self, candidates: list[Worker], token_ids: list[int]) -> Worker: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Worker], token_ids: list[int]) -> Worker:
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return w


class LeastLoad:
    """Lowest load score; ties go round robin so idle workers share the work."""

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def choose(self, candidates: list[Worker], token_ids: list[int]) -> Worker:
        best = min(w.load_score() for w in candidates)
        return self._rr.choose([w for w in candidates if w.load_score() == best], token_ids)


class PowerOfTwo:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Worker], token_ids: list[int]) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.load_score() <= b.load_score() else b


@dataclass(frozen=True)
class CacheAwareConfig:
    block_size: int = 16
    # Fall back to least load when the best-matching worker's load exceeds the least loaded one's
    # by more than `balance_abs` AND more than `balance_rel` times it. SGLang's router documents
    # balance_abs_threshold 32: a request sent away from its prefix both recomputes it and evicts
    # another prefix there, so only a queue far longer than a prefill's cost may justify that.
    # A gap of a few requests is the normal jitter of a handful of concurrent streams.
    balance_abs: float = 32.0
    balance_rel: float = 1.5
    # A cached prefix pins a request to its holder only when it covers at least this share of
    # the request's tokens. Every chat starts with its template (a default system prompt): a
    # match of only that is cheap to recompute anywhere, and pinning on it sent every request to
    # the first worker that served one. Below the share, the request goes where the least is
    # running and cached, as a new prefix does (SGLang's router has the same cache threshold).
    min_match_ratio: float = 0.5
    # A new prefix goes to the worker caching the least, but footprints within this share of a
    # worker's pool count as equal and take turns: a few dozen blocks of a 50,000-block pool
    # evict nothing, and treating them as a difference sent every new chat to one worker for
    # as long as the other had served one more conversation before.
    footprint_slack: float = 0.01


class CacheAware:
    def __init__(
        self,
        index: PrefixIndex,
        config: CacheAwareConfig | None = None,
        recent: RecentRoutes | None = None,
    ) -> None:
        self.index = index
        self.config = config or CacheAwareConfig()
        self.recent = recent or RecentRoutes()
        self._least = LeastLoad()

    def choose(self, candidates: list[Worker], token_ids: list[int]) -> Worker:
        block_size = next((w.block_size for w in candidates if w.block_size), None)
        block_size = block_size or self.config.block_size
        hashes = prefix_hashes(token_ids, block_size)  # once, for the match and the record
        chosen = self._choose(candidates, token_ids, block_size, hashes)
        if chosen.worker_id is not None:
            self.recent.record_hashes(hashes, chosen.worker_id)
        return chosen

    def _choose(
        self, candidates: list[Worker], token_ids: list[int], block_size: int, hashes: list[int]
    ) -> Worker:
        by_id = {w.worker_id: w for w in candidates if w.worker_id is not None}
        matched = self.index.match(token_ids, block_size)
        for wid, n in self.recent.match_hashes(hashes, block_size).items():
            matched[wid] = max(n, matched.get(wid, 0))
        scored = [(n, w) for wid, n in matched.items() if (w := by_id.get(wid)) is not None]
        best_n = max((n for n, _ in scored), default=0)
        if best_n == 0 or best_n < self.config.min_match_ratio * len(token_ids):
            return self._emptiest(candidates, token_ids)
        # Equal matches (a prefix every worker holds) are shared out like a new prefix.
        best = self._emptiest([w for n, w in scored if n == best_n], token_ids)
        if self._too_busy(best, candidates):
            return self._least.choose(candidates, token_ids)
        return best

    def _emptiest(self, candidates: list[Worker], token_ids: list[int]) -> Worker:
        """A new prefix goes to the least loaded worker; among equals, the one caching the least
        (so tenants spread by cache footprint, not only by the moment's load), up to the slack."""
        best = min(w.load_score() for w in candidates)
        idle = [w for w in candidates if w.load_score() == best]
        least_held = min(self._held(w) for w in idle)
        light = [w for w in idle if self._held(w) <= least_held + self._slack(w)]
        return self._least.choose(light, token_ids)

    def _held(self, w: Worker) -> int:
        return self.index.held(w.worker_id) if w.worker_id is not None else 0

    def _slack(self, w: Worker) -> float:
        return self.config.footprint_slack * (w.load.num_blocks if w.load else 0)

    def _too_busy(self, best: Worker, candidates: list[Worker]) -> bool:
        least = min(w.load_score() for w in candidates)
        gap = best.load_score() - least
        return gap > self.config.balance_abs and best.load_score() > self.config.balance_rel * least


def make_policy(name: str, index: PrefixIndex, config: CacheAwareConfig, seed: int = 0) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "cache_aware":
        return CacheAware(index, config)
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
