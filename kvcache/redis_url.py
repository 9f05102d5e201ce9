"""Redis clients from a URL: one server or a Redis Cluster, chosen by the scheme.

    redis://[[user]:password@]host:port/db        one server (rediss:// for TLS)
    redis+cluster://[[user]:password@]host:port    a Redis Cluster through redis-py's RedisCluster
    rediss+cluster://...                           the same over TLS

A cluster URL names one seed node (a Service in front of the cluster will do); the client learns
the others and the slot map from it and follows failovers. Used by the KV store (sync) and by the
KV-event publisher and subscriber (asyncio). The blocking cluster client connects as it is built,
so its callers build it inside their fault handling.
"""

from __future__ import annotations

from urllib.parse import quote, unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

# The `+cluster` schemes and the plain scheme redis-py parses for their seed node.
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
REDIS_SCHEMES = ("redis", "rediss", *_CLUSTER_SCHEMES)


def is_redis_url(url: str | None) -> bool:
    return bool(url) and urlsplit(url).scheme in REDIS_SCHEMES


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def seed_url(url: str) -> str:
    """The URL with its plain scheme (what redis-py parses); the db path is dropped for a
    cluster, which has only db 0."""
    parts = urlsplit(url)
    if parts.scheme not in _CLUSTER_SCHEMES:
        return url
    return urlunsplit((_CLUSTER_SCHEMES[parts.scheme], parts.netloc, "", parts.query, ""))


def node_url(url: str, host: str, port: int) -> str:
    """A plain URL for one node of the cluster `url` names, with the same credentials and TLS."""
    parts = urlsplit(seed_url(url))
    auth = parts.netloc.rpartition("@")[0]
    netloc = (f"{auth}@" if auth else "") + f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, "", parts.query, ""))


def with_password(url: str, password: str | None) -> str:
    """`url` with `password` filled in where it names none (a Secret reaches the process through
    its environment, so it never has to be spelled out in a URL on argv)."""
    parts = urlsplit(url)
    if not password or parts.password is not None or not is_redis_url(url):
        return url
    # Quoted: redis-py unquotes the userinfo, and a password may hold '@', ':' or '/'.
    user = quote(unquote(parts.username or ""), safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def sync_client(url: str, **kwargs) -> redis.Redis | redis.RedisCluster:
    """A blocking client; for a cluster this connects to the seed (raises when it is down)."""
    if is_cluster_url(url):
        return redis.RedisCluster.from_url(seed_url(url), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def async_client(
    url: str, known_nodes: list[tuple[str, int]] = (), **kwargs
) -> aioredis.Redis | aioredis.RedisCluster:
    """An asyncio client. For a cluster, `known_nodes` (host, port) seed it besides the URL's
    node, so a reconnect after the seed itself died still finds the cluster."""
    if not is_cluster_url(url):
        return aioredis.from_url(url, **kwargs)
    nodes = [aioredis.cluster.ClusterNode(h, p) for h, p in dict.fromkeys(known_nodes)]
    return aioredis.RedisCluster.from_url(seed_url(url), startup_nodes=nodes or None, **kwargs)


def cluster_nodes(client: redis.RedisCluster | aioredis.RedisCluster) -> list[tuple[str, int]]:
    """(host, port) of every node the client knows, masters and replicas."""
    return [(n.host, n.port) for n in client.get_nodes()]
