"""`RecentRoutes`: where the router itself just sent each prefix, until the block events say so.

A worker publishes a block's "stored" event only after computing it, so requests that share a new
prefix and arrive together would all look uncached and spread over the workers. Remembering our
own routing decisions for a few seconds (block-aligned prefixes hashed here, chained like the
workers' keys but never compared with them) keeps such a burst on one worker. The block events
stay the source of truth: an entry only lives `ttl_s` and the index is checked alongside.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RecentRoutes:
    def __init__(
        self,
        ttl_s: float = 10.0,
        max_entries: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._routes: OrderedDict[int, tuple[str, float]] = OrderedDict()  # prefix -> worker, until

    def record(self, token_ids: list[int], block_size: int, worker_id: str) -> None:
        self.record_hashes(prefix_hashes(token_ids, block_size), worker_id)

    def match(self, token_ids: list[int], block_size: int) -> dict[str, int]:
        """Tokens of the longest prefix recently routed to each worker (unexpired entries only)."""
        return self.match_hashes(prefix_hashes(token_ids, block_size), block_size)

    # The policy hashes a request's prefixes once for both calls (`prefix_hashes`).

    def record_hashes(self, hashes: list[int], worker_id: str) -> None:
        until = self._clock() + self.ttl_s
        for h in hashes:
            self._routes[h] = (worker_id, until)
            self._routes.move_to_end(h)
        while len(self._routes) > self.max_entries:
            self._routes.popitem(last=False)

    def match_hashes(self, hashes: list[int], block_size: int) -> dict[str, int]:
        now, matched = self._clock(), {}
        for i, h in enumerate(hashes):
            entry = self._routes.get(h)
            if entry is None or entry[1] < now:
                break
            matched[entry[0]] = (i + 1) * block_size
        return matched


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the block-aligned prefixes of `token_ids`."""
    out, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out
