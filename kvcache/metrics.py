"""Prometheus metrics of the KV tiers, registered on a CollectorRegistry the owner hands in.

Label `tier` is one of "device", "host", "store". Counts are in blocks unless the name says bytes.
Nothing here decides anything; the tiers call these hooks when something happens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVCacheMetrics:
    """One set of KV tier metrics; several engines in one process each take their own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("tier",)) -> Counter:
            return Counter(f"deepserve:{name}", doc, labels, registry=registry)

        self.lookups = counter("kv_tier_lookups", "Blocks looked up in a tier")
        self.hits = counter("kv_tier_hits", "Blocks found (and valid) in a tier")
        self.misses = counter("kv_tier_misses", "Blocks looked up and not found in a tier")
        self.bytes_in = counter("kv_tier_read_bytes", "Bytes read from a tier")
        self.bytes_out = counter("kv_tier_written_bytes", "Bytes written to a tier")
        self.evictions = counter("kv_tier_evictions", "Blocks evicted from a tier")
        self.integrity_failures = counter(
            "kv_tier_integrity_failures", "Blocks that failed the codec checks (treated as misses)"
        )
        self.mac_rejections = counter(
            "kv_store_mac_rejected_blocks",
            "Blocks whose MAC did not verify under this process's KV secret (treated as misses)",
        )
        self.store_errors = counter(
            "kv_store_errors",
            "Failed store operations (timeouts, connection errors)",
            ("tier", "op"),
        )
        self.rewritten = counter(
            "kv_store_rewritten_blocks",
            "Blocks a prefill hand-off wrote to the store again because it had lost them "
            "(flushed, restarted, evicted)",
        )
        self.dropped = counter(
            "kv_tier_dropped_writes", "Blocks not written because the background queue was full"
        )
        self.latency = Histogram(
            "deepserve:kv_tier_op_seconds",
            "Latency of one bulk tier operation",
            ("tier", "op"),
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.used_bytes = Gauge(
            "deepserve:kv_tier_used_bytes", "Bytes held by a tier", ("tier",), registry=registry
        )
        self.breaker_open = Gauge(
            "deepserve:kv_store_circuit_open",
            "1 while the store's circuit breaker skips calls",
            ("tier",),
            registry=registry,
        )

    def init_tier(self, tier: str) -> None:
        """Show a configured tier's series at zero from the start, so rates and dashboards have
        data before the first hit, eviction or error (Prometheus' advice for known labels)."""
        for counter in (
            self.lookups,
            self.hits,
            self.misses,
            self.bytes_in,
            self.bytes_out,
            self.evictions,
            self.integrity_failures,
            self.dropped,
        ):
            counter.labels(tier)
        if tier == "host":
            self.used_bytes.labels(tier)  # L1 starts empty
        if tier == "store":
            self.mac_rejections.labels(tier)
            self.rewritten.labels(tier)
            self.breaker_open.labels(tier)  # reads closed until a fault opens it
            for op in ("get", "put"):  # the data-path operations of a store
                self.store_errors.labels(tier, op)

    def record_lookup(self, tier: str, looked_up: int, hits: int) -> None:
        self.lookups.labels(tier).inc(looked_up)
        self.hits.labels(tier).inc(hits)
        self.misses.labels(tier).inc(looked_up - hits)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample, e.g. value("deepserve:kv_tier_hits_total", tier="store");
        0.0 when it was never touched. For tests, benchmarks and logs."""
        return self._registry.get_sample_value(name, labels) or 0.0
