"""MLA's prefill in the decompressed form (engine/models/mla_prefill.py, kernels/triton/
flash_prefill.py) against the absorbed form on the tiny DeepSeek-V3 model (YaRN mscale on): the
same logits for fresh prompts, chunks after a cached context, and a mixed step whose decode rows
stay absorbed; and which rows a step's plan sends where. Runs on CUDA when there is one, else in
Triton's interpreter; skipped without triton."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)
from model_loop import SequenceLoop, batched_step_logits  # noqa: E402

from deepserve.engine.models.common import WeightStore  # noqa: E402
from deepserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from deepserve.engine.models.mla_prefill import plan_step  # noqa: E402
from deepserve.engine.testmodels.tiny_deepseek import TINY_CONFIG, _tensors  # noqa: E402
from deepserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from deepserve.kernels.registry import fast_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = dict(TINY_CONFIG, vocab_size=300)
MIN_TOKENS = 8  # the tiny model's chunks are short: lower the threshold so they decompress


class CountingFlash:
    """The real `flash_prefill`, counting the query rows it was given."""

    def __init__(self, flash) -> None:
        self.flash, self.rows = flash, 0

    def __call__(self, q_nope, *rest):
        self.rows += q_nope.shape[0]
        return self.flash(q_nope, *rest)


def _models():
    """(absorbed-only model, decompressing model, its counter) over the same weights."""
    weights = _tensors(CONFIG, torch.Generator().manual_seed(0))
    fast = fast_kernels()
    counter = CountingFlash(fast.flash_prefill)
    models = []
    for kernels in (replace(fast, flash_prefill=None), replace(fast, flash_prefill=counter)):
        store = WeightStore(weights, torch.device(DEVICE), torch.float32)
        model = DeepseekV3ForCausalLM(CONFIG, store, kernels, "t")
        model.decompress_min_tokens = MIN_TOKENS
        models.append(model)
    return models[0], models[1], counter


def test_decompressed_prefill_gives_the_absorbed_logits_for_prompts_chunks_and_decodes():
    absorbed, decompressed, counter = _models()
    # a fresh 20-token prompt, a 9-token chunk over its 20 (context longer than the chunk), a
    # 3-token chunk and a decode (both under the threshold: absorbed on both models)
    steps = [list(range(3, 23)), [7, 1, 9, 4, 4, 2, 8, 5, 6], [11, 12, 13], [14]]
    loops = [SequenceLoop(m, 40, block_size=4) for m in (absorbed, decompressed)]
    for step in steps:
        want, got = (loop.logits(step) for loop in loops)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    layers = CONFIG["num_hidden_layers"]
    assert counter.rows == (20 + 9) * layers  # the long chunks, and only they, decompressed


def test_a_mixed_steps_decodes_and_small_chunks_stay_absorbed_beside_a_decompressed_chunk():
    absorbed, decompressed, counter = _models()
    # each context prefilled alone first (only the 12-token one decompresses), then one step of
    # a decode, a 12-token chunk over 12 cached tokens, and a 3-token chunk
    contexts = [[5, 9, 2, 7], list(range(40, 52)), [8, 8, 3]]
    new = [[1], list(range(60, 72)), [4, 2, 6]]
    want = batched_step_logits(absorbed, contexts, new, block_size=4)
    got = batched_step_logits(decompressed, contexts, new, block_size=4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counter.rows == (12 + 12) * CONFIG["num_hidden_layers"]


def _metadata(qlens: list[int], ctx: list[int]) -> AttentionMetadata:
    lens = [c + q for c, q in zip(ctx, qlens, strict=True)]
    loc = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    return AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        slot_mapping=torch.arange(sum(qlens)),
        block_tables=torch.tensor([[3, 1, 2], [0, 4, 5], [6, 7, 8]], dtype=torch.int32),
        block_size=4,
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
        context_lens_cpu=ctx,
    )


def test_the_plan_sends_long_chunks_to_the_decompressed_form_and_the_rest_absorbed():
    attn = _metadata(qlens=[1, 8, 2], ctx=[6, 2, 0])
    plan = plan_step(attn, min_tokens=8)
    assert plan.rows.tolist() == list(range(1, 9))
    assert plan.short_rows.tolist() == [0, 9, 10]
    assert plan.varlen.key_start_loc.tolist() == [0, 10]
    assert plan.varlen.context_lens.tolist() == [2]
    # keys 0..9 of sequence 1, through its block table [0, 4, 5] of 4-token blocks
    assert plan.key_slots.tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 20, 21]
    assert plan.short_attn.query_lens_cpu == [1, 2]
    assert plan.short_attn.block_tables.tolist() == [[3, 1, 2], [6, 7, 8]]
    assert plan.short_attn.slot_mapping.tolist() == [0, 9, 10]


def test_a_step_without_a_long_chunk_has_no_plan_and_an_all_long_step_no_split():
    assert plan_step(_metadata(qlens=[1, 7, 2], ctx=[6, 2, 0]), min_tokens=8) is None
    plan = plan_step(_metadata(qlens=[8, 9, 10], ctx=[0, 0, 0]), min_tokens=8)
    assert plan.rows is None and plan.short_rows is None and plan.short_attn is None


def test_only_the_default_cuda_set_decompresses_batch_invariant_keeps_the_absorbed_prefill():
    """Which rows take the decompressed form follows the chunking, so their bits would too."""
    from deepserve.kernels.reference import KERNELS
    from deepserve.kernels.registry import triton_kernels

    assert fast_kernels().flash_prefill is not None
    assert triton_kernels().flash_prefill is None
    assert KERNELS.flash_prefill is None
