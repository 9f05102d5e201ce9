"""`Router`: picks a worker of a role for each request and streams its events, with retries.

A worker that fails before streaming any token is charged a failure and the request is retried on
another one (up to `max_attempts`); a failure after tokens were streamed ends the request with
`WorkerUnavailableError(started=True)`, which the frontend turns into an error event. A 4xx is the
request's fault: raised as `WorkerRejectedError`, never retried, never charged to the worker. When
the caller stops early (client gone), the worker is told to abort.

It is the `WorkerPicker` the prefill/decode flow asks for workers (disagg/flow.py).

Not here: the prefill/decode sequence (disagg/flow.py); HTTP details (disagg/client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from deepserve.disagg.client import ClientTimeouts, WorkerClient
from deepserve.disagg.errors import NoWorkerError, WorkerRejectedError, WorkerUnavailableError
from deepserve.disagg.protocol import GenerateRequest, StreamEvent
from deepserve.router.discovery import (
    DiscoveryTarget,
    DnsDiscovery,
    server_resolver,
    system_resolve,
)
from deepserve.router.health import HealthChecker
from deepserve.router.kv_events import KVEventSubscriber
from deepserve.router.policies import CacheAwareConfig, make_policy
from deepserve.router.pool import ROLES, HealthPolicy, Worker, WorkerPool
from deepserve.router.prefix_index import PrefixIndex
from deepserve.router.stats import RouterStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    workers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role -> URLs
    pool_file: str | None = None
    discover: tuple[str, ...] = ()  # ROLE=http://NAME:PORT, resolved by DNS (router/discovery.py)
    discover_interval: float = 5.0
    dns_server: str | None = None  # HOST[:PORT] to ask instead of the system resolver
    policy: str = "round_robin"
    internal_token: str = ""
    kv_events_url: str | None = None  # redis://...; cache_aware learns from it
    max_attempts: int = 3
    health_interval: float = 1.0
    health: HealthPolicy = field(default_factory=HealthPolicy)
    timeouts: ClientTimeouts = field(default_factory=ClientTimeouts)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    seed: int = 0


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.index = PrefixIndex()
        self.stats = RouterStats()  # exported by server/component_metrics.py
        self.pool = WorkerPool.from_urls(
            config.workers,
            make_client=lambda url: WorkerClient(url, config.internal_token, config.timeouts),
            health=config.health,
            file=Path(config.pool_file) if config.pool_file else None,
            on_eject=self._forget_worker,
        )
        # One policy per role: a round-robin counter shared by prefill and decode picks would
        # advance twice per request and pin every request to the same decode worker.
        self.policies = {
            role: make_policy(config.policy, self.index, config.cache_aware, config.seed)
            for role in ROLES
        }
        self.health = HealthChecker(self.pool, config.health_interval)
        self.discovery = make_discovery(config, self.pool)
        self.events = (
            KVEventSubscriber(config.kv_events_url, self.index) if config.kv_events_url else None
        )
        self._background: set[asyncio.Task] = set()
        self._serving: dict[str, set[Worker]] = {}  # request id -> workers streaming it now

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discovery.refresh()
            self.discovery.start()
        await self.health.probe_all()
        self.health.start()
        if self.events is not None:
            self.events.start()

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        if self.events is not None:
            await self.events.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.timeouts.control)
        await self.pool.close()

    # ---- the flow's `WorkerPicker` (disagg/flow.py) -------------------------------------------

    @property
    def max_attempts(self) -> int:
        return self.config.max_attempts

    def has_role(self, role: str) -> bool:
        return self.pool.has_role(role)

    def retried(self, role: str) -> None:
        self.stats.retried(role)

    def pick(self, role: str, token_ids: list[int], exclude: set[str]) -> Worker:
        candidates = self.pool.available(role, exclude)
        if not candidates:
            raise NoWorkerError(f"no healthy {role} worker left to try")
        worker = self.policies[role].choose(candidates, token_ids)
        self.stats.picked(worker.url, role)
        return worker

    async def stream(
        self,
        role: str,
        req: GenerateRequest,
        route_tokens: list[int] | None = None,
        *,
        avoid: frozenset[str] = frozenset(),
    ) -> AsyncIterator[StreamEvent]:
        """Events of `req` from one worker of `role`, retrying elsewhere before the first token.
        `avoid`: workers that just failed this request (a resume), tried only when no other
        worker of the role is available."""
        tried: set[str] = set()
        last: WorkerUnavailableError | None = None
        for _ in range(self.config.max_attempts):
            try:
                worker = self._pick_avoiding(
                    role, route_tokens or req.prompt_token_ids, tried, avoid
                )
            except NoWorkerError as e:
                raise NoWorkerError(f"{e} (last failure: {last})" if last else str(e)) from last
            tried.add(worker.url)
            try:
                async with contextlib.aclosing(self._stream_one(worker, req)) as events:
                    async for ev in events:
                        yield ev
                return
            except WorkerUnavailableError as e:
                if e.started:
                    raise
                log.warning("request %s failed on %s, retrying: %s", req.request_id, worker.url, e)
                last = e
                self.stats.retried(role)
        raise NoWorkerError(f"request failed on {len(tried)} {role} workers; last: {last}")

    def _pick_avoiding(
        self, role: str, token_ids: list[int], tried: set[str], avoid: frozenset[str]
    ) -> Worker:
        # A worker that just died mid-stream is usually still marked healthy (ejection needs
        # several failures): without `avoid` the resume could go back to it and wait out a
        # connect timeout first.
        if avoid:
            try:
                return self.pick(role, token_ids, tried | avoid)
            except NoWorkerError:
                pass
        return self.pick(role, token_ids, tried)

    async def _stream_one(self, w: Worker, req: GenerateRequest) -> AsyncIterator[StreamEvent]:
        began = w.begin_request()
        self._serving.setdefault(req.request_id, set()).add(w)
        settled = False
        try:
            async with contextlib.aclosing(w.client.generate(req)) as events:
                async for ev in events:
                    if ev.finished:
                        # Settled before the hand-over: a consumer that stops at the last event
                        # (the frontend does) must not send the worker an abort for a request
                        # it already finished, an extra round trip on every request.
                        settled = True
                        self.pool.record_success(w)
                    yield ev
        except WorkerRejectedError:
            settled = True
            raise
        except WorkerUnavailableError as e:
            self.pool.record_failure(w)
            e.worker = e.worker or w.url
            raise
        finally:
            w.end_request(began)
            self._unserve(req.request_id, w)
            if not settled:  # stopped early, timed out or failed: the worker may still hold it
                self.abort_on(w, req.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request on every worker streaming it; their streams then end with "abort"."""
        for w in self._serving.get(request_id, ()):
            self.abort_on(w, request_id)

    def _unserve(self, request_id: str, w: Worker) -> None:
        holders = self._serving.get(request_id)
        if holders is not None:
            holders.discard(w)
            if not holders:
                del self._serving[request_id]

    def abort_on(self, w: Worker, request_id: str) -> None:
        """Tell `w` to drop the request, in the background (the caller may be being cancelled)."""
        task = asyncio.get_running_loop().create_task(self._abort(w, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, w: Worker, request_id: str) -> None:
        with contextlib.suppress(WorkerUnavailableError, WorkerRejectedError):
            await w.client.abort(request_id)

    def _forget_worker(self, w: Worker) -> None:
        self.stats.ejected(w.url, w.role)
        if w.worker_id is not None:
            self.index.drop_worker(w.worker_id)


def make_discovery(config: RouterConfig, pool: WorkerPool) -> DnsDiscovery | None:
    if not config.discover:
        return None
    targets = [DiscoveryTarget.parse(spec) for spec in config.discover]
    resolve = server_resolver(config.dns_server) if config.dns_server else system_resolve
    return DnsDiscovery(pool, targets, resolve, config.discover_interval)
