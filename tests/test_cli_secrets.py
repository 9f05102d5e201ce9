"""Secrets reach the processes from the environment (or files it names), never from argv, and a
server reachable beyond loopback never runs without an API key (server/cli.py)."""

from __future__ import annotations

import pytest
import redis

from deepserve.server import cli

SECRET_VARS = (
    "DEEPSERVE_API_KEY",
    "DEEPSERVE_INTERNAL_TOKEN",
    "DEEPSERVE_REDIS_PASSWORD",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)


def _worker_args(*extra: str):
    return cli.build_parser().parse_args(["worker", "--kv-store", "redis://redis:6379/0", *extra])


def test_redis_password_from_the_environment_reaches_store_and_events(monkeypatch):
    password = "p@ss:/word%"  # characters a URL must escape
    monkeypatch.setenv("DEEPSERVE_REDIS_PASSWORD", password)
    monkeypatch.setenv("DEEPSERVE_INTERNAL_TOKEN", "t")
    args = _worker_args()
    store = cli.engine_config_from_args(args).kv_tiers.store_url
    events = cli.worker_config_from_args(args).kv_events_url
    for url in (store, events):
        kwargs = redis.connection.parse_url(url)
        assert (kwargs["password"], kwargs["host"], kwargs["port"]) == (password, "redis", 6379)


def test_frontend_kv_events_url_gets_the_redis_password(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_REDIS_PASSWORD", "pw")
    monkeypatch.setenv("DEEPSERVE_INTERNAL_TOKEN", "t")
    args = cli.build_parser().parse_args(
        ["frontend", "--workers", "http://w:8100", "--kv-store", "redis://redis:6379/0"]
    )
    url = cli.frontend_config_from_args(args).router.kv_events_url
    assert redis.connection.parse_url(url)["password"] == "pw"


def test_a_url_with_its_own_password_keeps_it(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_REDIS_PASSWORD", "from-env")
    assert cli.redis_url_from_env("redis://:own@redis:6379/0") == "redis://:own@redis:6379/0"
    assert cli.redis_url_from_env("file:///tmp/kv") == "file:///tmp/kv"


def test_secrets_are_read_from_the_files_the_environment_names(monkeypatch, tmp_path):
    for name, value in (("INTERNAL_TOKEN", "tok"), ("API_KEY", "key"), ("REDIS_PASSWORD", "pw")):
        (tmp_path / name).write_text(value + "\n")
        monkeypatch.setenv(f"DEEPSERVE_{name}_FILE", str(tmp_path / name))
    args = cli.build_parser().parse_args(["frontend", "--workers", "http://w:8100"])
    config = cli.frontend_config_from_args(args)
    assert (config.router.internal_token, config.server.api_keys) == ("tok", ("key",))
    assert cli.env_secret("DEEPSERVE_REDIS_PASSWORD") == "pw"


def test_a_missing_secret_file_stops_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPSERVE_INTERNAL_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(SystemExit, match="DEEPSERVE_INTERNAL_TOKEN_FILE"):
        cli.build_parser()


def test_server_beyond_loopback_without_a_key_generates_one_and_prints_it(capsys):
    args = cli.build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    (key,) = cli.server_config_from_args(args).api_keys
    assert len(key) >= 32
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_server_on_loopback_without_a_key_stays_open(host):
    args = cli.build_parser().parse_args(["serve", "--host", host])
    assert cli.server_config_from_args(args).api_keys == ()


def test_given_key_is_used_beyond_loopback(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_API_KEY", "chosen")
    args = cli.build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert cli.server_config_from_args(args).api_keys == ("chosen",)
