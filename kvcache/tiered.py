"""The facade the engine uses for the tiers below its own device pool: L1 host RAM, L2 shared store.

- `lookup(keys)`: how long a prefix of a block-key chain each tier holds (no data moved).
- `fetch_prefix(keys)`: the longest contiguous prefix, from L1 then L2, decoded and validated; L2
  is read in one pipelined round trip. A block that fails validation is a miss, is deleted from its
  tier, and is counted as an integrity failure. L2 hits are kept in L1 for next time.
- `offload(items)`: evicted device blocks go to L1 in the background (bounded queue).
- `write_through(items)`: full prompt blocks go to L2 in the background (bounded queue); the store
  writes each key once.
- `absent_from_store(keys)` / `rewrite_to_store(items)`: which blocks L2 lost (one EXISTS round
  trip), and writing them again at once; a prefill hand-off uses them (engine/async_engine.py).

Payloads are raw block bytes (any buffer); framing and checks are codec.py's. L2 blocks carry an
HMAC under `store_mac_key` (other processes can write there); L1 blocks, in this process's memory
only, a checksum. What does not live here: which device blocks to evict or fill (the engine's
block manager decides that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepserve.kvcache.codec import (
    BlockFormatError,
    BlockSpec,
    MACMismatchError,
    decode_block,
    encode_block,
)
from deepserve.kvcache.host_cache import HostCache
from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.store import BlockStore
from deepserve.kvcache.write_queue import Item, WriteQueue

HOST, STORE = "host", "store"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierLookup:
    host_blocks: int  # leading keys present in L1
    store_blocks: int  # keys right after those, present in L2


@dataclass
class FetchedPrefix:
    payloads: list[memoryview]  # validated payloads of keys[:len(payloads)]
    host_blocks: int  # how many of them came from L1 (they come first)
    store_blocks: int  # how many came from L2


class TieredKVCache:
    def __init__(
        self,
        spec: BlockSpec,
        metrics: KVCacheMetrics,
        host: HostCache | None = None,
        store: BlockStore | None = None,
        max_pending_bytes: int = 256 * 2**20,
        store_mac_key: bytes | None = None,
    ) -> None:
        if store is not None and not store_mac_key:
            raise ValueError("a shared KV store needs a MAC key (kvcache/codec.py)")
        self.spec = spec
        self.store_mac_key = store_mac_key
        self.metrics = metrics
        self._told_mac_rejection = False  # the hint is logged once, the counter counts them all
        self.host = host
        self.store = store
        for tier, present in ((HOST, host), (STORE, store)):
            if present is not None:
                metrics.init_tier(tier)
        self._offload_q = self._queue("kv-offload-host", self._write_host, HOST, max_pending_bytes)
        self._store_q = self._queue("kv-write-store", self._write_store, STORE, max_pending_bytes)

    def _queue(
        self, name: str, sink: Callable[[list[Item]], None], tier: str, max_bytes: int
    ) -> WriteQueue | None:
        if (self.host if tier == HOST else self.store) is None:
            return None
        drop = self.metrics.dropped.labels(tier).inc
        return WriteQueue(name, sink, max_bytes, on_drop=drop)

    # -- reads ---------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> TierLookup:
        n_host = self.host.prefix_length(keys) if self.host is not None else 0
        rest = keys[n_host:]
        n_store = 0
        if self.store is not None and rest:
            for present in self.store.exists_many(rest):
                if not present:
                    break
                n_store += 1
        return TierLookup(n_host, n_store)

    def fetch_prefix(self, keys: Sequence[str]) -> FetchedPrefix:
        """Validated payloads for the longest prefix of `keys` held by L1, then L2."""
        out: list[memoryview] = []
        if self.host is not None and keys:
            out += self._fetch_tier(HOST, keys, self.host.get_many, self.host.delete, None)
        n_host = len(out)
        rest = keys[n_host:]
        if self.store is not None and rest:
            store = self.store
            out += self._fetch_tier(STORE, rest, store.get_many, store.delete, self.store_mac_key)
        return FetchedPrefix(out, n_host, len(out) - n_host)

    def _fetch_tier(
        self,
        tier: str,
        keys: Sequence[str],
        get_many: Callable[[Sequence[str]], list[bytes | None]],
        delete: Callable[[Sequence[str]], None],
        mac_key: bytes | None,
    ) -> list[memoryview]:
        start = time.perf_counter()
        values = get_many(keys)
        good: list[tuple[str, bytes, memoryview]] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                break
            try:
                good.append((key, value, decode_block(self.spec, key, value, mac_key)))
            except BlockFormatError as e:
                delete([key])
                self.metrics.integrity_failures.labels(tier).inc()
                if isinstance(e, MACMismatchError):
                    self._count_mac_rejection(tier)
                break  # a chain with a gap is only usable up to the gap
        if tier == STORE and self.host is not None:
            for key, _, view in good:  # L1 keeps its own (checksummed) framing
                self.host.put(key, encode_block(self.spec, key, view))
        elif tier == HOST:
            self.metrics.bytes_in.labels(HOST).inc(sum(len(v) for _, v, _ in good))
        self.metrics.record_lookup(tier, len(keys), len(good))
        self.metrics.latency.labels(tier, "fetch").observe(time.perf_counter() - start)
        return [view for _, _, view in good]

    def _count_mac_rejection(self, tier: str) -> None:
        self.metrics.mac_rejections.labels(tier).inc()
        if not self._told_mac_rejection:
            self._told_mac_rejection = True
            log.warning(
                "an L2 block failed its MAC: it was forged, or written by a process with another "
                "KV secret; processes sharing a store need the same one ($DEEPSERVE_KV_SECRET or "
                "--kv-secret-file, docs/kvcache.md)"
            )

    # -- writes --------------------------------------------------------------------------------

    def offload(self, items: Sequence[Item]) -> int:
        """Queue evicted device blocks for L1; returns how many were accepted."""
        return self._offload_q.submit(items) if self._offload_q is not None else 0

    def write_through(self, items: Sequence[Item]) -> int:
        """Queue full prompt blocks for L2; returns how many were accepted."""
        return self._store_q.submit(items) if self._store_q is not None else 0

    def absent_from_store(self, keys: Sequence[str]) -> list[str]:
        """Those of `keys` the store lacks, in one EXISTS round trip; none when there is no store
        or it is known to be down (nothing could be written there anyway)."""
        if self.store is None or not keys or not self.store.available():
            return []
        present = self.store.exists_many(keys)
        return [key for key, p in zip(keys, present, strict=True) if not p]

    def rewrite_to_store(self, items: Sequence[Item]) -> int:
        """Write blocks the store lost (flushed, restarted, evicted) again, now, in the caller's
        thread: a prefill hand-off waits for them. Returns how many were written."""
        if self.store is None or not items:
            return 0
        mac = self.store_mac_key
        written = self.store.put_many([(k, encode_block(self.spec, k, p, mac)) for k, p in items])
        self.metrics.rewritten.labels(STORE).inc(written)
        return written

    def _write_host(self, items: list[Item]) -> None:
        assert self.host is not None
        for key, payload in items:
            self.host.put(key, encode_block(self.spec, key, payload))

    def _write_store(self, items: list[Item]) -> None:
        assert self.store is not None
        start = time.perf_counter()
        mac = self.store_mac_key
        self.store.put_many([(key, encode_block(self.spec, key, p, mac)) for key, p in items])
        self.metrics.latency.labels(STORE, "write_through").observe(time.perf_counter() - start)

    # -- lifecycle -----------------------------------------------------------------------------

    def drain(self, timeout: float | None = 10.0) -> bool:
        """Wait for queued offloads and write-throughs to finish (tests, benchmarks, shutdown)."""
        queues = [q for q in (self._offload_q, self._store_q) if q is not None]
        return all(q.drain(timeout) for q in queues)

    def close(self) -> None:
        for q in (self._offload_q, self._store_q):
            if q is not None:
                q.close()
        if self.store is not None:
            self.store.close()
