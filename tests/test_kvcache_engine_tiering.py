"""engine/kv_tiering.py without a model: bytes move bit-exactly between a KV cache tensor and the
tiers, staged prefixes are loaded exactly once per step, and loaded tokens are attributed per tier."""

from types import SimpleNamespace

import pytest
import torch

from deepserve.engine.config import KVTierConfig
from deepserve.engine.kv_tiering import KVTiering
from deepserve.engine.models.base import KVCacheSpec

LAYERS, BLOCKS, BS, WIDTH = 3, 8, 4, 6


def make(tmp_path, dtype=torch.float32, host_bytes=1 << 20) -> tuple[KVTiering, torch.Tensor]:
    config = KVTierConfig(host_bytes=host_bytes, store_url=f"file://{tmp_path}/store")
    tiering = KVTiering.from_config(config, KVCacheSpec(LAYERS, WIDTH, dtype), BS, "fp")
    cache = torch.randn(LAYERS, BLOCKS, BS, WIDTH).to(dtype)
    tiering.bind_cache(cache)
    return tiering, cache


def seq(request_id: str, blocks: list[int]):
    return SimpleNamespace(block_table=blocks, request=SimpleNamespace(request_id=request_id))


def metric(t: KVTiering, name: str, tier: str) -> float:
    return t.metrics.value(f"deepserve:kv_tier_{name}_total", tier=tier)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_written_through_blocks_load_back_bit_exactly(tmp_path, dtype):
    t, cache = make(tmp_path, dtype, host_bytes=0)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        t.on_store(key, i)
    assert t.tiers.drain()
    original = cache[:, :3].clone()
    cache.zero_()
    assert t.lookup(keys) == 3
    t.load_pending([(k, 5 + i) for i, k in enumerate(keys)], [seq("r", [5, 6, 7])])
    assert torch.equal(cache[:, 5:8].view(torch.uint8), original.view(torch.uint8))


def test_evicted_blocks_go_to_host_and_are_reported_as_host_hits(tmp_path):
    t, cache = make(tmp_path)
    key = b"k" * 16
    t.on_evict(key, 2)
    assert t.tiers.drain()
    expected = cache[:, 2].clone()
    assert t.lookup([key]) == 1
    t.load_pending([(key, 4)], [seq("r", [4, 1])])
    assert torch.equal(cache[:, 4], expected)
    assert t.cached_tokens_by_tier("r", finished=True) == {"host": BS}
    assert t.cached_tokens_by_tier("r", finished=True) == {}  # forgotten once finished


def test_two_requests_loading_the_same_key_in_one_step_both_get_it(tmp_path):
    t, cache = make(tmp_path)
    key = b"s" * 16
    t.on_store(key, 0)
    assert t.tiers.drain()
    assert t.lookup([key]) == 1 and t.lookup([key]) == 1
    t.load_pending([(key, 3), (key, 4)], [seq("a", [3]), seq("b", [4])])
    assert torch.equal(cache[:, 3], cache[:, 0]) and torch.equal(cache[:, 4], cache[:, 0])
    assert t.cached_tokens_by_tier("a", True) == t.cached_tokens_by_tier("b", True) == {"store": BS}


def test_a_request_that_cannot_be_admitted_does_not_refetch_its_prefix_every_step(tmp_path):
    t, _ = make(tmp_path, host_bytes=0)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, key in enumerate(keys):
        t.on_store(key, i)
    assert t.tiers.drain()
    for _ in range(3):  # looked up, then not allocated: nothing to load this step
        assert t.lookup(keys) == 4
        t.load_pending([], [])
    assert metric(t, "lookups", "store") == 4  # one fetch; later steps used the parked copy


def test_blocks_loaded_from_the_store_are_not_written_back_to_it(tmp_path):
    t, _ = make(tmp_path, host_bytes=0)
    key = b"w" * 16
    t.on_store(key, 0)
    assert t.tiers.drain()
    written = metric(t, "written_bytes", "store")
    assert t.lookup([key]) == 1
    t.load_pending([(key, 5)], [seq("r", [5])])
    t.on_store(key, 5)  # the engine registers the loaded block after the forward
    assert t.tiers.drain()
    assert metric(t, "written_bytes", "store") == written


def test_a_cache_of_another_shape_is_refused(tmp_path):
    t, _ = make(tmp_path)
    with pytest.raises(ValueError):
        t.bind_cache(torch.zeros(LAYERS, BLOCKS, BS + 1, WIDTH))
