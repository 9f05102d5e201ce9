"""Prometheus metrics of the prefill -> decode KV hand-off, recorded by the workers.

The prefill worker times how long its prompt blocks take to reach the shared tier before it
answers (the hand-off's write half) and counts what it sent; the decode worker counts the handed
blocks it found (loaded instead of recomputed) and the bytes it read for them. Labels: the
process's model_name and role, plus `direction` ("sent" | "received") and `outcome`.

Not here: per-tier KV traffic (kvcache/metrics.py); the flow itself (disagg/flow.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFIX = "deepserve:"  # every metric name starts with it
# From a few ms (blocks already written) to the flush timeout (seconds).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        names = list(labels)
        self._labels = labels
        self._seconds = Histogram(
            PREFIX + "pd_transfer_seconds",
            "Prefill side: time until the prompt's KV blocks were in the shared tier.",
            names,
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self._bytes = Counter(
            PREFIX + "pd_transfer_bytes",
            "KV bytes handed from prefill to decode workers.",
            [*names, "direction"],
            registry=registry,
        )
        self._blocks = Counter(
            PREFIX + "pd_transfer_blocks",
            "KV blocks handed over; received ones by outcome (hit: loaded, miss: recomputed).",
            [*names, "direction", "outcome"],
            registry=registry,
        )

    def sent(self, seconds: float, blocks: int, block_bytes: int, ok: bool) -> None:
        self._seconds.observe(seconds)
        outcome = "ok" if ok else "timeout"
        self._blocks.labels(**self._labels, direction="sent", outcome=outcome).inc(blocks)
        self._bytes.labels(**self._labels, direction="sent").inc(blocks * block_bytes if ok else 0)

    def received(self, handed: int, found: int, from_store: int, block_bytes: int) -> None:
        """`handed` blocks named by the prefill worker; `found` of them cached here in any tier
        (the rest recomputed), `from_store` read from the shared tier."""
        found = min(found, handed)
        blocks = self._blocks
        blocks.labels(**self._labels, direction="received", outcome="hit").inc(found)
        blocks.labels(**self._labels, direction="received", outcome="miss").inc(handed - found)
        self._bytes.labels(**self._labels, direction="received").inc(from_store * block_bytes)
