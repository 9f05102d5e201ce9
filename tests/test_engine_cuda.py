"""The engine on a CUDA device (skipped without one): batching, chunked prefill, forks and seeded
sampling give the same tokens as running alone, with the same code as on the CPU. A random
SmolLM2-shaped llama (fewer layers) keeps it quick; its weights need no files."""

from __future__ import annotations

import pytest
import torch

from deepserve.engine.config import EngineConfig
from deepserve.engine.llm import LLM
from deepserve.engine.sampling_params import SamplingParams
from deepserve.kernels.random import gumbel_noise, token_keys

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 6,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}  # fmt: skip


def _weights(c: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * 64

    def mat(o: int, n: int) -> torch.Tensor:
        return torch.randn(o, n, generator=g) / n**0.5

    # Small tied embeddings keep the logits spread (unit rows make one token win every step).
    w = {"model.embed_tokens.weight": 0.05 * torch.randn(c["vocab_size"], h, generator=g)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": mat(h, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, h),
            p + "mlp.gate_proj.weight": mat(i, h),
            p + "mlp.up_proj.weight": mat(i, h),
            p + "mlp.down_proj.weight": mat(h, i),
        }
    w["model.norm.weight"] = torch.ones(h)
    return w


@pytest.fixture(scope="module")
def loaded():
    from deepserve.engine.contract import ModelInfo
    from deepserve.engine.loading.loader import LoadedModel
    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.llama import LlamaForCausalLM
    from deepserve.kernels.reference import KERNELS

    store = WeightStore(_weights(SHAPE), torch.device("cuda"), torch.float32)
    model = LlamaForCausalLM(SHAPE, store, KERNELS, "cuda-test")
    info = ModelInfo(
        "random-llama", "llama", "LlamaForCausalLM", "", SHAPE["vocab_size"], 2048, [0], None,
        None, "cuda-test", 0,
    )  # fmt: skip
    return LoadedModel(model, None, info)


def make_llm(loaded, **kw) -> LLM:
    return LLM(
        EngineConfig(device="cuda", num_kv_blocks=kw.pop("num_kv_blocks", 256), **kw), loaded
    )


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 49152, (5 + 13 * i,), generator=g).tolist() for i in range(n)]


def test_hashed_noise_is_the_same_on_cuda_and_cpu():
    seeds = torch.tensor([1, -5, 2**62], dtype=torch.int64)
    pos = torch.tensor([0, 7, 100], dtype=torch.int64)
    cpu = gumbel_noise(seeds, pos, token_keys(1000))
    gpu = gumbel_noise(seeds.cuda(), pos.cuda(), token_keys(1000, "cuda"))
    torch.testing.assert_close(gpu.cpu(), cpu)


def test_batched_chunked_greedy_on_cuda_matches_alone(loaded):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make_llm(loaded, max_num_batched_tokens=48)
    batch = [r.token_ids for r in llm.generate(prompts(8), params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts(8)]
    assert batch == alone
    assert llm.engine.block_manager.usage == 0.0


def test_seeded_sampling_and_forks_on_cuda(loaded):
    llm = make_llm(loaded)
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    p = prompts(3)
    solo = llm.generate([p[2]], params)[0]
    noise = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    busy = llm.generate(p, [noise, noise, params])[2]
    assert [s.token_ids for s in busy.samples] == [s.token_ids for s in solo.samples]
    assert solo.samples[0].token_ids != solo.samples[1].token_ids


def test_async_scheduling_on_cuda_gives_the_same_outputs(loaded):
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * i, logprobs=2 if i % 2 else None)
        if i % 3
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=9)
        for i in range(6)
    ]

    def outputs(flag: bool) -> list:
        llm = make_llm(loaded, async_scheduling=flag)
        results = llm.generate(prompts(6), params)
        assert llm.engine.block_manager.usage == 0.0
        ahead = llm.engine.overlap.ahead
        return [
            (r.token_ids, r.samples[0].logprobs, r.samples[0].finish_reason) for r in results
        ], ahead

    (on, ahead), (off, _) = outputs(True), outputs(False)
    assert on == off
    assert ahead > 0
