"""The KV tiers inside the engine, on SmolLM2's real weights and a real redis-server: multi-turn
reuse, L0 eviction to L1 and back, a second process served from L2, damaged L2 blocks, and Redis
dying under load. Outputs are always compared with a cold engine that has no cache at all.

Batch-invariant kernels are used when kernels/reference/invariant.py exists; until then the runs
are greedy with the reference kernels (which the cold-vs-cached comparison still holds for here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import textwrap
import time

import pytest

from deepserve.engine.block_manager import prompt_block_keys
from deepserve.engine.config import EngineConfig, KVTierConfig
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.sampling_params import SamplingParams
from deepserve.kvcache.codec import derive_mac_key, encode_block

pytestmark = [pytest.mark.redis, pytest.mark.slow]

BATCH_INVARIANT = importlib.util.find_spec("deepserve.kernels.reference.invariant") is not None
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16
SHARED_MAC = derive_mac_key(b"test kv secret")  # what --kv-secret-file gives every worker
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook that his grandfather "
    "had started long before the harbour was rebuilt. "
)


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.loading.loader import load_model

    return load_model(EngineConfig(batch_invariant=BATCH_INVARIANT))


@pytest.fixture(scope="module")
def tok(loaded):
    return lambda text: loaded.tokenizer.encode(text).ids


def make_engine(loaded, tiers: KVTierConfig | None = None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    config = EngineConfig(batch_invariant=BATCH_INVARIANT, kv_tiers=tiers, **kw)
    return LLMEngine(config, loaded)


def run(engine: LLMEngine, rid: str, ids: list[int], params=GREEDY):
    """Run one request to the end; (generated token ids, final RequestOutput)."""
    engine.add_request(rid, ids, params)
    return finish(engine)[rid]


def finish(engine: LLMEngine, after_step=None) -> dict:
    tokens: dict[str, list[int]] = {}
    last: dict = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            last[out.request_id] = out
        steps += 1
        if after_step is not None:
            after_step(steps)
    return {rid: (tokens[rid], last[rid]) for rid in last}


def cold(loaded, ids: list[int]) -> list[int]:
    engine = make_engine(loaded, enable_prefix_caching=False)
    return run(engine, "cold", ids)[0]


def hits(engine: LLMEngine, tier: str) -> float:
    return engine.kv_tiering.metrics.value("deepserve:kv_tier_hits_total", tier=tier)


def test_multi_turn_reuses_previous_turns_with_cold_identical_outputs(loaded, tok, redis_url):
    engine = make_engine(loaded, KVTierConfig(host_bytes=64 << 20, store_url=redis_url))
    turns = [PARAGRAPH * 2, "Why did he count the steps?", "What did he write?", "Summarise."]
    prompt: list[int] = []
    prev_prompt = 0
    for i, text in enumerate(turns):
        prompt += tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        answer, out = run(engine, f"turn{i}", prompt)
        if i:
            assert out.cached_tokens >= 0.9 * prev_prompt, (i, out.cached_tokens, prev_prompt)
        assert out.cached_tokens == sum(out.cached_tokens_by_tier.values())
        assert answer == cold(loaded, prompt), f"turn {i} differs from a cold run"
        prev_prompt = len(prompt)
        prompt += answer + tok("<|im_end|>\n")


def test_blocks_evicted_from_a_tiny_device_pool_come_back_from_host_ram(loaded, tok):
    # 20 blocks = 320 tokens: the second prompt evicts most of the first one's blocks.
    engine = make_engine(loaded, KVTierConfig(host_bytes=64 << 20), num_kv_blocks=20)
    first = tok(PARAGRAPH * 8)[:200]
    expected = run(engine, "a", first)[0]
    run(engine, "b", tok("Completely different text about gardens and bees. " * 40)[:250])
    assert engine.kv_tiering.tiers.drain()
    assert engine.block_manager.stats.evictions >= 6
    again, out = run(engine, "a2", first)
    assert out.cached_tokens_by_tier.get("host", 0) >= 6 * BLOCK
    assert out.cached_tokens == 12 * BLOCK  # device head + host tail: the whole cached prompt
    assert again == expected
    assert hits(engine, "host") >= 6


def test_second_engine_process_sharing_only_redis_gets_the_prefix_from_l2(loaded, tok, redis_url):
    ids = tok(PARAGRAPH * 3)[:180]
    tiers = KVTierConfig(store_url=redis_url, store_mac_key=SHARED_MAC)
    writer = make_engine(loaded, tiers)
    expected = run(writer, "w", ids)[0]
    assert writer.kv_tiering.tiers.drain()
    script = textwrap.dedent(f"""
        import json, torch
        torch.set_num_threads(1)
        from deepserve.engine.config import EngineConfig, KVTierConfig
        from deepserve.engine.llm_engine import LLMEngine
        from deepserve.engine.sampling_params import SamplingParams
        config = EngineConfig(batch_invariant={BATCH_INVARIANT}, num_kv_blocks=64,
                              kv_tiers=KVTierConfig(store_url={redis_url!r},
                                                    store_mac_key={SHARED_MAC!r}))
        engine = LLMEngine(config)
        engine.add_request("r", {ids!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens, last = [], None
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.outputs[0].token_ids
                last = out
        print(json.dumps({{"tokens": tokens, "by_tier": last.cached_tokens_by_tier,
                          "cached": last.cached_tokens}}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    full_blocks = (len(ids) - 1) // BLOCK
    assert report["by_tier"].get("store") == full_blocks * BLOCK
    assert report["cached"] == full_blocks * BLOCK
    assert report["tokens"] == expected


@pytest.mark.parametrize("damage", ["flip", "truncate", "fingerprint"])
def test_damaged_block_in_redis_is_a_counted_miss_and_output_is_unchanged(
    loaded, tok, redis_url, redis_server, damage
):
    from deepserve.kvcache.codec import decode_block

    ids = tok(PARAGRAPH * 2)[:100]  # 6 full blocks
    writer = make_engine(loaded, KVTierConfig(store_url=redis_url, store_mac_key=SHARED_MAC))
    expected = run(writer, "w", ids)[0]
    assert writer.kv_tiering.tiers.drain()
    first = writer.block_manager.blocks[0]  # the first block handed out: the prompt's first
    assert first.token_ids == tuple(ids[:BLOCK])
    key, spec, mac = first.key.hex(), writer.kv_tiering.tiers.spec, SHARED_MAC
    name = f"dskv:{key}"
    raw = redis_server.client()
    blob = bytearray(raw.get(name))
    if damage == "flip":
        blob[len(blob) // 3] ^= 0x10
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        payload = decode_block(spec, key, bytes(blob), mac)
        other = dataclasses.replace(spec, fingerprint="x" * len(spec.fingerprint))
        blob = bytearray(encode_block(other, key, payload, mac))
    raw.set(name, bytes(blob))

    reader = make_engine(loaded, KVTierConfig(store_url=redis_url, store_mac_key=SHARED_MAC))
    tokens, out = run(reader, "r", ids)
    assert tokens == expected
    assert out.cached_tokens_by_tier.get("store", 0) == 0  # the chain breaks at its first block
    failures = reader.kv_tiering.metrics.value(
        "deepserve:kv_tier_integrity_failures_total", tier="store"
    )
    assert failures == 1
    assert reader.kv_tiering.tiers.drain()
    decode_block(spec, key, raw.get(name), mac)  # deleted, then written again, intact


CAKE = "Preheat the oven, whisk the eggs with sugar and bake the cake. "


def forge(writer: LLMEngine, raw, victim: list[int], other: list[int], macs) -> None:
    """Rewrite `victim`'s blocks in Redis with the KV of `other`'s, as someone who can write to
    Redis does (the format and fingerprint are readable from any stored block); block i is
    framed under `macs(i)` (None: checksummed)."""
    spec, fingerprint = writer.kv_tiering.tiers.spec, writer.model_info.fingerprint
    keys = prompt_block_keys(fingerprint, victim, BLOCK)
    others = prompt_block_keys(fingerprint, other, BLOCK)
    for i, (key, other_key) in enumerate(zip(keys, others, strict=True)):
        payload = raw.get(f"dskv:{other_key}")[-(spec.payload_nbytes + 32) : -32]  # sliced out
        raw.set(f"dskv:{key}", encode_block(spec, key, payload, macs(i)))


def write_both(loaded, tiers: KVTierConfig, victim: list[int], other: list[int]):
    writer = make_engine(loaded, tiers)
    expected = run(writer, "victim", victim)[0]
    run(writer, "other", other)
    assert writer.kv_tiering.tiers.drain()
    return writer, expected


def test_forged_blocks_in_redis_are_misses_and_the_answer_stays_right(
    loaded, tok, redis_url, redis_server
):
    victim, other = tok(PARAGRAPH * 3)[:100], tok(CAKE * 8)[:100]  # 6 full blocks each
    shared = KVTierConfig(store_url=redis_url, store_mac_key=SHARED_MAC)
    writer, expected = write_both(loaded, shared, victim, other)
    guess = derive_mac_key(b"a guessed secret")
    forge(writer, redis_server.client(), victim, other, lambda i: guess if i % 2 else None)
    reader = make_engine(loaded, shared)
    tokens, out = run(reader, "reader", victim)
    assert tokens == expected
    assert out.cached_tokens_by_tier.get("store", 0) == 0
    failures = reader.kv_tiering.metrics.value(
        "deepserve:kv_tier_integrity_failures_total", tier="store"
    )
    assert failures == 1  # the chain breaks at its first block


def test_forged_blocks_would_rewrite_the_answer_for_a_reader_keyed_like_the_forger(
    loaded, tok, redis_url, redis_server
):
    """The control for the test above: the same forgery, accepted, changes the answer."""
    victim, other = tok(PARAGRAPH * 3)[:100], tok(CAKE * 8)[:100]
    guess = derive_mac_key(b"a guessed secret")
    keyed = KVTierConfig(store_url=redis_url, store_mac_key=guess)
    writer, expected = write_both(loaded, keyed, victim, other)
    forge(writer, redis_server.client(), victim, other, lambda i: guess)
    tokens, out = run(make_engine(loaded, keyed), "reader", victim)
    assert out.cached_tokens_by_tier.get("store", 0) == 6 * BLOCK
    assert tokens != expected


def test_redis_dying_under_concurrent_requests_fails_none_and_hits_resume_after_restart(
    loaded, tok, make_redis_server
):
    server = make_redis_server()
    tiers = KVTierConfig(store_url=server.url, store_timeout_s=0.2)
    prompts = {f"q{i}": tok(f"Question {i}: " + PARAGRAPH)[: 60 + 8 * i] for i in range(4)}
    expected = {rid: cold(loaded, ids) for rid, ids in prompts.items()}
    engine = make_engine(loaded, tiers, max_num_seqs=2)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    results = finish(engine, after_step=lambda step: step == 3 and server.stop())
    assert {rid: toks for rid, (toks, _) in results.items()} == expected
    assert all(out.finished for _, out in results.values())
    errors = sum(
        engine.kv_tiering.metrics.value("deepserve:kv_store_errors_total", tier="store", op=op)
        for op in ("get", "put", "exists")
    )
    assert errors >= 1

    server.start()  # empty: no persistence; the same engine objects keep running
    reader = make_engine(loaded, tiers)
    deadline = time.monotonic() + 20
    i = 0
    while time.monotonic() < deadline:
        ids = tok(f"After the restart, round {i}: " + PARAGRAPH)[:40]
        run(engine, f"after{i}", ids)
        engine.kv_tiering.tiers.drain()
        _, out = run(reader, f"read{i}", ids)
        if out.cached_tokens_by_tier.get("store", 0) > 0:
            break
        i += 1
        time.sleep(0.3)
    assert out.cached_tokens_by_tier.get("store", 0) == (len(ids) - 1) // BLOCK * BLOCK
