"""`KVEventSubscriber`: listens to the workers' KV block events on Redis pub/sub and keeps the
router's `PrefixIndex` current. Pub/sub drops messages while disconnected; that only makes the
index stale (a cache miss, never a wrong answer), so the subscriber simply reconnects with backoff.

On a Redis Cluster (`redis+cluster://`, kvcache/redis_url.py) workers publish with SPUBLISH, which
goes to the master that owns the channel's slot rather than over the whole cluster bus; the
subscriber asks the cluster which node that is and SSUBSCRIBEs there. When that master dies or the
slot moves, the subscription ends and the reconnect asks the cluster again (seeded with every node
it has seen, so the URL's node may be the one that died).
"""

from __future__ import annotations

import asyncio
import json
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException

from deepserve.disagg.background import BackgroundTask
from deepserve.disagg.protocol import KV_EVENTS_CHANNEL, EventBatch
from deepserve.kvcache.redis_url import (
    async_client,
    cluster_nodes,
    is_cluster_url,
    node_url,
)
from deepserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


class KVEventSubscriber:
    def __init__(self, redis_url: str, index: PrefixIndex, channel: str = KV_EVENTS_CHANNEL):
        self.redis_url = redis_url
        self.index = index
        self.channel = channel
        self.ready = asyncio.Event()  # set once subscribed (tests wait on it)
        self._task = BackgroundTask(self._run, "router-kv-events")
        self._known_nodes: list[tuple[str, int]] = []  # a cluster's nodes, as last seen

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

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
            except (OSError, aioredis.RedisError, RedisClusterException) as e:
                self.ready.clear()
                log.warning("KV event subscription lost (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _listen(self) -> None:
        if is_cluster_url(self.redis_url):
            await self._listen_sharded()
            return
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

    async def _listen_sharded(self) -> None:
        node = await self._channel_owner()
        client = aioredis.from_url(
            node_url(self.redis_url, node.host, node.port), socket_connect_timeout=2
        )
        try:
            async with client.pubsub() as pubsub:
                await pubsub.ssubscribe(self.channel)
                self.ready.set()
                async for msg in pubsub.listen():
                    if msg.get("type") == "smessage":
                        self.handle(msg["data"])
                    elif msg.get("type") == "sunsubscribe":  # the slot moved: ask again
                        raise aioredis.ConnectionError("shard channel moved")
        finally:
            await client.aclose()

    async def _channel_owner(self) -> aioredis.cluster.ClusterNode:
        """The cluster node (master) serving the channel's slot, from a fresh slot map."""
        cluster = async_client(self.redis_url, self._known_nodes, socket_connect_timeout=2)
        try:
            await cluster.initialize()
            self._known_nodes = cluster_nodes(cluster)
            return cluster.get_node_from_key(self.channel)
        finally:
            await cluster.aclose()
