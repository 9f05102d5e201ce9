"""`RouterStats`: plain counters of what the router decided, read by the metrics exporter.

The router counts here and never imports prometheus_client; server/component_metrics.py turns
these counters (and the pool's health) into Prometheus families at scrape time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RouterStats:
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (worker url, role)
    retries: Counter[str] = field(default_factory=Counter)  # role
    ejections: Counter[tuple[str, str]] = field(default_factory=Counter)  # (worker url, role)

    def picked(self, url: str, role: str) -> None:
        self.decisions[(url, role)] += 1

    def retried(self, role: str) -> None:
        self.retries[role] += 1

    def ejected(self, url: str, role: str) -> None:
        self.ejections[(url, role)] += 1
