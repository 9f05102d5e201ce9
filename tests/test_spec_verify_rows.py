"""A speculative verification step replays as decode rows (engine/cuda_graphs.py): row j of a
sequence whose last token is at position p is the decode row at p + j, with the sequence's block
table and its own slot. Checked on the CPU, where `DecodeGraphs.run` runs the captured forward
eagerly over the same static buffers: the rows `decode_rows` builds, and, for every model family
(Llama, DeepSeek-V3 MLA, DeepSeek-V4 pooling), the logits, hidden states and KV cache of such a
step against the varlen verification the runner runs without graphs; and an engine whose runner
takes that path gives plain decoding's output with speculation on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepserve.engine.config import EngineConfig, SpeculativeConfig
from deepserve.engine.cuda_graphs import decode_rows
from deepserve.engine.llm import LLM
from deepserve.engine.llm_engine import graph_rows
from deepserve.engine.loading.loader import load_model
from deepserve.engine.model_runner import ModelRunner
from deepserve.engine.request import Sequence
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.scheduler import ScheduledSeq, SchedulerOutput

BLOCK = 4


def make_seq(tokens: list[int], table: list[int], drafts: list[int]) -> Sequence:
    return Sequence(
        seq_id=0, request=None, index=0, seed=0, token_ids=list(tokens),
        num_prompt_tokens=len(tokens), num_computed_tokens=len(tokens) - 1,
        block_table=list(table), spec_token_ids=list(drafts),
    )  # fmt: skip


def test_verify_rows_are_decode_rows_at_the_following_positions():
    speculating = make_seq(list(range(50, 60)), [7, 2, 5], [100, 101])  # last token at 9
    plain = make_seq([1, 2, 3, 4, 5], [3, 8], [])  # last token at 4
    rows = decode_rows([speculating, plain], BLOCK)
    assert rows.input_ids == [59, 100, 101, 5]
    assert rows.positions == [9, 10, 11, 4]
    # position 9 is offset 1 of the table's third block (5), and so on; 4 opens block 8
    assert rows.slots == [5 * BLOCK + 1, 5 * BLOCK + 2, 5 * BLOCK + 3, 8 * BLOCK]
    assert rows.tables == [[7, 2, 5]] * 3 + [[3, 8]]
    assert len(rows) == 4


def test_decode_rows_refuse_a_sequence_with_uncomputed_tokens():
    seq = make_seq([1, 2, 3, 4], [0], [9])
    seq.num_computed_tokens = 2
    with pytest.raises(AssertionError):
        decode_rows([seq], BLOCK)


# ---- the model's verification step, both ways --------------------------------------------------


def runner_for(model, num_blocks: int, graphs: bool) -> ModelRunner:
    return ModelRunner(
        model, num_blocks, BLOCK, torch.device("cpu"), (), keep_hidden=True,
        graph_rows=16 if graphs else 0, max_blocks_per_seq=num_blocks,
    )  # fmt: skip


@torch.inference_mode()
def prefill(runner: ModelRunner, seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.num_computed_tokens = 0
        inputs = runner.prepare(SchedulerOutput([ScheduledSeq(seq, seq.num_tokens - 1, False)]))
        runner.model.forward(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        seq.num_computed_tokens = seq.num_tokens - 1


@torch.inference_mode()
def varlen_verify(runner: ModelRunner, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the runner computes for a verification step without graphs."""
    items = [ScheduledSeq(s, 1 + len(s.spec_token_ids), True) for s in seqs]
    inputs = runner.prepare(SchedulerOutput(items))
    model = runner.model
    hidden = model.forward(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
    return model.compute_logits(hidden), hidden


def verify_both_ways(model, gen: torch.Generator):
    """Three sequences (drafts 3, 0 and 2; contexts across block boundaries and, for V4, its
    compressed groups) prefilled into two caches, then verified as varlen rows in one and as
    decode rows in the other, then (every draft taken as accepted) one more plain step each.
    Per way: (verification logits, hidden, cache after it, next step's logits)."""
    vocab, lens, drafts = model.vocab_size, (13, 30, 7), (3, 0, 2)
    num_blocks = sum(-(-(n + d + 1) // BLOCK) for n, d in zip(lens, drafts, strict=True)) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    results = []
    for graphs in (False, True):
        runner = runner_for(model, num_blocks, graphs)
        seqs, free = [], list(order)
        for n, d in zip(lens, drafts, strict=True):
            g = torch.Generator().manual_seed(n)
            tokens = torch.randint(3, vocab, (n + d + 1,), generator=g).tolist()
            table = [free.pop() for _ in range(-(-(n + d + 1) // BLOCK))]
            seqs.append(make_seq(tokens[:n], table, tokens[n : n + d]))
        prefill(runner, seqs)
        if graphs:
            with torch.inference_mode():
                logits, hidden = runner.graphs.run(decode_rows(seqs, BLOCK))
        else:
            logits, hidden = varlen_verify(runner, seqs)
        cache = runner.kv_cache[:, :num_blocks].clone()
        for seq, n in zip(seqs, lens, strict=True):
            seq.token_ids += seq.spec_token_ids + [n % 11 + 3]
            seq.spec_token_ids = []
            seq.num_computed_tokens = seq.num_tokens - 1
        results.append((logits, hidden, cache, varlen_verify(runner, seqs)[0]))
    return results


MODELS = ["smollm2-135m", "tiny-deepseek", pytest.param("tiny-deepseek-v4", marks=pytest.mark.slow)]
_LOADED: dict = {}


def loaded(name: str, batch_invariant: bool):
    key = (name, batch_invariant)
    if key not in _LOADED:
        torch.set_num_threads(1)
        _LOADED[key] = load_model(EngineConfig(model=name, batch_invariant=batch_invariant))
    return _LOADED[key]


@pytest.mark.parametrize("name", MODELS)
def test_verify_as_decode_rows_is_bitwise_the_varlen_verify_under_batch_invariant(name):
    model = loaded(name, True).model
    varlen, rows = verify_both_ways(model, torch.Generator().manual_seed(0))
    assert torch.equal(varlen[0], rows[0])  # logits
    assert torch.equal(varlen[1], rows[1])  # hidden states (what the MTP drafter reads)
    assert torch.equal(varlen[3], rows[3])  # the next step, over the KV each way left
    if name != "tiny-deepseek-v4":
        # V4's decode rows also pool each row's partial group into its own row's entry
        # columns, which only a group's last row's are ever read (deepseek_v4_cache.py)
        assert torch.equal(varlen[2], rows[2])


@pytest.mark.parametrize("name", MODELS)
def test_verify_as_decode_rows_matches_the_varlen_verify(name):
    model = loaded(name, False).model
    varlen, rows = verify_both_ways(model, torch.Generator().manual_seed(1))
    for a, b in zip(varlen[:2] + varlen[3:], rows[:2] + rows[3:], strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(varlen[0].argmax(-1), rows[0].argmax(-1))


# ---- the engine on that path -------------------------------------------------------------------


def with_graph_path(llm: LLM) -> ModelRunner:
    """Give the engine a runner whose decode and verification steps go through `DecodeGraphs`
    (eager on the CPU: the path a GPU engine replays), sized as the engine sizes it on a GPU."""
    engine = llm.engine
    old = engine.runner
    runner = ModelRunner(
        engine.model, engine.block_manager.num_blocks, engine.config.block_size,
        torch.device("cpu"), engine.eos_token_ids, keep_hidden=old.keep_hidden,
        graph_rows=graph_rows(engine.config),
        max_blocks_per_seq=-(-engine.max_model_len // engine.config.block_size),
    )  # fmt: skip
    old.close()
    engine.runner = runner
    return runner


class ReferenceDrafter:
    """Test only: proposes each prompt's known continuation, so every draft is accepted (drafts
    shifted by `offset` are all rejected; 49,152: the smaller vocabulary of the two models)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], offset: int = 0):
        self.known = [(p, o) for p, o in zip(prompts, outputs, strict=True)]
        self.offset = offset

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        for prompt, output in self.known:
            if token_ids[: len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                return [(t + self.offset) % 49152 for t in output[done : done + num_tokens]]
        return []


SPEC_CASES = [
    ("tiny-deepseek", SpeculativeConfig("mtp", 3), None, False),  # random MTP: drafts rejected
    ("tiny-deepseek", SpeculativeConfig("mtp", 3), None, True),  # ... paused steps run ahead
    ("tiny-deepseek", SpeculativeConfig("ngram", 3), 0, False),  # drafts accepted
    ("tiny-deepseek", SpeculativeConfig("ngram", 3), 1, True),  # drafts rejected
    ("smollm2-135m", SpeculativeConfig("ngram", 3), 0, False),  # drafts accepted
]


@pytest.mark.parametrize("name, spec, reference_offset, async_on", SPEC_CASES)
def test_speculation_through_the_decode_graph_path_gives_plain_output(
    name, spec, reference_offset, async_on
):
    model = loaded(name, True)
    prompts = [[5 + (i % 7) for i in range(n)] for n in (9, 20, 14)]  # repetitive: n-gram drafts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)

    def run(speculative, drafter=None):
        config = EngineConfig(
            model=name, batch_invariant=True, speculative=speculative, num_kv_blocks=128,
            block_size=BLOCK, max_num_seqs=4, async_scheduling=async_on and bool(speculative),
        )  # fmt: skip
        llm = LLM(config, model)
        runner = with_graph_path(llm) if speculative else None
        if drafter is not None:
            llm.engine.spec.token_proposer = drafter
        results = llm.generate(prompts, params)
        outs = [(r.token_ids, [lp.logprob for lp in r.samples[0].logprobs]) for r in results]
        return outs, llm, runner

    plain, _, _ = run(None)
    drafter = None
    if reference_offset is not None:
        drafter = ReferenceDrafter(prompts, [t for t, _ in plain], reference_offset)
    spec_out, llm, runner = run(spec, drafter)
    assert spec_out == plain
    assert runner.graphs.steps > 0  # decode and verification steps went through the graph path
    assert llm.engine.spec.stats.num_draft_tokens > 0
    assert (llm.engine.overlap.ahead > 0) == async_on


def test_engine_sizes_the_graphs_for_every_draft_row():
    config = EngineConfig(max_num_seqs=8, speculative=SpeculativeConfig("ngram", 3))
    assert graph_rows(config) == 32
    assert graph_rows(dataclasses.replace(config, speculative=None)) == 8
    assert graph_rows(dataclasses.replace(config, max_num_batched_tokens=20)) == 20
