"""Redis URLs: the `+cluster` schemes pick RedisCluster, and a password from the environment is
filled into a URL that names none (so it never has to be on argv)."""

from __future__ import annotations

import redis

from deepserve.kvcache.redis_url import (
    is_cluster_url,
    is_redis_url,
    node_url,
    seed_url,
    sync_client,
    with_password,
)


def test_cluster_schemes_are_redis_urls_and_plain_ones_are_not_clusters():
    assert is_cluster_url("redis+cluster://h:7000") and is_cluster_url("rediss+cluster://h:7000")
    assert not is_cluster_url("redis://h:6379/0")
    assert all(is_redis_url(u) for u in ("redis://h", "rediss://h", "redis+cluster://h:1"))
    assert not is_redis_url("file:///tmp/kv") and not is_redis_url(None)


def test_seed_url_is_the_plain_scheme_without_a_db():
    assert seed_url("rediss+cluster://:pw@h:7000/0") == "rediss://:pw@h:7000"
    assert seed_url("redis://h:6379/2") == "redis://h:6379/2"


def test_node_url_keeps_the_credentials_for_another_node():
    assert (
        node_url("redis+cluster://u:pw@seed:7000", "10.0.0.5", 7001) == "redis://u:pw@10.0.0.5:7001"
    )


def test_password_is_filled_in_only_where_the_url_names_none():
    assert with_password("redis://redis:6379/0", "s3cret") == "redis://:s3cret@redis:6379/0"
    assert with_password("redis+cluster://u@r:7000", "s3cret") == "redis+cluster://u:s3cret@r:7000"
    assert with_password("redis://:given@redis:6379/0", "s3cret") == "redis://:given@redis:6379/0"
    assert with_password("redis://redis:6379/0", None) == "redis://redis:6379/0"
    assert with_password("file:///kv", "s3cret") == "file:///kv"


def test_a_password_with_url_characters_reaches_redis_intact():
    url = with_password("redis://redis:6379/0", "p@ss:w/rd")
    assert url == "redis://:p%40ss%3Aw%2Frd@redis:6379/0"
    client = sync_client(url)
    assert client.connection_pool.connection_kwargs["password"] == "p@ss:w/rd"
    client.close()


def test_a_plain_url_gives_a_single_node_client():
    client = sync_client("redis://127.0.0.1:1/0")
    assert isinstance(client, redis.Redis)
    client.close()


def test_the_cli_takes_the_redis_password_from_the_environment(monkeypatch):
    from deepserve.server.cli import (
        build_parser,
        kv_tier_config_from_args,
        worker_config_from_args,
    )

    monkeypatch.setenv("DEEPSERVE_REDIS_PASSWORD", "s3cret")
    argv = ["worker", "--internal-token", "t", "--kv-store", "redis+cluster://redis:6379"]
    args = build_parser().parse_args(argv)
    assert worker_config_from_args(args).kv_events_url == "redis+cluster://:s3cret@redis:6379"
    assert kv_tier_config_from_args(args).store_url == "redis+cluster://:s3cret@redis:6379"
