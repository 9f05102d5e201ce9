"""`WorkerPool`: the workers the router may use, per role, with their health and load as last seen.

Workers come from flags and, optionally, from a pool file that is re-read when it changes, so
workers can be added and removed without a restart. The file is YAML or JSON mapping a role to a
list of URLs:

    prefill: [http://127.0.0.1:9001]
    decode: [http://127.0.0.1:9002]
    mixed: []

Workers found by DNS (router/discovery.py) are handed in with `set_discovered` and merged the same
way. Health bookkeeping lives here (ejection after consecutive failures, re-admission after consecutive
successes); the probing loop that feeds it is router/health.py. No I/O other than reading the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deepserve.disagg.client import WorkerClient
from deepserve.disagg.protocol import WorkerLoad

ROLES = ("mixed", "prefill", "decode")


class PoolFileError(ValueError):
    """The pool file is not a mapping of known roles to lists of URLs."""


@dataclass(frozen=True)
class HealthPolicy:
    eject_after: int = 3  # consecutive failures (requests or probes) before a worker is ejected
    readmit_after: int = 2  # consecutive successful probes before it is used again


@dataclass(eq=False)
class Worker:
    url: str
    role: str
    client: WorkerClient
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    inflight: int = 0  # requests this router has open on the worker
    load: WorkerLoad | None = None  # as of the last probe; set through `observe_load`
    load_probes: int = 0
    # Our requests the last probe may have counted as running that have ended since: the report
    # stays a second old, and a request that just ended still counted would send the next one
    # away from an idle worker.
    ended_since_probe: int = 0
    worker_id: str | None = None  # the name it uses in its KV events (from /internal/health)
    block_size: int | None = None
    retired_at: float | None = None  # time.monotonic() when it left the pool

    def load_score(self) -> float:
        """Queue depth (the larger of our view and the worker's) plus KV usage as the tie-breaker."""
        reported = self.load.running + self.load.waiting if self.load else 0
        kv = self.load.kv_usage if self.load else 0.0
        return max(self.inflight, reported - self.ended_since_probe) + kv

    def observe_load(self, load: WorkerLoad) -> None:
        self.load = load
        self.load_probes += 1
        self.ended_since_probe = 0

    def begin_request(self) -> int:
        """Count a request opened on the worker; returns the token `end_request` takes."""
        self.inflight += 1
        return self.load_probes

    def end_request(self, began_at_probe: int) -> None:
        self.inflight -= 1
        if began_at_probe < self.load_probes:  # a probe ran while it was open
            self.ended_since_probe += 1


@dataclass
class WorkerPool:
    make_client: Callable[[str], WorkerClient]
    health: HealthPolicy = field(default_factory=HealthPolicy)
    file: Path | None = None
    on_eject: Callable[[Worker], None] = lambda w: None
    _static: dict[str, list[str]] = field(default_factory=dict)
    _from_file: dict[str, list[str]] = field(default_factory=dict)  # last good read
    _discovered: dict[str, list[str]] = field(default_factory=dict)
    _workers: dict[str, Worker] = field(default_factory=dict)  # by URL
    _file_mtime: float | None = None
    _retired: list[Worker] = field(default_factory=list)  # removed; clients closed in close()

    @classmethod
    def from_urls(
        cls,
        urls_by_role: dict[str, Iterable[str]],
        make_client: Callable[[str], WorkerClient],
        **kw,
    ) -> WorkerPool:
        pool = cls(make_client=make_client, **kw)
        pool._static = {role: [u.rstrip("/") for u in urls] for role, urls in urls_by_role.items()}
        pool.reload()
        return pool

    def workers(self, role: str | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def available(self, role: str, exclude: Iterable[str] = ()) -> list[Worker]:
        skip = set(exclude)
        return [w for w in self.workers(role) if w.healthy and w.url not in skip]

    def has_role(self, role: str) -> bool:
        return bool(self.workers(role))

    def reload(self) -> bool:
        """Re-read the pool file if it changed; returns True when the worker set changed."""
        self._from_file = self._read_file()
        return self._apply(self._wanted())

    def set_discovered(self, urls_by_role: dict[str, list[str]]) -> bool:
        """Replace the DNS-discovered workers; returns True when the worker set changed."""
        self._discovered = {role: list(urls) for role, urls in urls_by_role.items()}
        return self._apply(self._wanted())

    async def close_idle_retired(self, grace_s: float = 60.0) -> None:
        """Close the clients of removed workers that no request uses, once `grace_s` has passed
        since the removal: a probe or an abort started just before it may still hold the client
        (each is bounded by the client's control timeout, well under the grace)."""
        now = time.monotonic()
        done = [w for w in self._retired if w.inflight == 0 and now - w.retired_at >= grace_s]
        self._retired = [w for w in self._retired if w not in done]
        for w in done:
            await w.client.close()

    async def close(self) -> None:
        for w in [*self._workers.values(), *self._retired]:
            await w.client.close()
        self._workers.clear()
        self._retired.clear()

    # ---- health bookkeeping ---------------------------------------------------------------

    def record_failure(self, w: Worker) -> None:
        w.consecutive_successes = 0
        w.consecutive_failures += 1
        if w.healthy and w.consecutive_failures >= self.health.eject_after:
            w.healthy = False
            self.on_eject(w)

    def record_success(self, w: Worker) -> None:
        w.consecutive_failures = 0
        w.consecutive_successes += 1

    def record_probe_success(self, w: Worker) -> None:
        self.record_success(w)
        if not w.healthy and w.consecutive_successes >= self.health.readmit_after:
            w.healthy = True

    # ---- internals --------------------------------------------------------------------------

    def _wanted(self) -> dict[str, list[str]]:
        wanted: dict[str, list[str]] = {}
        for source in (self._static, self._from_file, self._discovered):
            for role, urls in source.items():
                wanted.setdefault(role, []).extend(urls)
        return wanted

    def _read_file(self) -> dict[str, list[str]]:
        if self.file is None:
            return {}
        try:
            text = self.file.read_text()
            self._file_mtime = os.stat(self.file).st_mtime
        except FileNotFoundError:
            return {}
        return parse_pool_file(text)

    def file_changed(self) -> bool:
        if self.file is None:
            return False
        try:
            return os.stat(self.file).st_mtime != self._file_mtime
        except FileNotFoundError:
            return self._file_mtime is not None

    def _apply(self, wanted: dict[str, list[str]]) -> bool:
        keep = {(u.rstrip("/"), role) for role, urls in wanted.items() for u in urls}
        changed = False
        for url, w in list(self._workers.items()):
            if (url, w.role) not in keep:
                del self._workers[url]
                w.retired_at = time.monotonic()
                self._retired.append(w)
                self.on_eject(w)
                changed = True
        for url, role in sorted(keep):
            if url not in self._workers:
                self._workers[url] = Worker(url, role, self.make_client(url))
                changed = True
        return changed


def parse_pool_file(text: str) -> dict[str, list[str]]:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise PoolFileError("pool file must map roles to lists of URLs")
    out: dict[str, list[str]] = {}
    for role, urls in data.items():
        if role not in ROLES:
            raise PoolFileError(f"unknown role {role!r} in pool file (known: {', '.join(ROLES)})")
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise PoolFileError(f"role {role!r} must list URLs as strings")
        out[role] = [u.rstrip("/") for u in urls]
    return out
