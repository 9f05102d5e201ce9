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
from deepserve.engine.models.mla_prefill import plan_by_role, plan_step  # noqa: E402
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


def test_only_the_cuda_sets_decompress_and_batch_invariant_does_so_by_role():
    from deepserve.kernels.reference import KERNELS
    from deepserve.kernels.registry import triton_kernels

    assert fast_kernels().flash_prefill is not None and not fast_kernels().flash_prefill_by_role
    assert triton_kernels().flash_prefill is not None and triton_kernels().flash_prefill_by_role
    assert KERNELS.flash_prefill is None


def test_the_role_plan_decompresses_prompt_rows_and_keeps_generated_rows_absorbed():
    # a 3-token chunk inside a 9-token prompt, a decode past its prompt, and a recompute after
    # preemption: 6 prompt rows from 0, then 2 generated ones
    attn = _metadata(qlens=[3, 1, 8], ctx=[2, 6, 0])
    attn.prompt_lens_cpu = [9, 4, 6]
    plan = plan_by_role(attn)
    assert plan.rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert plan.short_rows.tolist() == [3, 10, 11]
    assert plan.varlen.query_lens_cpu == [3, 6]
    assert plan.varlen.context_lens.tolist() == [2, 0]
    assert plan.varlen.key_start_loc.tolist() == [0, 5, 11]
    short = plan.short_attn
    assert short.query_lens_cpu == [1, 2]
    assert short.context_lens_cpu == [6, 6] and short.seq_lens_cpu == [7, 8]
    assert short.block_tables.tolist() == [[0, 4, 5], [6, 7, 8]]


def test_the_role_plan_is_none_without_prompt_rows():
    attn = _metadata(qlens=[1, 1, 2], ctx=[6, 2, 3])
    assert plan_by_role(attn) is None  # not told: every row generated
    attn = _metadata(qlens=[1, 1, 2], ctx=[6, 2, 3])
    attn.prompt_lens_cpu = [6, 2, 3]
    assert plan_by_role(attn) is None


# on a GPU bf16 too: tensor-core tiles, where a row's bits could follow its tile
ROLE_DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# and a prompt long enough for the prefill-sized matmul tiles (past 512 rows)
ROLE_CHUNKINGS = [[20], [7, 1, 12], [19, 1]]
if DEVICE == "cuda":
    ROLE_CHUNKINGS += [[700], [300, 1, 399], [699, 1]]


def _invariant_model(dtype: torch.dtype = torch.float32):
    from deepserve.kernels.registry import triton_kernels

    weights = _tensors(CONFIG, torch.Generator().manual_seed(0))
    counter = CountingFlash(triton_kernels().flash_prefill)
    kernels = replace(triton_kernels(), flash_prefill=counter)
    store = WeightStore(weights, torch.device(DEVICE), dtype)
    return DeepseekV3ForCausalLM(CONFIG, store, kernels, "t"), counter


def _run(model, prompt: list[int], chunks: list[int], generated: list[int]) -> list[torch.Tensor]:
    """The prompt fed in `chunks`, then `generated` one decode at a time: each step's logits."""
    loop = SequenceLoop(model, len(prompt) + len(generated), block_size=4)
    loop.prompt_len = len(prompt)
    out, fed = [], 0
    for n in chunks:
        out.append(loop.logits(prompt[fed : fed + n]))
        fed += n
    return out[-1:] + [loop.logits([t]) for t in generated]


@pytest.mark.parametrize("dtype", ROLE_DTYPES)
def test_batch_invariant_prompt_rows_give_the_same_bits_at_every_chunking(dtype):
    """Every prompt row takes the decompressed form whatever its chunk (one of 1 token, as after
    a prefix hit, included), so the chunking changes no bit of the prompt's or the decodes'."""
    model, counter = _invariant_model(dtype)
    generated, runs = [7, 1, 9], {}
    for chunks in ROLE_CHUNKINGS:
        prompt = [3 + i % 290 for i in range(sum(chunks))]
        counter.rows = 0
        runs.setdefault(len(prompt), []).append(_run(model, prompt, chunks, generated))
        assert counter.rows == len(prompt) * CONFIG["num_hidden_layers"]  # no decode row
    for want, *others in runs.values():
        for got in others:
            assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


@pytest.mark.parametrize("dtype", ROLE_DTYPES)
def test_batch_invariant_generated_rows_recomputed_with_their_prompt_keep_their_decode_bits(dtype):
    """A recompute after preemption feeds prompt and generated tokens as one chunk: the
    generated rows stay absorbed, so the last one's logits are its decode's, bit for bit."""
    model, _ = _invariant_model(dtype)
    prompt, generated = list(range(3, 23)), [7, 1, 9]
    decoded = _run(model, prompt, [20], generated)
    loop = SequenceLoop(model, 48, block_size=4)
    loop.prompt_len = len(prompt)
    assert torch.equal(loop.logits(prompt + generated), decoded[-1])
