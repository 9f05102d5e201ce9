"""`deepserve serve` and `deepserve bench serve` flags become the right config objects."""

from __future__ import annotations

import pytest

from deepserve.engine.config import KVTierConfig
from deepserve.server.cli import (
    bench_config_from_args,
    build_parser,
    engine_config_from_args,
    server_config_from_args,
)


def test_serve_without_arguments_is_smollm2_on_loopback_8000(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    server, engine = server_config_from_args(args), engine_config_from_args(args)
    assert (server.host, server.port, server.api_keys) == ("127.0.0.1", 8000, ())
    assert engine.model == server.served_model_name == "smollm2-135m"


def test_serve_flags_reach_server_and_engine_config():
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "tiny-deepseek",
            "--served-model-name",
            "ds",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--batch-invariant",
        ]
    )
    server, engine = server_config_from_args(args), engine_config_from_args(args)
    assert (server.served_model_name, server.port, server.api_keys) == ("ds", 9001, ("k",))
    assert (engine.model, engine.max_model_len, engine.max_num_seqs) == ("tiny-deepseek", 2048, 8)
    assert engine.batch_invariant


def _server(*argv: str):
    return server_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_api_key_repeats_and_several_keys_salt_the_cache_by_key_by_default():
    server = _server("--api-key", "a", "--api-key", "b")
    assert server.api_keys == ("a", "b") and server.salts_by_api_key


def test_one_key_shares_its_cache_unless_salting_is_forced_on():
    assert not _server("--api-key", "team").salts_by_api_key
    assert _server("--api-key", "team", "--cache-salt-by-api-key").salts_by_api_key


def test_salting_by_key_can_be_turned_off_for_keys_of_one_team():
    server = _server("--api-key", "a", "--api-key", "b", "--no-cache-salt-by-api-key")
    assert not server.salts_by_api_key


def test_api_keys_from_the_environment_are_comma_separated(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_API_KEY", "a,b")
    server = server_config_from_args(build_parser().parse_args(["serve"]))
    assert server.api_keys == ("a", "b")


def test_bench_serve_flags():
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            "http://h:1",
            "--endpoint",
            "chat",
            "--concurrency",
            "4",
            "--num-prompts",
            "10",
            "--output-len",
            "32",
        ]
    )
    cfg = bench_config_from_args(args)
    assert (cfg.base_url, cfg.endpoint, cfg.concurrency, cfg.num_prompts, cfg.output_len) == (
        "http://h:1",
        "chat",
        4,
        10,
        32,
    )


def test_bench_serve_mixed_lengths_draw_prompt_words_from_the_range():
    from deepserve.server.bench import make_prompts

    args = build_parser().parse_args(
        ["bench", "serve", "--min-input-len", "30", "--input-len", "900"]
    )
    cfg = bench_config_from_args(args)
    prompts = make_prompts(50, cfg.input_len, 0, cfg.min_input_len)
    words = [len(p.split()) - 2 for p in prompts]  # less the "Request i:" head
    assert min(words) >= 30 and max(words) <= 900
    assert max(words) - min(words) > 400


def test_bench_serve_prompts_file_sends_the_repository_rewrite_prompts():
    from pathlib import Path

    from deepserve.server.bench import bench_prompts

    path = Path(__file__).parents[1] / "benchmarks" / "prompts" / "rewrite.jsonl"
    args = build_parser().parse_args(["bench", "serve", "--prompts-file", str(path)])
    prompts = bench_prompts(bench_config_from_args(args))
    assert len(prompts) == 64  # --num-prompts' default, the file's 8 prompts in turn
    assert prompts[0].startswith("Rewrite this paragraph fixing the typos:")
    assert prompts[8] == prompts[0] != prompts[1]


def test_kv_tiers_without_prefix_caching_are_refused_not_dropped():
    args = build_parser().parse_args(["serve", "--no-prefix-caching", "--kv-host-bytes", "1000"])
    with pytest.raises(SystemExit, match="need prefix caching"):
        engine_config_from_args(args)


def test_every_layer_defaults_to_one_kv_store_timeout():
    from deepserve.kvcache.redis_store import RedisStoreConfig

    args = build_parser().parse_args(["worker", "--kv-store", "redis://127.0.0.1:1/0"])
    tiers = engine_config_from_args(args).kv_tiers
    assert (
        tiers.store_timeout_s == KVTierConfig().store_timeout_s == RedisStoreConfig("x").timeout_s
    )


def _store_mac(argv: list[str]) -> bytes | None:
    args = build_parser().parse_args([*argv, "--kv-store", "redis://127.0.0.1:1/0"])
    return engine_config_from_args(args).kv_tiers.store_mac_key


def test_kv_secret_comes_from_the_environment_or_a_file_never_argv(monkeypatch, tmp_path):
    from deepserve.kvcache.codec import derive_mac_key

    monkeypatch.setenv("DEEPSERVE_KV_SECRET", "from-env")
    assert _store_mac(["serve"]) == derive_mac_key(b"from-env")
    secret = tmp_path / "kv-secret"
    secret.write_text("from-file\n")
    assert _store_mac(["serve", "--kv-secret-file", str(secret)]) == derive_mac_key(b"from-file")
    args = build_parser().parse_args(["serve", "--kv-store", "redis://127.0.0.1:1/0"])
    assert repr(derive_mac_key(b"from-env")) not in repr(engine_config_from_args(args))


def test_workers_without_a_kv_secret_share_one_derived_from_the_internal_token(
    monkeypatch, tmp_path
):
    from deepserve.kvcache.codec import derive_mac_key
    from deepserve.server.state_dir import local_kv_secret

    monkeypatch.delenv("DEEPSERVE_KV_SECRET", raising=False)
    worker = _store_mac(["worker", "--internal-token", "tok"])
    assert worker == derive_mac_key(b"tok") == _store_mac(["worker", "--internal-token", "tok"])
    # Without a token either: this machine's secret (tests/test_kvcache_local_secret.py).
    local = _store_mac(["serve", "--state-dir", str(tmp_path)])
    assert local == derive_mac_key(local_kv_secret(tmp_path))
