"""The Redis-backed `BlockStore` (redis-py): the default shared L2 tier.

URL forms: `redis://[[user]:password@]host:port/db`, `rediss://...` for TLS, and
`redis+cluster://` / `rediss+cluster://` for a Redis Cluster (kvcache/redis_url.py). Keys carry no
hash tag, so blocks spread over every slot and so every master. Reads are one pipelined round
trip however many blocks are asked for (MGETs on one server; GETs grouped per node on a cluster,
where a multi-key command must stay within one slot); writes are SET NX with a TTL, so a
block is written once per key and then left to Redis's own eviction (run the server with
`maxmemory-policy allkeys-lru`, see docs/kvcache.md).

Faults never reach the caller: every redis/socket error is counted and turned into a miss (or a
skipped write). Socket and connect timeouts are bounded, redis-py's own retries are off (a retry
would multiply the time a dead store costs), and a circuit breaker skips the store entirely while
it is down; while it is open a background thread sends its probe after each cool-down, so it
closes once the server is back even when no request comes. The connection pool reconnects on the
first call after the server is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from deepserve.kvcache.circuit_breaker import CircuitBreaker
from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.redis_url import is_cluster_url, sync_client
from deepserve.kvcache.store import DEFAULT_TIMEOUT_S, BlockStore


@dataclass(frozen=True)
class RedisStoreConfig:
    url: str
    ttl_s: int = 3600  # every entry expires; Redis's maxmemory policy evicts before that if full
    timeout_s: float = DEFAULT_TIMEOUT_S  # socket connect and read timeout
    key_prefix: str = "dskv:"
    keys_per_mget: int = 16  # bounds one reply's size; all MGETs still go in one round trip
    breaker_threshold: int = 2
    breaker_cooldown_s: float = 0.5
    breaker_max_cooldown_s: float = 5.0


# RedisClusterException is not a RedisError: it is what a cluster client raises when it cannot
# reach any node or a slot has no master (mid-failover).
_FAULTS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class RedisStore(BlockStore):
    def __init__(
        self,
        config: RedisStoreConfig,
        metrics: KVCacheMetrics | None = None,
        tier: str = "store",
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._tier = tier
        self._breaker = breaker or CircuitBreaker(
            config.breaker_threshold, config.breaker_cooldown_s, config.breaker_max_cooldown_s
        )
        self._cluster = is_cluster_url(config.url)
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._prober: threading.Thread | None = None
        self._prober_lock = threading.Lock()
        self._closed = threading.Event()

    def _connect(self) -> redis.Redis | redis.RedisCluster:
        """The client, built on first use: a cluster client connects as it is built."""
        if self._client is None:
            cfg = self._config
            self._client = sync_client(
                cfg.url,
                socket_timeout=cfg.timeout_s,
                socket_connect_timeout=cfg.timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        return self._client

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self._config.key_prefix + k for k in keys]
        step = self._config.keys_per_mget

        def run(pipe: redis.client.Pipeline) -> None:
            if self._cluster:
                for name in names:
                    pipe.get(name)
                return
            for i in range(0, len(names), step):
                pipe.mget(names[i : i + step])

        replies = self._pipeline("get", run)
        if replies is None:
            return [None] * len(keys)
        values = replies if self._cluster else [v for chunk in replies for v in chunk]
        self._count_bytes("in", sum(len(v) for v in values if v is not None))
        return values

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        names = [self._config.key_prefix + k for k in keys]

        def run(pipe: redis.client.Pipeline) -> None:
            for name in names:
                pipe.exists(name)

        replies = self._pipeline("exists", run)
        return [bool(r) for r in replies] if replies is not None else [False] * len(keys)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Ask which keys exist first (cheap), then send only the absent values, SET NX + TTL."""
        if not items:
            return 0
        present = self.exists_many([k for k, _ in items])
        todo = [(k, v) for (k, v), p in zip(items, present, strict=True) if not p]
        if not todo or self._breaker.is_open:
            return 0
        cfg = self._config

        def run(pipe: redis.client.Pipeline) -> None:
            for key, value in todo:
                pipe.set(cfg.key_prefix + key, value, nx=True, ex=cfg.ttl_s)

        replies = self._pipeline("put", run)
        if replies is None:
            return 0
        written = [v for (_, v), ok in zip(todo, replies, strict=True) if ok]
        self._count_bytes("out", sum(len(v) for v in written))
        return len(written)

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            names = [self._config.key_prefix + k for k in keys]
            # One DEL per key: on a cluster a DEL of several keys must stay within one slot.
            self._pipeline("delete", lambda pipe: [pipe.delete(name) for name in names])

    def available(self) -> bool:
        return not self._breaker.is_open

    def close(self) -> None:
        self._closed.set()
        if self._client is not None:
            self._client.close()

    def _pipeline(self, op: str, build: Callable[[redis.client.Pipeline], object]) -> list | None:
        """Run one pipelined round trip; None (counted as an error) on any store fault."""
        if not self._breaker.allow():
            return None
        start = time.perf_counter()
        try:
            pipe = self._connect().pipeline(transaction=False)
            build(pipe)
            replies = pipe.execute()
        except _FAULTS:
            self._breaker.record_failure()
            self._observe_fault(op)
            return None
        self._breaker.record_success()
        if self._metrics is not None:
            self._metrics.latency.labels(self._tier, op).observe(time.perf_counter() - start)
            self._metrics.breaker_open.labels(self._tier).set(0)
        return replies

    def _observe_fault(self, op: str) -> None:
        if self._metrics is not None:
            self._metrics.store_errors.labels(self._tier, op).inc()
            self._metrics.breaker_open.labels(self._tier).set(int(self._breaker.is_open))
        if self._breaker.is_open:
            self._start_prober()

    def _start_prober(self) -> None:
        with self._prober_lock:
            if self._prober is None:
                self._prober = threading.Thread(
                    target=self._probe_until_closed, name="kv-store-probe", daemon=True
                )
                self._prober.start()

    def _probe_until_closed(self) -> None:
        """While the breaker is open, send its probe as soon as each cool-down ends. Without this
        only a request would probe, so a worker that gets none (a decode worker the router no
        longer picks) would skip the store, and report it down, long after it is back."""
        probe_key = self._config.key_prefix + "probe"  # a key, so a cluster routes it
        while not self._closed.wait(self._config.breaker_cooldown_s / 4):
            with self._prober_lock:  # a fault after this check starts the next prober
                if not self._breaker.is_open:
                    self._prober = None
                    return
            self._pipeline("probe", lambda pipe: pipe.exists(probe_key))

    def _count_bytes(self, direction: str, n: int) -> None:
        if self._metrics is not None and n:
            counter = self._metrics.bytes_in if direction == "in" else self._metrics.bytes_out
            counter.labels(self._tier).inc(n)
