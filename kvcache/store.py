"""The interface every shared KV store implements (Redis, local disk, ...): bytes in, bytes out,
keyed by str, in bulk.

Contract: no method raises for a store fault (unreachable, slow, full, corrupt file): a read that
fails is a miss (None / False), a write that fails is simply not done. Callers never need a
try/except around a store; faults are counted in metrics by the store itself. What the bytes mean
(block codec) is not the store's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

# Connect/read timeout of one socket operation of a networked store, the one default every layer
# (CLI, EngineConfig, RedisStoreConfig) uses: well under a TTFT budget, above a loaded Redis's
# reply time for a batch of blocks.
DEFAULT_TIMEOUT_S = 0.5


class BlockStore(ABC):
    """A shared, content-addressed byte store. Values for one key never change, so a write only
    has to happen once per key (`put_many` skips keys that already exist)."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values for `keys` in order, None for each missing or unreadable one; one round trip."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Write the values whose keys are absent; return how many were newly written."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present (False when the store cannot be asked)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys (used to drop entries that failed validation)."""

    def available(self) -> bool:
        """False while the store is known to be unreachable (a circuit breaker open): work that
        only a reachable store could use may be skipped. The default store is always reachable."""
        return True

    def close(self) -> None:
        """Release connections or handles; the default has none."""
        return None
