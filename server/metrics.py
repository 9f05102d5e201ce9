"""Prometheus metrics of one server, in a registry the app owns (never the process-global one).

Names carry the `deepserve:` prefix and follow vLLM's where one exists, so existing dashboards
map over. Labels are the model name and the process role, plus a bounded set of values (endpoint,
status, finish reason, constraint kind); never request contents. Engine-side gauges (running,
waiting, KV usage) are read from the backend's `load()` at scrape time; preemptions and the other
engine counters come from server/component_metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "deepserve:"  # every metric name starts with it
# LLM-shaped buckets: TTFT spans cache hits (ms) to long prefills queued behind others (minutes).
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
COMPILE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CACHE_TIERS = ("device", "host", "store")  # engine/outputs.py RequestOutput.cached_tokens_by_tier


class _EngineCollector(Collector):
    """Gauges read from the backend's EngineLoad when Prometheus scrapes."""

    def __init__(self, load: Callable[[], object], labels: dict[str, str]) -> None:
        self._load = load
        self._labels = labels

    def collect(self) -> Iterator:
        load = self._load()
        names, values = list(self._labels), list(self._labels.values())
        for name, doc, value in [
            ("num_requests_running", "Requests in the running batch.", load.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", load.waiting),
            ("kv_cache_usage_perc", "Fraction of device KV blocks in use.", load.kv_usage),
            ("kv_cache_blocks", "Device KV blocks in the pool.", load.num_blocks),
        ]:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g


class ServerMetrics:
    """Every metric the frontend exports; one instance per app."""

    def __init__(
        self,
        model_name: str,
        role: str,
        load: Callable[[], object] | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "role": role}
        self.batch_invariant = batch_invariant  # also shown by /health and /v1/models
        self._children: dict[tuple, Counter] = {}  # see _child
        names = list(self.labels)
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(
                **self.labels
            )

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, names, registry=r).labels(**self.labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency end to end.", E2E_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", E2E_BUCKETS
        )
        self.grammar_compile = hist(
            "grammar_compile_seconds", "Structured-output grammar compile time.", COMPILE_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.cached_tokens = counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache (any tier)."
        )
        self._cached_by_tier = Counter(
            PREFIX + "cached_prompt_tokens",
            "Prompt tokens served from each cache tier.",
            names + ["tier"],
            registry=r,
        )
        for tier in CACHE_TIERS:  # every tier shows, at zero until it serves a hit
            self._cached_by_tier.labels(**self.labels, tier=tier)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by reason.",
            names + ["finished_reason"],
            registry=r,
        )
        self._structured = Counter(
            PREFIX + "structured_output_requests",
            "Requests with an output constraint.",
            names + ["kind"],
            registry=r,
        )
        self._http = Counter(
            PREFIX + "http_requests",
            "HTTP requests by endpoint and status.",
            names + ["endpoint", "status"],
            registry=r,
        )
        mode = Gauge(
            PREFIX + "batch_invariant_mode", "1 when batch-invariant mode is on.", names, registry=r
        )
        mode.labels(**self.labels).set(1.0 if batch_invariant else 0.0)
        if load is not None:
            r.register(_EngineCollector(load, self.labels))

    def cached_prompt_tokens(self, by_tier: dict[str, int]) -> None:
        for tier, tokens in by_tier.items():
            if tokens:
                self._child(self._cached_by_tier, tier=tier).inc(tokens)

    def request_finished(self, reason: str) -> None:
        self._child(self._success, finished_reason=reason).inc()

    def structured_request(self, kind: str) -> None:
        self._child(self._structured, kind=kind).inc()

    def http_request(self, endpoint: str, status: int) -> None:
        self._child(self._http, endpoint=endpoint, status=str(status)).inc()

    def _child(self, metric: Counter, **extra: str) -> Counter:
        """`metric.labels(...)` with our labels plus `extra`, memoized: `labels` validates and
        looks up under a lock on every call, twice per request (the values are a bounded set)."""
        key = (metric, *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)
