"""tiny-deepseek-v4 through the engine (scheduler, block manager, runner): greedy tokens equal to
transformers' with one-shot and chunked prefill, and after a prefix-cache hit, whose blocks carry
V4's window latents, compressor inputs and compressed entries as plain KV rows; bitwise logprobs
under --batch-invariant; and the MTP layer as the `--speculative mtp` drafter, whose output must
be plain greedy decoding's, token for token."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.llm import LLM
from deepserve.engine.llm_engine import _graphs_wanted
from deepserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4
from deepserve.kernels import reference

GREEDY = SamplingParams(temperature=0, max_tokens=64)
PROMPT_LEN = 230  # past the window (64), 57 CSA and 14 HCA groups, more CSA entries than top-k


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny-deepseek-v4"), seed=0)


@pytest.fixture(scope="module")
def prompt():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 128000, (PROMPT_LEN,), generator=gen).tolist()


@pytest.fixture(scope="module")
def hf_tokens(tiny_dir, prompt):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _llm(tiny_dir, **overrides) -> LLM:
    config = dict(model=str(tiny_dir), dtype="float32", kv_cache_bytes=2**24, num_threads=1)
    return LLM(EngineConfig(**(config | overrides)))


def test_engine_greedy_matches_transformers_then_a_prefix_hit_matches_too(
    tiny_dir, prompt, hf_tokens
):
    llm = _llm(tiny_dir)
    cold = llm.generate([prompt], GREEDY)[0]
    hit = llm.generate([prompt], GREEDY)[0]
    llm.close()
    assert cold.token_ids == hf_tokens
    assert cold.cached_tokens == 0 and hit.cached_tokens >= PROMPT_LEN - 16
    assert hit.token_ids == hf_tokens


def test_engine_chunked_prefill_matches_transformers(tiny_dir, prompt, hf_tokens):
    llm = _llm(tiny_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    out = llm.generate([prompt], GREEDY)[0]
    llm.close()
    assert out.token_ids == hf_tokens


def test_engine_batches_v4_sequences_like_each_alone(tiny_dir, prompt):
    prompts = [prompt[:40], prompt[50:170], prompt[:7], prompt[60:230]]
    params = SamplingParams(temperature=0, max_tokens=16)
    llm = _llm(tiny_dir, enable_prefix_caching=False)
    together = [r.token_ids for r in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    llm.close()
    assert together == alone


def _tokens_and_logprobs(llm: LLM, prompts: list[list[int]], params) -> list[tuple]:
    out = llm.generate(prompts, params)
    return [(r.token_ids, [lp.logprob for lp in r.samples[0].logprobs]) for r in out]


def test_batch_invariant_logprobs_bitwise_equal_alone_batched_chunked_and_cached(tiny_dir, prompt):
    # past the window, more CSA entries than the indexer keeps, a group open at the chunk edges
    prompts = [prompt[:40], prompt[50:170], prompt[:7], prompt[60:230], prompt[:150]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = _llm(tiny_dir, batch_invariant=True, enable_prefix_caching=False)
    alone = [_tokens_and_logprobs(llm, [p], params)[0] for p in prompts]
    llm.close()
    runs = {"batched": _tokens_and_logprobs(_llm(tiny_dir, batch_invariant=True), prompts, params)}
    for chunk in (13, 37):
        llm = _llm(tiny_dir, batch_invariant=True, max_num_batched_tokens=chunk)
        runs[f"chunked {chunk}"] = _tokens_and_logprobs(llm, prompts[::-1], params)[::-1]
    warm = _llm(tiny_dir, batch_invariant=True)
    warm.generate(prompts[-1:], params)  # prompt[:150] is cached: prompt[:40] and [:7] hit it
    runs["after a prefix hit"] = _tokens_and_logprobs(warm, prompts, params)
    differing = [
        f"{name}: prompt {i}"
        for name, got in runs.items()
        for i, (g, a) in enumerate(zip(got, alone, strict=True))
        if g != a
    ]
    assert differing == []


def test_mtp_drafter_gives_the_plain_greedy_tokens(tiny_dir, prompt):
    # one sequence alone, a batch, the window passed while drafting, and a prefix hit
    prompts = [prompt[:7], prompt[50:120], prompt[:230]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _llm(tiny_dir)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    plain.close()
    spec = _llm(tiny_dir, speculative=SpeculativeConfig("mtp", 3))
    assert spec.engine.model.num_mtp_layers == 1
    alone = [spec.generate([p], params)[0].token_ids for p in prompts]
    batched = [r.token_ids for r in spec.generate(prompts, params)]  # all three hit the cache now
    stats = spec.engine.spec.stats
    spec.close()
    assert alone == want
    assert batched == want
    assert stats.num_draft_tokens > 0


def test_v4_decode_steps_replay_cuda_graphs_on_a_gpu_with_graph_safe_kernels():
    # its step plan is built on the device (tests/test_models_deepseek_v4_graph_safe.py)
    safe = dataclasses.replace(reference.KERNELS, graph_safe=True)
    cuda = EngineConfig(model="tiny-deepseek-v4", device="cuda")
    v4 = SimpleNamespace(k=safe, graph_safe=DeepseekV4ForCausalLM.graph_safe)
    eager_kernels = SimpleNamespace(k=reference.KERNELS, graph_safe=True)
    assert _graphs_wanted(cuda, v4) and not _graphs_wanted(cuda, eager_kernels)
