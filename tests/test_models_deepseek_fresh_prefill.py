"""MLA's decompressed form for fresh prompts (engine/models/fresh_prefill.py) against the absorbed
paged form on tiny-deepseek in float32: the same weights with and without the KernelSet's
`prefill_attention`. Rows that are not fresh prompts (decodes, later chunks) keep the absorbed
form, bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from model_loop import SequenceLoop, batched_step_logits
from safetensors.torch import load_file

from deepserve.engine.models.common import WeightStore
from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepserve.engine.models.fresh_prefill import fresh_split
from deepserve.engine.tiny_deepseek import write_tiny_deepseek
from deepserve.kernels import reference
from deepserve.kernels.causal_attention import CausalAttention

TOL = 1e-4  # float32 logits: the two forms sum in other orders


def _model(folder, kernels, device="cpu", dtype=torch.float32) -> DeepseekV3ForCausalLM:
    config = json.loads((folder / "config.json").read_text())
    store = WeightStore(load_file(str(folder / "model.safetensors")), torch.device(device), dtype)
    with torch.inference_mode():
        return DeepseekV3ForCausalLM(config, store, kernels, "tiny")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), seed=0)


@pytest.fixture(scope="module")
def models(folder):
    torch.set_num_threads(1)
    fresh = _model(folder, reference.KERNELS)
    absorbed = _model(folder, replace(reference.KERNELS, prefill_attention=None))
    assert fresh.fresh_attention is not None and absorbed.fresh_attention is None
    return fresh, absorbed


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fresh_prompt_matches_the_absorbed_form(models):
    prompt = _ids(150, 0)
    fresh, absorbed = (SequenceLoop(m, 160).hidden(prompt) for m in models)
    assert (fresh - absorbed).abs().max().item() < TOL


def test_batch_of_fresh_prompts_of_different_lengths_matches(models):
    new = [_ids(n, n) for n in (37, 5, 90, 2)]
    fresh, absorbed = (batched_step_logits(m, [[]] * 4, new, block_size=8) for m in models)
    assert (fresh - absorbed).abs().max().item() < TOL


def test_mixed_step_of_decodes_and_a_fresh_prompt_matches(models):
    contexts = [_ids(40, 1), [], _ids(17, 2), []]
    new = [_ids(1, 3), _ids(60, 4), _ids(1, 5), _ids(9, 6)]
    fresh, absorbed = (batched_step_logits(m, contexts, new, block_size=8) for m in models)
    assert (fresh - absorbed).abs().max().item() < TOL


def test_one_token_prompt_stays_on_the_absorbed_path(models):
    """So a decode step captured in a CUDA graph (query lengths 1) never takes the fresh path."""
    loop = SequenceLoop(models[0], 16)
    assert fresh_split(loop.metadata(1)) is None
    assert fresh_split(loop.metadata(2)) is not None


def test_second_chunk_takes_the_absorbed_path_bit_for_bit(models):
    """Both models continue from the same cache: a chunk with cached context runs absorbed."""
    fresh, absorbed = models
    prompt = _ids(70, 7)
    first = SequenceLoop(absorbed, 80)
    first.hidden(prompt[:40])
    second = SequenceLoop(fresh, 80)
    second.cache.copy_(first.cache)
    second.length = first.length
    assert torch.equal(second.hidden(prompt[40:]), first.hidden(prompt[40:]))


def test_first_chunk_of_a_chunked_prompt_matches_the_whole_prompt(models):
    fresh, _ = models
    prompt = _ids(70, 8)
    whole = SequenceLoop(fresh, 80).hidden(prompt)
    chunked = SequenceLoop(fresh, 80)
    parts = torch.cat([chunked.hidden(prompt[:40]), chunked.hidden(prompt[40:])])
    assert (whole - parts).abs().max().item() < TOL


def test_flash_form_declines_shapes_the_flash_kernel_cannot_take():
    flash = CausalAttention(flash=True)
    assert flash.covers(192, 128, torch.bfloat16)
    assert not flash.covers(192, 128, torch.float32)  # flash is half precision only
    assert not flash.covers(576, 512, torch.bfloat16)  # past its 256 head dim
    assert not flash.covers(128, 192, torch.bfloat16)  # values wider than keys: no padding


def test_values_narrower_than_keys_give_plain_causal_attention():
    """The values are padded to the key width for SDPA's flash kernel; the output is sliced back."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(33, 4, d, generator=gen) for d in (24, 24, 16))
    got = CausalAttention(flash=True)(q, k, v, 0.2)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.2
    scores = scores.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert got.shape == (33, 4, 16)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flash_form_matches_the_absorbed_form_in_bfloat16(folder):
    from deepserve.kernels.triton.kernelset import fast_kernels

    kernels = fast_kernels()
    if kernels is None:
        pytest.skip("needs triton")
    fresh = _model(folder, kernels, "cuda", torch.bfloat16)
    absorbed = _model(folder, replace(kernels, prefill_attention=None), "cuda", torch.bfloat16)
    assert fresh.fresh_attention is not None
    contexts = [_ids(40, 1), [], _ids(17, 2), []]
    new = [_ids(1, 3), _ids(300, 4), _ids(1, 5), _ids(9, 6)]
    got, want = (batched_step_logits(m, contexts, new, block_size=16) for m in (fresh, absorbed))
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    print(f"bf16 decompressed vs absorbed: max abs {(got - want).abs().max().item():.3f}")
    assert cosine.min().item() > 0.999
