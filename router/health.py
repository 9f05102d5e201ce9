"""`HealthChecker`: probes every worker on a fixed interval and feeds the pool's bookkeeping.

One probe is /internal/health (once, to learn the worker's id and block size, and again after a
failure) and /internal/load (every tick, which also refreshes the load the policies read). A probe
has the client's bounded control timeout. The pool file is re-read on the same tick.
"""

from __future__ import annotations

import asyncio
import logging

from deepserve.disagg.background import BackgroundTask
from deepserve.disagg.errors import WorkerUnavailableError
from deepserve.router.pool import Worker, WorkerPool

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, pool: WorkerPool, interval: float = 1.0) -> None:
        self.pool = pool
        self.interval = interval
        self._task = BackgroundTask(self._run, "router-health")

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def probe_all(self) -> None:
        if self.pool.file_changed():
            self._reload()
        await asyncio.gather(*(self.probe(w) for w in self.pool.workers()))

    async def probe(self, w: Worker) -> None:
        try:
            if w.worker_id is None or w.consecutive_failures > 0:
                health = await w.client.health()
                w.worker_id, w.block_size = health.worker_id, health.block_size
            w.observe_load(await w.client.load())
        except (WorkerUnavailableError, ValueError) as e:
            was_healthy = w.healthy
            self.pool.record_failure(w)
            if was_healthy and not w.healthy:
                log.warning("ejected worker %s: %s", w.url, e)
            return
        was_healthy = w.healthy
        self.pool.record_probe_success(w)
        if not was_healthy and w.healthy:
            log.info("re-admitted worker %s", w.url)  # routine: the ejection was the warning

    def _reload(self) -> None:
        try:
            if self.pool.reload():
                log.warning("worker pool changed: %s", [w.url for w in self.pool.workers()])
        except ValueError as e:  # a half-written or bad file: keep the current pool
            log.error("ignoring pool file: %s", e)

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)
