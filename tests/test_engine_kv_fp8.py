"""`--kv-cache-dtype fp8` end to end on the CPU, for SmolLM2 (real weights, GQA) and tiny-deepseek
(MLA): the pool holds twice bfloat16's tokens in the same bytes; greedy output stays the
model-dtype cache's; fp8 blocks never match blocks of the model's dtype and round-trip through the
host tier and Redis bit-exactly; `--batch-invariant` rows stay bitwise equal alone and in a batch;
checkpoint scales (`k_scale`) are read for fp8 and ignored for auto."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepserve.engine.block_manager import prompt_block_keys
from deepserve.engine.config import EngineConfig, KVTierConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.kv_tiering import KVTiering
from deepserve.engine.llm import LLM
from deepserve.engine.llm_engine import LLMEngine
from deepserve.engine.loading.builtin_models import resolve_model
from deepserve.engine.loading.loader import load_model
from deepserve.engine.models.base import KVCacheSpec
from deepserve.engine.sampling_params import SamplingParams
from deepserve.kvcache.codec import derive_mac_key

MODELS = ["smollm2-135m", "tiny-deepseek"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
NOISE = ["Water boils at", "SELECT name, age FROM users WHERE", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
# e4m3 keeps 3 mantissa bits: each cached K/V element is off by at most 1/16 of itself; measured
# 2.5-4% rms per layer on both models. How far that moves the output is the model's: SmolLM2's
# chosen-token logprobs moved by at most 0.18 nats on these prompts and the greedy tokens agreed
# for 2 steps (near ties flip the 3rd and 4th of two prompts); tiny-deepseek's random weights give flat
# distributions (top tokens within tenths of a nat), where the first token agreed on every prompt
# and its logprob moved by up to 0.41. The bounds leave that margin; a misread block or a scale
# applied twice changes the tokens themselves.
AGREE = {"smollm2-135m": (2, 0.3), "tiny-deepseek": (1, 0.75)}  # (tokens equal, logprob nats)
BLOCK = 16
SHARED_MAC = derive_mac_key(b"test kv secret")


def _load(model: str, kv: str = "auto", **kw):
    return load_model(EngineConfig(model=model, kv_cache_dtype=kv, **kw))


def _llm(loaded, kv: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(EngineConfig(model=loaded.info.name, kv_cache_dtype=kv, **kw), loaded)


def _run(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[tuple[list[int], list[float]]]:
    return [
        (s.token_ids, [lp.logprob for lp in s.logprobs])
        for r in llm.generate(prompts, params)
        for s in r.samples
    ]


def _encode(loaded, texts: list[str]) -> list[list[int]]:
    return [loaded.tokenizer.encode(t).ids for t in texts]


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def auto(model):
    return _load(model)


@pytest.fixture(scope="module")
def fp8(model):
    return _load(model, "fp8")


@pytest.mark.parametrize("model_name", MODELS)
def test_fp8_pool_holds_twice_the_tokens_of_bfloat16_in_the_same_bytes(model_name):
    cards = {}
    for kv in ("auto", "fp8"):
        loaded = _load(model_name, kv, dtype="bfloat16")
        config = EngineConfig(
            model=model_name, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_bytes=64 << 20
        )
        cards[kv] = LLMEngine(config, loaded).card()
    assert cards["auto"].kv_cache_dtype == "bfloat16"
    assert cards["fp8"].kv_cache_dtype == "float8_e4m3fn"
    assert cards["fp8"].kv_block_bytes * 2 == cards["auto"].kv_block_bytes
    tokens = {kv: card.limits.kv_pool_tokens for kv, card in cards.items()}
    assert tokens["fp8"] in (2 * tokens["auto"], 2 * tokens["auto"] + BLOCK)  # floor of bytes


def _close(got, want, model: str) -> None:
    steps, tol = AGREE[model]
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert g_ids[:steps] == w_ids[:steps]
        assert max(abs(a - b) for a, b in zip(g_lp[:steps], w_lp[:steps], strict=True)) < tol


def test_greedy_tokens_equal_and_logprobs_close_to_the_model_dtype_cache(model, auto, fp8):
    prompts = _encode(auto, PROMPTS + NOISE)
    want = _run(_llm(auto, "auto"), prompts)
    got = _run(_llm(fp8, "fp8"), prompts)
    _close(got, want, model)
    assert got != want  # the cache is e4m3: not the same numbers


def test_fp8_blocks_never_match_blocks_of_the_models_dtype(auto, fp8):
    ids = _encode(auto, [PROMPTS[3] * 3])[0]
    keys = {
        kv: set(prompt_block_keys(loaded.info.fingerprint, ids, BLOCK))
        for kv, loaded in (("auto", auto), ("fp8", fp8))
    }
    assert len(keys["fp8"]) == len(ids) // BLOCK > 0
    assert keys["fp8"].isdisjoint(keys["auto"])
    assert auto.info.fingerprint != fp8.info.fingerprint


def _same_output(result, expected) -> None:
    """The tokens, and logprobs to float32 rounding: a prefix hit computes only the prompt's tail,
    a step of another shape (bitwise equality is `--batch-invariant`'s, tested below)."""
    (ids, logprobs), sample = expected[0], result.samples[0]
    assert sample.token_ids == ids
    torch.testing.assert_close(
        [lp.logprob for lp in sample.logprobs], logprobs, rtol=1e-4, atol=1e-4
    )


def test_a_tier_round_trip_of_fp8_blocks_is_bit_exact():
    spec = KVCacheSpec(3, 6, torch.float8_e4m3fn)
    tiering = KVTiering.from_config(KVTierConfig(host_bytes=1 << 20), spec, 4, "fp")
    cache = (torch.randn(3, 8, 4, 6) * 100).to(torch.float8_e4m3fn)
    tiering.bind_cache(cache)
    tiering.on_evict(b"k" * 16, 2)
    assert tiering.tiers.drain()
    assert tiering.lookup([b"k" * 16]) == 1
    seq = SimpleNamespace(block_table=[5], request=SimpleNamespace(request_id="r"))
    tiering.load_pending([(b"k" * 16, 5)], [seq])
    assert torch.equal(cache[:, 5].view(torch.uint8), cache[:, 2].view(torch.uint8))


def test_evicted_fp8_blocks_come_back_from_host_ram_with_the_same_output(fp8):
    ids = _encode(fp8, [PROMPTS[3] * 6])[0][:120]  # 7 full blocks
    other = _encode(fp8, [NOISE[1] * 30])[0][:150]
    config = dict(kv_tiers=KVTierConfig(host_bytes=64 << 20), num_kv_blocks=14)
    llm = _llm(fp8, "fp8", **config)
    expected = _run(llm, [ids])
    _run(llm, [other])  # evicts the first prompt's blocks to the host tier
    assert llm.engine.kv_tiering.tiers.drain()
    again = llm.generate([ids], GREEDY)[0]
    assert again.cached_tokens == len(ids) // BLOCK * BLOCK
    assert llm.engine.kv_tiering.metrics.value("deepserve:kv_tier_hits_total", tier="host") > 0
    _same_output(again, expected)


@pytest.mark.redis
def test_fp8_blocks_round_trip_through_redis_and_an_auto_reader_never_takes_them(
    auto, fp8, redis_url
):
    ids = _encode(fp8, [PROMPTS[3] * 6])[0][:120]
    tiers = KVTierConfig(store_url=redis_url, store_mac_key=SHARED_MAC)
    writer = _llm(fp8, "fp8", kv_tiers=tiers)
    expected = _run(writer, [ids])
    assert writer.engine.kv_tiering.tiers.drain()
    auto_reader = _llm(auto, "auto", kv_tiers=tiers)
    assert auto_reader.generate([ids], GREEDY)[0].cached_tokens == 0
    fp8_reader = _llm(fp8, "fp8", kv_tiers=tiers)
    out = fp8_reader.generate([ids], GREEDY)[0]
    assert out.cached_tokens == len(ids) // BLOCK * BLOCK  # a fresh engine: all from Redis
    _same_output(out, expected)


def test_batch_invariant_rows_are_bitwise_equal_alone_and_in_a_batch(model):
    loaded = _load(model, "fp8", batch_invariant=True)
    prompts, noise = _encode(loaded, PROMPTS), _encode(loaded, NOISE)

    def llm(**kw) -> LLM:
        return _llm(loaded, "fp8", batch_invariant=True, **kw)

    alone = [_run(llm(enable_prefix_caching=False), [p])[0] for p in prompts]
    batched = _run(llm(), prompts + noise)[: len(prompts)]
    chunked = _run(llm(max_num_batched_tokens=7), noise + prompts)[len(noise) :]
    assert batched == alone
    assert chunked == alone


def test_forked_samples_copy_fp8_blocks(fp8):
    """n = 2 seeded samples fork the prompt's partial last block (a block copy in the cache)."""
    prompt = _encode(fp8, [PROMPTS[0]])
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=4, ignore_eos=True)
    two = [s.token_ids for s in _llm(fp8, "fp8").generate(prompt, params)[0].samples]
    one = SamplingParams(temperature=0.8, seed=3, n=1, max_tokens=4, ignore_eos=True)
    alone = _llm(fp8, "fp8").generate(prompt, one)[0].samples[0].token_ids
    assert len(two) == 2 and two[0] == alone


def _with_kv_scales(tmp_path, scale: float) -> str:
    """tiny-deepseek with a `k_scale` on every attention layer (MTP's included)."""
    folder = tmp_path / "scaled"
    shutil.copytree(resolve_model("tiny-deepseek"), folder)
    tensors = load_file(folder / "model.safetensors")
    layers = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scale)
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def test_checkpoint_kv_scales_are_read_for_fp8_and_ignored_for_auto(tmp_path):
    scaled = _with_kv_scales(tmp_path, 4.0)
    prompts = _encode(_load("tiny-deepseek"), PROMPTS)

    def run(path: str, kv: str):
        loaded = _load(path, kv)
        return loaded, _run(_llm(loaded, kv), prompts)

    _, plain_auto = run("tiny-deepseek", "auto")
    assert run(scaled, "auto")[1] == plain_auto  # consumed, and not applied
    loaded, scaled_fp8 = run(scaled, "fp8")
    assert {layer.attn.kv_scale for layer in loaded.model.layers} == {4.0}
    _close(scaled_fp8, plain_auto, "tiny-deepseek")


def test_the_cli_flag_reaches_the_engine_config_and_bad_names_are_refused():
    from deepserve.server.cli import build_parser, engine_config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    assert engine_config_from_args(parser.parse_args(["serve"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_deepseek_v4_refuses_an_fp8_cache_by_name():
    with pytest.raises(UnsupportedModelError, match="--kv-cache-dtype fp8 is not supported"):
        _load("tiny-deepseek-v4", "fp8")
