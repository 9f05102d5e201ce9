"""A KV secret that needs no configuration on one machine: with an L2 store and no secret given,
the CLI signs L2 blocks with a secret generated once in the state directory (owner-only), so a
restarted process reads the blocks of the one before it; a process with another secret gets no
hits, and counts every block its MAC rejected. On SmolLM2's real weights and a real redis-server.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from deepserve.engine.config import EngineConfig, KVTierConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams
from deepserve.server.cli import build_parser, engine_config_from_args
from deepserve.server.state_dir import StateDirError, local_kv_secret

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
) * 4
REJECTED = "deepserve:kv_store_mac_rejected_blocks_total"


def cli_tiers(redis_url: str, *flags: str) -> KVTierConfig:
    """The KV tiers `deepserve serve --kv-store URL [flags]` configures (environment as set)."""
    args = build_parser().parse_args(["serve", "--kv-store", redis_url, *flags])
    return engine_config_from_args(args).kv_tiers


def test_secret_is_generated_once_owner_only(tmp_path):
    state = tmp_path / "state" / "deepserve"
    first = local_kv_secret(state)
    assert local_kv_secret(state) == first and len(first) >= 32
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "kv-secret").stat().st_mode) == 0o600


def test_secret_readable_by_others_is_refused(tmp_path):
    local_kv_secret(tmp_path)
    os.chmod(tmp_path / "kv-secret", 0o644)
    with pytest.raises(StateDirError, match="owner-only"):
        local_kv_secret(tmp_path)


def test_cli_without_secret_uses_the_state_dir_from_xdg_or_the_flag(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPSERVE_KV_SECRET", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    url = "redis://127.0.0.1:1/0"
    from_xdg = cli_tiers(url).store_mac_key
    assert (tmp_path / "xdg" / "deepserve" / "kv-secret").exists()
    assert cli_tiers(url).store_mac_key == from_xdg
    elsewhere = cli_tiers(url, "--state-dir", str(tmp_path / "other")).store_mac_key
    assert elsewhere is not None and elsewhere != from_xdg


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig())


def run_once(loaded, tiers: KVTierConfig, ids: list[int]) -> LLMEngine:
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, kv_tiers=tiers), loaded)
    engine.add_request("r", ids, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_tiering.tiers.drain()
    return engine


_RESTARTED = """
    import json, sys, torch
    torch.set_num_threads(1)
    from deepserve.engine.config import EngineConfig
    from deepserve.engine.llm_engine import LLMEngine
    from deepserve.engine.sampling_params import SamplingParams
    from deepserve.server.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args(["serve", "--kv-store", sys.argv[1]])
    tiers = engine_config_from_args(args).kv_tiers
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, kv_tiers=tiers))
    engine.add_request("r", json.loads(sys.argv[2]), SamplingParams(max_tokens=1))
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    print(json.dumps({"prompt": last.prompt_tokens, "cached": last.cached_tokens}))
"""


@pytest.mark.redis
def test_restarted_process_without_secret_reads_the_previous_ones_blocks(
    loaded, redis_url, monkeypatch, tmp_path
):
    monkeypatch.delenv("DEEPSERVE_KV_SECRET", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    ids = loaded.tokenizer.encode(PROMPT).ids
    run_once(loaded, cli_tiers(redis_url), ids)  # the first server, then gone
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RESTARTED), redis_url, json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=240,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cached"] >= 0.8 * report["prompt"]


@pytest.mark.redis
def test_process_with_another_secret_gets_no_hits_and_counts_the_rejections(
    loaded, redis_url, monkeypatch, tmp_path
):
    monkeypatch.delenv("DEEPSERVE_KV_SECRET", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    ids = loaded.tokenizer.encode(PROMPT).ids
    run_once(loaded, cli_tiers(redis_url), ids)
    monkeypatch.setenv("DEEPSERVE_KV_SECRET", "another team's secret")
    other = run_once(loaded, cli_tiers(redis_url), ids)
    metrics = other.kv_tiering.metrics
    assert metrics.value("deepserve:kv_tier_hits_total", tier="store") == 0
    assert metrics.value(REJECTED, tier="store") >= 1
