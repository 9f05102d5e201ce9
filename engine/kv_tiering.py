"""The engine's side of the KV tiers: plugs kvcache/ (L1 host RAM, L2 shared store) into the block
manager's `KVTierHooks` and moves block bytes between the device KV cache and the tiers.

- `lookup(keys)` (called by the block manager's prefix match, after the device pool): fetches the
  longest prefix the tiers hold, L1 then L2 in one pipelined round trip, validates it, and stages
  the payloads, so the later load cannot miss even if the store dies in between.
- `load_pending(loads)`: before the forward, writes the staged payloads into the device blocks the
  block manager allocated for them, and attributes them to requests per tier.
- `on_evict(key, block_id)`: copies an evicted device block out (it is about to be reused) and
  hands it to the background L1 offload queue.
- `on_store(key, block_id)`: copies a newly computed full block and hands it to the background L2
  write-through queue (the store writes each key once).
- `snapshot_cached(keys, block_of)`: copies of device blocks a prefill hand-off found missing
  from the store (it was flushed or restarted), to write them again.

Keys are the block manager's chained prefix hashes (salted with the model fingerprint), as hex.
What does not live here: which blocks to evict or reuse (block manager) and byte formats (codec).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from urllib.parse import urlparse

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from deepserve.engine.config import KVTierConfig
from deepserve.engine.models.base import KVCacheSpec
from deepserve.kvcache.codec import BlockSpec, process_mac_key
from deepserve.kvcache.disk_store import DiskStore
from deepserve.kvcache.host_cache import HostCache
from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.redis_store import RedisStore, RedisStoreConfig
from deepserve.kvcache.redis_url import REDIS_SCHEMES
from deepserve.kvcache.store import BlockStore
from deepserve.kvcache.tiered import HOST, STORE, TieredKVCache

# Block bytes are moved through same-width integer views, so copies are bit-exact for any dtype.
_INT_VIEW = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}


def block_spec(kv: KVCacheSpec, block_size: int, fingerprint: str) -> BlockSpec:
    dtype = str(kv.dtype).removeprefix("torch.")
    return BlockSpec(fingerprint, kv.num_layers, block_size, kv.width, dtype)


def open_store(config: KVTierConfig, metrics: KVCacheMetrics) -> BlockStore | None:
    """The L2 store named by `config.store_url` (redis[s]://, redis[s]+cluster://, file://),
    or None."""
    url = config.store_url
    if not url:
        return None
    scheme = urlparse(url).scheme
    if scheme in REDIS_SCHEMES:
        redis_config = RedisStoreConfig(
            url=url, ttl_s=config.store_ttl_s, timeout_s=config.store_timeout_s
        )
        return RedisStore(redis_config, metrics)
    if scheme == "file":
        return DiskStore(urlparse(url).path, config.store_max_bytes, metrics)
    raise ValueError(
        f"unsupported KV store URL scheme {scheme!r} (redis, rediss, redis+cluster, rediss+cluster, file)"
    )


class KVTiering:
    """Implements the block manager's KVTierHooks over a `TieredKVCache`."""

    name = "kvcache"

    def __init__(
        self,
        tiers: TieredKVCache,
        registry: CollectorRegistry,
        max_parked_bytes: int = 256 * 2**20,
    ) -> None:
        self.tiers = tiers
        self.registry = registry
        self.metrics = tiers.metrics
        # Fetched this step, pinned until load_pending: key -> (tier, payload).
        self._staged: dict[bytes, tuple[str, memoryview]] = {}
        # Fetched but not loaded (the request could not be admitted yet), kept so a waiting
        # request does not fetch its prefix again every step; bounded in bytes, oldest out.
        self._parked: OrderedDict[bytes, tuple[str, memoryview]] = OrderedDict()
        self._parked_bytes = 0
        self._max_parked_bytes = max_parked_bytes
        self._from_store: set[bytes] = set()  # loaded from L2 this step: no need to write back
        self._by_request: dict[str, dict[str, int]] = {}
        self._cache: torch.Tensor | None = None
        self._cache_np: np.ndarray | None = None

    @classmethod
    def from_config(
        cls, config: KVTierConfig, kv: KVCacheSpec, block_size: int, fingerprint: str
    ) -> KVTiering:
        registry = CollectorRegistry()
        metrics = KVCacheMetrics(registry)
        host = HostCache(config.host_bytes, metrics) if config.host_bytes > 0 else None
        tiers = TieredKVCache(
            block_spec(kv, block_size, fingerprint),
            metrics,
            host=host,
            store=open_store(config, metrics),
            max_pending_bytes=config.max_pending_bytes,
            store_mac_key=config.store_mac_key or process_mac_key(),
        )
        return cls(tiers, registry, config.max_pending_bytes)

    def bind_cache(self, kv_cache: torch.Tensor) -> None:
        """Attach the device KV cache `[layers, blocks, block_size, width]` (made by the runner)."""
        spec = self.tiers.spec
        expected = (spec.num_layers, spec.block_size, spec.width)
        if (kv_cache.shape[0], *kv_cache.shape[2:]) != expected:
            raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} does not match {spec}")
        torch_int, _ = _INT_VIEW[kv_cache.element_size()]
        self._cache = kv_cache.view(torch_int)
        self._cache_np = self._cache.numpy() if kv_cache.device.type == "cpu" else None

    # ---- KVTierHooks ----------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> int:
        """How many of `keys` the tiers supply; their payloads are staged for `load_pending`."""
        n = 0
        while n < len(keys) and self._stage_known(keys[n]):
            n += 1
        if n < len(keys):
            fetched = self.tiers.fetch_prefix([k.hex() for k in keys[n:]])
            tiers = [HOST] * fetched.host_blocks + [STORE] * fetched.store_blocks
            for key, tier, payload in zip(keys[n:], tiers, fetched.payloads, strict=False):
                self._staged[key] = (tier, payload)
            n += len(fetched.payloads)
        return n

    def _stage_known(self, key: bytes) -> bool:
        if key in self._staged:
            return True
        entry = self._parked.pop(key, None)
        if entry is None:
            return False
        self._parked_bytes -= entry[1].nbytes
        self._staged[key] = entry
        return True

    def _park_unloaded(self) -> None:
        for key, entry in self._staged.items():
            self._parked[key] = entry
            self._parked_bytes += entry[1].nbytes
        self._staged.clear()
        while self._parked_bytes > self._max_parked_bytes:
            _, (_, payload) = self._parked.popitem(last=False)
            self._parked_bytes -= payload.nbytes

    def on_evict(self, key: bytes, block_id: int) -> None:
        if self.tiers.host is None or key.hex() in self.tiers.host:
            return
        self.tiers.offload([(key.hex(), self._snapshot(block_id))])

    def on_store(self, key: bytes, block_id: int) -> None:
        if self.tiers.store is None or key in self._from_store:
            return
        self.tiers.write_through([(key.hex(), self._snapshot(block_id))])

    def snapshot_cached(
        self, keys: list[str], block_of: Callable[[bytes], int | None]
    ) -> list[tuple[str, np.ndarray]]:
        """Host copies of those of `keys` (hex) the device pool still holds (`block_of`: the block
        manager's `cached_block`), to write them to the store again. On the engine thread, so no
        block is reused while it is copied."""
        items = []
        for key in keys:
            block_id = block_of(bytes.fromhex(key))
            if block_id is not None:
                items.append((key, self._snapshot(block_id)))
        return items

    # ---- engine step ----------------------------------------------------------------------

    def load_pending(self, loads: list[tuple[bytes, int]], sequences: Iterable) -> None:
        """Write staged payloads into their device blocks (before the forward), then attribute
        the loaded tokens per tier to the requests of `sequences` (this step's scheduled ones)."""
        self._from_store.clear()
        tier_of_block: dict[int, str] = {}
        for key, block_id in loads:
            # Staged by lookup in this same schedule(); two requests may load the same key.
            tier, payload = self._staged[key]
            self.write_block(block_id, payload)
            tier_of_block[block_id] = tier
            if tier == STORE:
                self._from_store.add(key)
        for key, _ in loads:
            self._staged.pop(key, None)
        self._park_unloaded()
        if tier_of_block:
            self._attribute(tier_of_block, sequences)

    def _attribute(self, tier_of_block: dict[int, str], sequences: Iterable) -> None:
        block_size = self.tiers.spec.block_size
        for seq in sequences:
            counts: dict[str, int] = {}
            for block_id in seq.block_table:
                tier = tier_of_block.get(block_id)
                if tier is not None:
                    counts[tier] = counts.get(tier, 0) + block_size
            if counts:
                self._by_request.setdefault(seq.request.request_id, counts)

    def cached_tokens_by_tier(self, request_id: str, finished: bool) -> dict[str, int]:
        """Tokens of a request's prompt loaded from "host" and "store" (forgotten once finished)."""
        if finished:
            return self._by_request.pop(request_id, {})
        return dict(self._by_request.get(request_id, {}))

    def close(self) -> None:
        self.tiers.close()

    # ---- bytes in and out of the device cache ---------------------------------------------

    def _snapshot(self, block_id: int) -> np.ndarray:
        """A contiguous host copy of one block on every layer (taken before the block is reused)."""
        assert self._cache is not None, "bind_cache() first"
        if self._cache_np is not None:
            return np.ascontiguousarray(self._cache_np[:, block_id])
        return self._cache[:, block_id].cpu().numpy()

    def write_block(self, block_id: int, payload: memoryview) -> None:
        """Copy one validated payload into device block `block_id` on every layer."""
        assert self._cache is not None, "bind_cache() first"
        spec = self.tiers.spec
        _, np_int = _INT_VIEW[self._cache.element_size()]
        src = np.frombuffer(payload, dtype=np_int).reshape(
            spec.num_layers, spec.block_size, spec.width
        )
        if self._cache_np is not None:
            self._cache_np[:, block_id] = src
        else:
            self._cache[:, block_id].copy_(torch.from_numpy(src.copy()))
