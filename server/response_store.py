"""Stored Responses, so `previous_response_id` continues a conversation as OpenAI's API does.

A stored response is its conversation as Responses input items: the input it was given (with
its own predecessors already expanded) followed by its output items, which the recipe accepts
back as input. `expand` puts a predecessor's items in front of a request's input; `keep` stores a
finished response unless the request said `store: false`. Entries live in a byte-bounded LRU in
memory and, when a Redis URL is configured (`--kv-store redis://...`), in Redis too, so every
frontend of a deployment can continue any response and a restart loses none within the TTL.
Redis faults are logged and cost only the Redis copy. Not here: the Responses request path
itself (server/chat_routes.py).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis

from deepserve.server.errors import HTTPError

log = logging.getLogger(__name__)
_FAULTS = (aioredis.RedisError, OSError)


@dataclass(frozen=True)
class ResponseStoreConfig:
    max_bytes: int = 64 * 2**20  # in-memory entries, as their JSON size
    redis_url: str | None = None
    ttl_s: int = 30 * 24 * 3600  # OpenAI keeps stored responses 30 days
    timeout_s: float = 0.5
    key_prefix: str = "dsresp:"


class ResponseStore:
    def __init__(self, config: ResponseStoreConfig) -> None:
        self.config = config
        self._memory: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._redis = None
        if config.redis_url:
            self._redis = aioredis.Redis.from_url(
                config.redis_url,
                socket_timeout=config.timeout_s,
                socket_connect_timeout=config.timeout_s,
            )

    async def get(self, response_id: str) -> list[dict] | None:
        data = self._memory.get(response_id)
        if data is not None:
            self._memory.move_to_end(response_id)
        elif self._redis is not None:
            try:
                raw = await self._redis.get(self.config.key_prefix + response_id)
            except _FAULTS as e:
                log.warning("response store: reading %s failed: %s", response_id, e)
                raw = None
            data = raw.decode() if raw is not None else None
        return json.loads(data) if data is not None else None

    async def put(self, response_id: str, items: list[dict]) -> None:
        data = json.dumps(items, ensure_ascii=False)
        self._remember(response_id, data)
        if self._redis is None:
            return
        try:
            key = self.config.key_prefix + response_id
            await self._redis.set(key, data, ex=self.config.ttl_s)
        except _FAULTS as e:
            log.warning("response store: writing %s failed: %s", response_id, e)

    def _remember(self, response_id: str, data: str) -> None:
        if len(data) > self.config.max_bytes:
            return
        self._memory[response_id] = data
        self._bytes += len(data)
        while self._bytes > self.config.max_bytes:
            _, old = self._memory.popitem(last=False)
            self._bytes -= len(old)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


def input_items(body: dict) -> list[dict]:
    """A Responses body's `input` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if given is None:
        return []
    if not isinstance(given, list):
        raise HTTPError(400, "input must be a string or a list of items", param="input")
    return list(given)


async def expand(body: dict, store: ResponseStore) -> None:
    """Replace `previous_response_id` with that response's conversation in front of `input`.

    OpenAI's rule: the earlier instructions are not carried over, only the conversation."""
    previous = body.pop("previous_response_id", None)
    if previous is None:
        return
    if not isinstance(previous, str):
        raise HTTPError(400, "previous_response_id must be a string", param="previous_response_id")
    items = await store.get(previous)
    if items is None:
        raise HTTPError(
            404,
            f"Previous response with id '{previous}' not found.",
            param="previous_response_id",
        )
    body["input"] = items + input_items(body)


async def keep(store: ResponseStore, given: list[dict], response: dict) -> None:
    """Store a finished response: the input it answered, then its output items."""
    response_id = response.get("id")
    if isinstance(response_id, str):
        await store.put(response_id, given + list(response.get("output") or []))
