"""Prometheus collectors that read a component's own counters when Prometheus scrapes.

The engine (preemptions, speculative decoding, its KV-tier registry) and the router (decisions,
retries, ejections, worker health) keep plain counters and never import prometheus_client; these
adapters publish them in the process's `ServerMetrics` registry, with the same `model_name` and
`role` labels. Reading at scrape time keeps the hot paths free of metric calls.

Not here: what the HTTP layer records per request (server/metrics.py); PD transfer metrics
(disagg/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.engine.contract import EngineStats

PREFIX = "deepserve:"  # every metric name starts with it


class EngineCollector(Collector):
    """An engine's counters (`EngineClient.stats()`, engine/contract.py), plus its KV tiers' own
    registry."""

    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        stats = self._stats()
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Requests preempted (KV blocks ran out).", labels=names
        )
        preemptions.add_metric(values, float(stats.num_preemptions))
        yield preemptions
        yield from _spec_decode(stats.spec_decode, names, values)
        yield from _async_scheduling(stats.async_scheduling, names, values)
        if stats.kv_registry is not None:
            for family in stats.kv_registry.collect():
                yield _with_labels(family, self._labels)


def _spec_decode(stats: Any, names: list[str], values: list[str]) -> Iterator[Metric]:
    """vLLM's names; zeros while speculative decoding is off (nothing was drafted)."""
    for name, doc, attr in (
        ("spec_decode_num_drafts", "Verification rounds with drafts.", "num_drafts"),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "num_draft_tokens"),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=names)
        family.add_metric(values, float(getattr(stats, attr, 0)))
        yield family
    # Acceptance by draft position (issue 7): accepted and drafted counts per position, so a
    # dashboard can plot rate(accepted) / rate(drafted) for each position.
    for name, doc, attr in (
        (
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0 = first draft).",
            "accepted_per_position",
        ),
        (
            "spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed, by draft position (0 = first draft).",
            "drafted_per_position",
        ),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=[*names, "position"])
        for pos, count in enumerate(getattr(stats, attr, [])):
            family.add_metric([*values, str(pos)], float(count))
        yield family


def _async_scheduling(stats: Any, names: list[str], values: list[str]) -> Iterator[Metric]:
    """How often decode steps ran one step ahead of their sampled ids, and why not; zeros while
    async scheduling is off (the CPU's default)."""
    for name, doc, attr in (
        (
            "async_scheduling_steps_ahead",
            "Decode steps launched before the previous step's sampled ids reached the host.",
            "ahead",
        ),
        (
            "async_scheduling_fallbacks",
            "Steps after one in flight that waited for its ids first (arrivals, grammars, "
            "penalties, forks).",
            "fallbacks",
        ),
        (
            "async_scheduling_wasted_rows",
            "Rows run ahead for a sequence that had stopped (their samples dropped).",
            "wasted_rows",
        ),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=names)
        family.add_metric(values, float(getattr(stats, attr, 0)))
        yield family


def _with_labels(family: Metric, labels: dict[str, str]) -> Metric:
    """A copy of `family` whose samples also carry `labels` (the KV tiers' registry has none of
    the process labels every other series has)."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        out.add_sample(
            sample.name,
            {**labels, **sample.labels},
            sample.value,
            sample.timestamp,
            sample.exemplar,
        )
    return out


class RouterCollector(Collector):
    """What one `Router` (router/router.py) decided, and the health of its pool's workers."""

    def __init__(self, router: Any, labels: dict[str, str]) -> None:
        self._router = router
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        workers = self._router.pool.workers()
        stats = self._router.stats
        policy = self._router.config.policy
        decisions = CounterMetricFamily(
            PREFIX + "router_requests",
            "Requests the router sent to each worker.",
            labels=[*names, "worker", "worker_role", "policy"],
        )
        known = {(w.url, w.role) for w in workers} | set(stats.decisions)
        for url, role in sorted(known):
            decisions.add_metric([*values, url, role, policy], float(stats.decisions[(url, role)]))
        yield decisions
        retries = CounterMetricFamily(
            PREFIX + "router_retries",
            "Worker failures before the first token (the request moves to another worker).",
            labels=[*names, "worker_role"],
        )
        for role in sorted({w.role for w in workers} | set(stats.retries)):
            retries.add_metric([*values, role], float(stats.retries[role]))
        yield retries
        yield from self._health(names, values, workers, stats)

    def _health(self, names, values, workers, stats) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            PREFIX + "router_worker_healthy",
            "1 while the worker is in rotation, 0 while ejected.",
            labels=[*names, "worker", "worker_role"],
        )
        ejections = CounterMetricFamily(
            PREFIX + "router_worker_ejections",
            "Times a worker was ejected after consecutive failures.",
            labels=[*names, "worker", "worker_role"],
        )
        for w in sorted(workers, key=lambda w: (w.role, w.url)):
            healthy.add_metric([*values, w.url, w.role], 1.0 if w.healthy else 0.0)
            ejections.add_metric([*values, w.url, w.role], float(stats.ejections[(w.url, w.role)]))
        yield healthy
        yield ejections
