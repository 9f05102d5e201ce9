"""L1: encoded KV blocks in host RAM, least recently used first out, under a hard byte limit.

The limit is never exceeded, not even for a moment: room is made before a value is inserted, and a
value larger than the whole limit is refused. Thread-safe (the engine thread reads while the
offload thread writes). Knows nothing about what the bytes mean.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from deepserve.kvcache.metrics import KVCacheMetrics

TIER = "host"


class HostCache:
    def __init__(self, max_bytes: int, metrics: KVCacheMetrics | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in order (None when absent); hits become the most recently used."""
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._entries.get(key)
                if value is not None:
                    self._entries.move_to_end(key)
                out.append(value)
        return out

    def prefix_length(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present without a gap."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._entries:
                    return i
            return len(keys)

    def put(self, key: str, value: bytes) -> bool:
        """Insert (or refresh) one value; False when it is larger than the whole cache."""
        size = len(value)
        if size > self._max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
            evicted = 0
            while self._used + size > self._max_bytes:
                _, victim = self._entries.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
            self._entries[key] = value
            self._used += size
            used = self._used
        self._observe(evicted, used, size)
        return True

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._used -= len(old)
            used = self._used
        if self._metrics is not None:
            self._metrics.used_bytes.labels(TIER).set(used)

    def _observe(self, evicted: int, used: int, written: int) -> None:
        if self._metrics is None:
            return
        if evicted:
            self._metrics.evictions.labels(TIER).inc(evicted)
        self._metrics.used_bytes.labels(TIER).set(used)
        self._metrics.bytes_out.labels(TIER).inc(written)
