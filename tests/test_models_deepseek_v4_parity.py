"""tiny-deepseek-v4 (seeded DeepSeek-V4 architecture: sliding / CSA / HCA layers, lightning indexer,
hyper-connections, hash and sqrtsoftplus MoE) against transformers' DeepseekV4ForCausalLM on the
same HF folder, the per-token KV rows against chunking and batching, and a set's fused MoE op
against the expert loop."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_loop import SequenceLoop, batched_step_logits

from deepserve.engine.config import EngineConfig
from deepserve.engine.loading.loader import load_model
from deepserve.engine.models.deepseek_v4_config import CSA, HCA, SLIDING
from deepserve.engine.testmodels.tiny_deepseek_v4 import TINY_V4_CONFIG, write_tiny_deepseek_v4

LENGTHS = [1, 17, 300, 2000]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny-deepseek-v4"), seed=0)


@pytest.fixture(scope="module")
def ours(tiny_dir):
    torch.set_num_threads(1)
    return load_model(EngineConfig(model=str(tiny_dir)))


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 128000, (max(LENGTHS),), generator=gen).tolist()


def test_tiny_config_reaches_past_the_window_and_the_indexers_top_k():
    c = TINY_V4_CONFIG
    csa, hca = (c["compress_rates"][t] for t in c["layer_types"][1:3])
    assert set(c["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert "hash_moe" in c["mlp_layer_types"] and "moe" in c["mlp_layer_types"]
    assert c["sliding_window"] < 300 and 300 // csa > c["index_topk"] and 300 // hca >= 8


def test_model_info(ours):
    info = ours.info
    assert (info.family, info.architecture) == ("deepseek_v4", "DeepseekV4ForCausalLM")


def test_each_layer_owns_a_run_of_the_token_row_as_wide_as_its_kind(ours):
    model, spec = ours.model, ours.model.kv_cache_spec
    d, di = TINY_V4_CONFIG["head_dim"], TINY_V4_CONFIG["index_head_dim"]
    # sliding: the window latent; HCA: + compressor kv and gate, entry; CSA: 2-series compressor
    # inputs, the indexer's inputs, entry and indexer key
    width = {SLIDING: d, HCA: 4 * d, CSA: 6 * d + 5 * di}
    kinds = model.args.layer_types + model.args.mtp_layer_types
    layout = model.row_layout
    assert layout.widths == tuple(width[k] for k in kinds)
    assert (spec.num_layers, spec.width) == (1, layout.width)
    ends = [o + w for o, w in zip(layout.offsets, layout.widths, strict=True)]
    assert all(
        end <= nxt for end, nxt in zip(ends, layout.offsets[1:] + (layout.width,), strict=True)
    )
    assert layout.width < len(kinds) * width[CSA]  # not every layer as wide as CSA's


@pytest.mark.parametrize("length", LENGTHS)
def test_last_position_logits_match_transformers(ours, hf, prompt_ids, length):
    prompt = prompt_ids[:length]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    got = SequenceLoop(ours.model, length + 1).logits(prompt)
    diff = (got - expected).abs().max().item()
    print(f"tiny-deepseek-v4 float32 {length}-token prompt: max abs logit diff {diff:.2e}")
    assert diff < 1e-4


def test_greedy_64_tokens_match_transformers(ours, hf, prompt_ids):
    """Decode crosses window, group and indexer boundaries one token at a time."""
    prompt = prompt_ids[:120]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
    got = SequenceLoop(ours.model, len(prompt) + 65).greedy(prompt, 64)
    assert got == expected[0, len(prompt) :].tolist()


def test_chunked_prefill_matches_one_shot(ours, prompt_ids):
    """Chunk edges that split compressed groups and windows: open groups are rebuilt from rows."""
    prompt = prompt_ids[:300]
    one_shot = SequenceLoop(ours.model, 301).logits(prompt)
    loop, start = SequenceLoop(ours.model, 301), 0
    for size in (5, 1, 62, 3, 17, 128):
        loop.hidden(prompt[start : start + size])
        start += size
    chunked = loop.logits(prompt[start:])
    assert (chunked - one_shot).abs().max().item() < 1e-5


def test_mixed_batch_step_matches_each_sequence_alone(ours, prompt_ids):
    ids = prompt_ids
    contexts = [[], ids[:70], ids[100:163], ids[200:217]]
    new = [ids[300:333], ids[70:82], [ids[163]], [ids[217]]]
    batched = batched_step_logits(ours.model, contexts, new, block_size=8)
    for i, (c, n) in enumerate(zip(contexts, new, strict=True)):
        alone = SequenceLoop(ours.model, len(c) + len(n) + 1).logits(c + n)
        assert (batched[i] - alone).abs().max().item() < 1e-4


def _moe_by_pairs(x, gate_up, down, weights, ids, add=None, swiglu_limit=None):
    """KernelSet.moe's contract written per (token, slot) pair, V4's clamped SwiGLU included."""
    gate, up = torch.einsum("tkoh,th->tko", gate_up[ids], x).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    y = torch.einsum("tkhi,tki->tkh", down[ids], torch.nn.functional.silu(gate) * up)
    out = (y * weights[..., None]).sum(dim=1).to(x.dtype)
    return out if add is None else out + add


def test_a_sets_fused_moe_gives_the_expert_loops_logits(ours, prompt_ids):
    fused = copy.copy(ours.model)
    fused.k = dataclasses.replace(ours.model.k, moe=_moe_by_pairs)
    prompt = prompt_ids[:40]
    want = SequenceLoop(ours.model, 41).logits(prompt)
    got = SequenceLoop(fused, 41).logits(prompt)
    assert (got - want).abs().max().item() < 1e-4
