"""L1 host cache: LRU under a hard byte limit."""

import threading

from prometheus_client import CollectorRegistry

from deepserve.kvcache.host_cache import HostCache
from deepserve.kvcache.metrics import KVCacheMetrics


def test_byte_limit_is_never_exceeded_under_concurrent_writers():
    cache = HostCache(max_bytes=10_000)
    peak = [0]

    def writer(seed: int) -> None:
        for i in range(300):
            cache.put(f"{seed}-{i}", b"x" * (100 + (i * 37 + seed) % 900))
            peak[0] = max(peak[0], cache.used_bytes)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < peak[0] <= 10_000
    assert cache.used_bytes == sum(len(v) for v in cache._entries.values())


def test_least_recently_used_entry_is_evicted_first():
    metrics = KVCacheMetrics(CollectorRegistry())
    cache = HostCache(max_bytes=300, metrics=metrics)
    for key in "abc":
        cache.put(key, b"." * 100)
    cache.get_many(["a"])  # a is now the most recent; b the least
    cache.put("d", b"." * 100)
    assert "b" not in cache and all(k in cache for k in "acd")
    assert metrics.value("deepserve:kv_tier_evictions_total", tier="host") == 1


def test_value_larger_than_the_cache_is_refused():
    cache = HostCache(max_bytes=100)
    cache.put("small", b"." * 50)
    assert cache.put("big", b"." * 101) is False
    assert "small" in cache and cache.used_bytes == 50


def test_prefix_length_stops_at_the_first_gap():
    cache = HostCache(max_bytes=1000)
    for key in ("k0", "k1", "k3"):
        cache.put(key, b"v")
    assert cache.prefix_length(["k0", "k1", "k2", "k3"]) == 2


def test_replacing_a_key_does_not_count_its_bytes_twice():
    cache = HostCache(max_bytes=1000)
    cache.put("k", b"." * 400)
    cache.put("k", b"." * 500)
    assert cache.used_bytes == 500 and len(cache) == 1
