"""The Redis store against a real redis-server: bulk reads, once-per-key writes with a TTL, and
faults (server down, slow, wrong password) that become misses, never exceptions."""

import shutil
import socket
import subprocess
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from deepserve.kvcache.metrics import KVCacheMetrics
from deepserve.kvcache.redis_store import RedisStore, RedisStoreConfig

pytestmark = pytest.mark.redis


def _store(url: str, **kw) -> tuple[RedisStore, KVCacheMetrics]:
    metrics = KVCacheMetrics(CollectorRegistry())
    return RedisStore(RedisStoreConfig(url=url, **kw), metrics), metrics


def _errors(metrics: KVCacheMetrics, op: str = "get") -> float:
    return metrics.value("deepserve:kv_store_errors_total", tier="store", op=op)


def test_bulk_round_trip_returns_values_in_order_with_misses(redis_url):
    store, metrics = _store(redis_url, keys_per_mget=3)
    items = [(f"k{i}", bytes([i]) * 1000) for i in range(10)]
    assert store.put_many(items) == 10
    keys = ["k0", "nope", *[f"k{i}" for i in range(1, 10)]]
    values = store.get_many(keys)
    assert values[1] is None
    assert [v for v in values if v is not None] == [v for _, v in items]
    assert metrics.value("deepserve:kv_tier_read_bytes_total", tier="store") == 10_000


def test_each_key_is_written_once_and_expires(redis_url, redis_server):
    store, metrics = _store(redis_url, ttl_s=120)
    assert store.put_many([("a", b"first")]) == 1
    assert store.put_many([("a", b"second")]) == 0
    assert store.get_many(["a"]) == [b"first"]
    assert 0 < redis_server.client().ttl("dskv:a") <= 120
    assert metrics.value("deepserve:kv_tier_written_bytes_total", tier="store") == len(b"first")


def test_password_in_the_url_is_used(make_redis_server):
    server = make_redis_server(("--requirepass", "s3cret"))
    good, _ = _store(f"redis://:s3cret@127.0.0.1:{server.port}/2")
    assert good.put_many([("k", b"v")]) == 1
    assert good.get_many(["k"]) == [b"v"]
    bad, metrics = _store(f"redis://:wrong@127.0.0.1:{server.port}/2")
    assert bad.get_many(["k"]) == [None]
    assert _errors(metrics) == 1


def test_unreachable_store_costs_almost_nothing_per_call():
    store, metrics = _store("redis://127.0.0.1:1/0", timeout_s=0.2)
    start = time.perf_counter()
    for _ in range(200):
        assert store.get_many(["a", "b"]) == [None, None]
        assert store.put_many([("a", b"v")]) == 0
    assert time.perf_counter() - start < 1.0
    assert 1 <= _errors(metrics) <= 3  # the breaker opened after the first failures


def test_server_stop_gives_misses_and_restart_reconnects_without_a_new_client(make_redis_server):
    server = make_redis_server()
    store, metrics = _store(server.url, breaker_cooldown_s=0.1, breaker_max_cooldown_s=0.2)
    store.put_many([("a", b"alpha")])
    assert store.get_many(["a"]) == [b"alpha"]
    server.stop()
    for _ in range(20):
        assert store.get_many(["a"]) == [None]
    assert _errors(metrics) >= 1
    server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 3
    while store.put_many([("b", b"beta")]) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.get_many(["b"]) == [b"beta"]
    assert metrics.value("deepserve:kv_store_circuit_open", tier="store") == 0


def test_an_idle_stores_breaker_closes_on_its_own_once_the_server_is_back(make_redis_server):
    server = make_redis_server()
    store, metrics = _store(server.url, breaker_cooldown_s=0.1, breaker_max_cooldown_s=0.2)
    server.stop()
    for _ in range(2):
        assert store.get_many(["a"]) == [None]
    assert not store.available()
    assert metrics.value("deepserve:kv_store_circuit_open", tier="store") == 1
    server.start()  # and no call from here on: only the store's own probe can close it
    deadline = time.monotonic() + 3
    while not store.available() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.available()
    assert metrics.value("deepserve:kv_store_circuit_open", tier="store") == 0
    store.close()


def test_slow_server_times_out_as_a_miss_within_the_bound(redis_url, redis_server):
    store, metrics = _store(redis_url, timeout_s=0.1)
    store.put_many([("a", b"alpha")])
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "0.8")
    )
    sleeper.start()
    time.sleep(0.1)  # let the server start sleeping
    start = time.perf_counter()
    assert store.get_many(["a"]) == [None]
    elapsed = time.perf_counter() - start
    sleeper.join()
    assert elapsed < 0.4
    assert _errors(metrics) == 1


def test_delete_removes_keys(redis_url):
    store, _ = _store(redis_url)
    store.put_many([("a", b"1"), ("b", b"2")])
    store.delete(["a"])
    assert store.exists_many(["a", "b"]) == [False, True]


def test_rediss_url_talks_tls_to_the_server(make_redis_server, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        tls_port = s.getsockname()[1]
    make_redis_server(
        ("--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
    )  # fmt: skip
    store, metrics = _store(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}")
    assert store.put_many([("k", b"secret block")]) == 1
    assert store.get_many(["k"]) == [b"secret block"]
    plain, plain_metrics = _store(f"redis://127.0.0.1:{tls_port}/0", timeout_s=0.3)
    assert plain.get_many(["k"]) == [None]  # a TLS port does not answer plain RESP
    assert _errors(plain_metrics) == 1 and _errors(metrics) == 0
