"""The tier facade over L1 (host RAM) and L2 (a real Redis): prefix fetches, background offload and
write-through, and damaged blocks in L2 that become counted misses."""

import os

import pytest
from prometheus_client import CollectorRegistry

from deepserve.kvcache.codec import BlockSpec, derive_mac_key, encode_block
from deepserve.kvcache.disk_store import DiskStore
from deepserve.kvcache.host_cache import HostCache
from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.redis_store import RedisStore, RedisStoreConfig
from deepserve.kvcache.tiered import TieredKVCache

SPEC = BlockSpec(fingerprint="fp-test", num_layers=2, block_size=4, width=8, dtype="float32")
KEYS = [f"{i:032x}" for i in range(8)]
PAYLOADS = {k: os.urandom(SPEC.payload_nbytes) for k in KEYS}
MAC = derive_mac_key(b"test kv secret")


def _tiers(redis_url: str | None, host_bytes: int = 1 << 20) -> TieredKVCache:
    metrics = KVCacheMetrics(CollectorRegistry())
    host = HostCache(host_bytes, metrics) if host_bytes else None
    store = RedisStore(RedisStoreConfig(url=redis_url), metrics) if redis_url else None
    return TieredKVCache(SPEC, metrics, host=host, store=store, store_mac_key=MAC)


def _hits(t: TieredKVCache, tier: str) -> float:
    return t.metrics.value("deepserve:kv_tier_hits_total", tier=tier)


def _write_store(t: TieredKVCache, keys) -> None:
    t.write_through([(k, PAYLOADS[k]) for k in keys])
    assert t.drain()


def test_prefix_comes_from_l1_then_l2_and_stops_at_the_first_gap(redis_url):
    t = _tiers(redis_url)
    t.offload([(k, PAYLOADS[k]) for k in KEYS[:2]])
    _write_store(t, KEYS[2:5] + KEYS[6:])
    got = t.fetch_prefix(KEYS)
    assert (got.host_blocks, got.store_blocks) == (2, 3)
    assert [bytes(p) for p in got.payloads] == [PAYLOADS[k] for k in KEYS[:5]]
    assert _hits(t, "host") == 2 and _hits(t, "store") == 3


def test_lookup_reports_each_tiers_prefix_without_moving_data(redis_url):
    t = _tiers(redis_url)
    t.offload([(KEYS[0], PAYLOADS[KEYS[0]])])
    _write_store(t, KEYS[1:3])
    lk = t.lookup(KEYS)
    assert (lk.host_blocks, lk.store_blocks) == (1, 2)


def test_store_hits_are_kept_in_host_ram_for_next_time(redis_url):
    t = _tiers(redis_url)
    _write_store(t, KEYS[:3])
    t.fetch_prefix(KEYS[:3])
    again = t.fetch_prefix(KEYS[:3])
    assert (again.host_blocks, again.store_blocks) == (3, 0)


@pytest.mark.parametrize("forgery", ["checksummed", "other key", "other key's block"])
def test_forged_store_block_is_a_counted_miss_and_is_deleted(redis_url, redis_server, forgery):
    t = _tiers(redis_url, host_bytes=0)
    _write_store(t, KEYS[:4])
    raw = redis_server.client()
    name = f"dskv:{KEYS[2]}"
    # Another block's payload under this key, framed as a writer without the secret can.
    if forgery == "checksummed":
        blob = encode_block(SPEC, KEYS[2], PAYLOADS[KEYS[3]])
    elif forgery == "other key":
        blob = encode_block(SPEC, KEYS[2], PAYLOADS[KEYS[3]], derive_mac_key(b"guess"))
    else:  # a genuine block, moved under another key
        blob = raw.get(f"dskv:{KEYS[3]}")
    raw.set(name, blob)
    got = t.fetch_prefix(KEYS[:4])
    assert [bytes(p) for p in got.payloads] == [PAYLOADS[k] for k in KEYS[:2]]
    assert t.metrics.value("deepserve:kv_tier_integrity_failures_total", tier="store") == 1
    assert raw.exists(name) == 0


def test_shared_store_without_a_mac_key_is_refused(redis_url):
    metrics = KVCacheMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="MAC key"):
        TieredKVCache(SPEC, metrics, store=RedisStore(RedisStoreConfig(url=redis_url), metrics))


def test_store_hit_is_kept_in_host_ram_and_read_back_from_there(redis_url):
    writer = _tiers(redis_url, host_bytes=0)
    _write_store(writer, KEYS[:3])
    reader = _tiers(redis_url)
    assert reader.fetch_prefix(KEYS[:3]).store_blocks == 3
    again = reader.fetch_prefix(KEYS[:3])
    assert again.host_blocks == 3
    assert [bytes(p) for p in again.payloads] == [PAYLOADS[k] for k in KEYS[:3]]


@pytest.mark.parametrize("damage", ["flip", "truncate", "fingerprint"])
def test_damaged_store_block_is_a_counted_miss_and_is_deleted(redis_url, redis_server, damage):
    t = _tiers(redis_url, host_bytes=0)
    _write_store(t, KEYS[:4])
    raw = redis_server.client()
    name = f"dskv:{KEYS[2]}"
    blob = bytearray(raw.get(name))
    if damage == "flip":
        blob[len(blob) // 2] ^= 1
    elif damage == "truncate":
        blob = blob[:-100]
    else:
        other = BlockSpec("fp-evil", SPEC.num_layers, SPEC.block_size, SPEC.width, SPEC.dtype)
        blob = bytearray(encode_block(other, KEYS[2], PAYLOADS[KEYS[2]], MAC))
    raw.set(name, bytes(blob))
    got = t.fetch_prefix(KEYS[:4])
    assert got.store_blocks == 2
    assert [bytes(p) for p in got.payloads] == [PAYLOADS[k] for k in KEYS[:2]]
    assert t.metrics.value("deepserve:kv_tier_integrity_failures_total", tier="store") == 1
    assert raw.exists(name) == 0


def test_write_through_sends_each_key_once(redis_url):
    t = _tiers(redis_url)
    _write_store(t, KEYS[:3])
    _write_store(t, KEYS[:3])
    written = t.metrics.value("deepserve:kv_tier_written_bytes_total", tier="store")
    assert written == 3 * SPEC.encoded_nbytes(KEYS[0], MAC)


def test_full_background_queue_drops_writes_instead_of_blocking():
    metrics = KVCacheMetrics(CollectorRegistry())
    host = HostCache(1 << 20, metrics)
    t = TieredKVCache(SPEC, metrics, host=host, max_pending_bytes=SPEC.payload_nbytes)
    accepted = sum(t.offload([(k, PAYLOADS[k])]) for k in KEYS)
    t.drain()
    assert 1 <= accepted < len(KEYS)
    dropped = metrics.value("deepserve:kv_tier_dropped_writes_total", tier="host")
    assert dropped == len(KEYS) - accepted


def test_no_store_configured_means_misses_only():
    t = _tiers(None)
    got = t.fetch_prefix(KEYS)
    assert got.payloads == [] and t.write_through([(KEYS[0], PAYLOADS[KEYS[0]])]) == 0


def test_disk_store_works_behind_the_same_facade(tmp_path):
    metrics = KVCacheMetrics(CollectorRegistry())
    store = DiskStore(tmp_path, 1 << 20, metrics)
    t = TieredKVCache(SPEC, metrics, store=store, store_mac_key=MAC)
    _write_store(t, KEYS[:3])
    got = t.fetch_prefix(KEYS)
    assert got.store_blocks == 3
    assert [bytes(p) for p in got.payloads] == [PAYLOADS[k] for k in KEYS[:3]]
