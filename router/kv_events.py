"""`KVEventSubscriber`: listens to the workers' KV block events on Redis pub/sub and keeps the
router's `PrefixIndex` current. Pub/sub drops messages while disconnected; that only makes the
index stale (a cache miss, never a wrong answer), so the subscriber simply reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis.asyncio as aioredis

from deepserve.disagg.protocol import KV_EVENTS_CHANNEL, EventBatch
from deepserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


class KVEventSubscriber:
    def __init__(self, redis_url: str, index: PrefixIndex, channel: str = KV_EVENTS_CHANNEL):
        self.redis_url = redis_url
        self.index = index
        self.channel = channel
        self.ready = asyncio.Event()  # set once subscribed (tests wait on it)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="router-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def handle(self, data: bytes | str) -> None:
        try:
            batch = EventBatch.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("dropping malformed KV event message: %s", e)
            return
        self.index.apply(batch.worker_id, batch.events)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._listen()
            except (OSError, aioredis.RedisError) as e:
                self.ready.clear()
                log.warning("KV event subscription lost (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _listen(self) -> None:
        client = aioredis.from_url(self.redis_url, socket_connect_timeout=2)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(self.channel)
                self.ready.set()
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        self.handle(msg["data"])
        finally:
            await client.aclose()
