"""The scrape-time collectors and PD hand-off metrics, on real components without a cluster:
what a router decided shows as labelled series; hand-off counts add up."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from deepserve.disagg.metrics import TransferMetrics
from deepserve.router.router import Router, RouterConfig
from deepserve.server.component_metrics import RouterCollector

LABELS = {"model_name": "m", "role": "frontend"}
DECODE = ("http://127.0.0.1:9", "http://127.0.0.1:10")


def _router(policy: str = "round_robin") -> Router:
    return Router(RouterConfig(workers={"decode": DECODE}, policy=policy, internal_token="t"))


def _registry(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RouterCollector(router, LABELS))
    return registry


def test_router_decisions_are_counted_per_worker_with_the_policy():
    router = _router()
    for _ in range(3):
        router.pick("decode", [1, 2, 3], exclude=set())
    registry = _registry(router)
    counts = [
        registry.get_sample_value(
            "deepserve:router_requests_total",
            {**LABELS, "worker": url, "worker_role": "decode", "policy": "round_robin"},
        )
        for url in DECODE
    ]
    assert sorted(counts) == [1.0, 2.0]


def test_every_pool_worker_shows_before_any_decision():
    registry = _registry(_router())
    for url in DECODE:
        labels = {**LABELS, "worker": url, "worker_role": "decode"}
        assert registry.get_sample_value("deepserve:router_worker_healthy", labels) == 1.0
        assert registry.get_sample_value("deepserve:router_worker_ejections_total", labels) == 0
    retries = {**LABELS, "worker_role": "decode"}
    assert registry.get_sample_value("deepserve:router_retries_total", retries) == 0


def test_an_ejected_worker_reads_unhealthy():
    router = _router()
    worker = router.pool.workers("decode")[0]
    worker.healthy = False
    registry = _registry(router)
    labels = {**LABELS, "worker": worker.url, "worker_role": "decode"}
    assert registry.get_sample_value("deepserve:router_worker_healthy", labels) == 0.0


def test_router_exposition_parses():
    text = generate_latest(_registry(_router())).decode()
    assert "deepserve:router_requests_total{" in text


def test_hand_off_counts_blocks_bytes_and_misses():
    registry = CollectorRegistry()
    labels = {"model_name": "m", "role": "decode"}
    transfer = TransferMetrics(registry, labels)
    transfer.sent(0.02, blocks=4, block_bytes=100, ok=True)
    transfer.sent(5.0, blocks=2, block_bytes=100, ok=False)
    transfer.received(handed=4, found=3, from_store=2, block_bytes=100)

    def value(name: str, **extra: str) -> float:
        return registry.get_sample_value(f"deepserve:{name}", {**labels, **extra}) or 0.0

    assert value("pd_transfer_seconds_count") == 2
    assert value("pd_transfer_bytes_total", direction="sent") == 400
    assert value("pd_transfer_blocks_total", direction="sent", outcome="timeout") == 2
    assert value("pd_transfer_blocks_total", direction="received", outcome="hit") == 3
    assert value("pd_transfer_blocks_total", direction="received", outcome="miss") == 1
    assert value("pd_transfer_bytes_total", direction="received") == 200


def test_engine_collector_labels_kv_tier_series_like_every_other():
    from deepserve.engine.contract import EngineStats
    from deepserve.kvcache.metrics import KVCacheMetrics
    from deepserve.server.component_metrics import EngineCollector

    kv_registry = CollectorRegistry()
    kv = KVCacheMetrics(kv_registry)
    kv.init_tier("store")
    kv.record_lookup("store", looked_up=4, hits=3)
    stats = EngineStats(num_preemptions=2, spec_decode=None, kv_registry=kv_registry)
    labels = {"model_name": "m", "role": "decode"}
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: stats, labels))

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(f"deepserve:{name}", {**labels, **extra})

    assert value("kv_tier_hits_total", tier="store") == 3
    assert value("kv_tier_misses_total", tier="store") == 1
    assert value("kv_store_errors_total", tier="store", op="get") == 0
    assert value("num_preemptions_total") == 2
    assert value("spec_decode_num_draft_tokens_total") == 0


def test_engine_collector_counts_async_scheduling_steps():
    from deepserve.engine.async_scheduling import OverlapStats
    from deepserve.engine.contract import EngineStats
    from deepserve.server.component_metrics import EngineCollector

    overlap = OverlapStats(ahead=130, fallbacks=2, wasted_rows=5)
    stats = EngineStats(2, None, None, async_scheduling=overlap)
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: stats, {"model_name": "m"}))

    def value(name: str) -> float | None:
        return registry.get_sample_value(
            f"deepserve:async_scheduling_{name}_total", {"model_name": "m"}
        )

    assert (value("steps_ahead"), value("fallbacks"), value("wasted_rows")) == (130, 2, 5)
