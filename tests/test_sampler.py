"""Sampler: greedy, hashed-noise sampling that ignores the batch, filters, penalties, logprobs."""

from __future__ import annotations

import math

import torch

from deepserve.engine.request import Request, Sequence, derive_seed
from deepserve.engine.sampler import Sampler, SamplingBatch
from deepserve.engine.sampling_params import SamplingParams
from deepserve.kernels.random import as_int64, splitmix64, splitmix64_int

V = 8
EOS = (7,)
CPU = torch.device("cpu")


def seq_for(params: SamplingParams, seed: int = 1, prompt=(1, 2), output=()) -> Sequence:
    req = Request("r", list(prompt), params, seed=seed, max_tokens=16, arrival=0.0)
    return Sequence(0, req, 0, seed, list(prompt) + list(output), len(prompt))


def sample(logits: torch.Tensor, seqs: list[Sequence]):
    batch = SamplingBatch.build(seqs, EOS, V, CPU)
    return Sampler(V, CPU).sample(logits, batch)


def test_splitmix64_tensor_matches_python_reference():
    xs = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0xDEADBEEF]
    got = splitmix64(torch.tensor([as_int64(x) for x in xs], dtype=torch.int64)).tolist()
    assert [g & (2**64 - 1) for g in got] == [splitmix64_int(x) for x in xs]


def test_greedy_is_argmax_of_logits():
    logits = torch.randn(3, V)
    out = sample(logits, [seq_for(SamplingParams(temperature=0)) for _ in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_row_samples_the_same_token_in_any_batch_position():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    params = SamplingParams(temperature=1.0)
    alone = sample(logits, [seq_for(params, seed=42)]).token_ids[0]
    others = [seq_for(params, seed=s) for s in range(5)]
    busy = torch.cat([torch.randn(2, V), logits, torch.randn(3, V)])
    batch = others[:2] + [seq_for(params, seed=42)] + others[2:]
    assert sample(busy, batch).token_ids[2] == alone


def test_sampling_frequencies_follow_softmax_over_seeds():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9, -9, -9, -9]])
    params = SamplingParams(temperature=1.0)
    seqs = [seq_for(params, seed=s) for s in range(4000)]
    tokens = sample(logits.expand(4000, V), seqs).token_ids
    probs = torch.softmax(logits[0], -1)
    for t in range(4):
        freq = tokens.count(t) / 4000
        assert abs(freq - probs[t].item()) < 4 * math.sqrt(probs[t].item() / 4000) + 0.005


def test_output_position_changes_the_noise():
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=1.0)
    picks = {
        sample(logits, [seq_for(params, seed=3, output=[0] * k)]).token_ids[0] for k in range(20)
    }
    assert len(picks) > 3


def test_top_k_one_is_greedy_and_top_p_stays_in_nucleus():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2, -3, -4, -5]]).expand(500, V)
    top1 = [seq_for(SamplingParams(temperature=1.0, top_k=1), seed=s) for s in range(500)]
    assert set(sample(logits, top1).token_ids) == {0}
    nucleus = [seq_for(SamplingParams(temperature=1.0, top_p=0.8), seed=s) for s in range(500)]
    assert set(sample(logits, nucleus).token_ids) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.tensor([[0.0, -0.5, -5.0, -5.0, -9, -9, -9, -9]]).expand(500, V)
    seqs = [seq_for(SamplingParams(temperature=1.0, min_p=0.1), seed=s) for s in range(500)]
    assert set(sample(logits, seqs).token_ids) == {0, 1}


def test_penalties_follow_openai_and_ctrl_formulas():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    seq = seq_for(params, prompt=(1,), output=(0, 0, 2))
    batch = SamplingBatch.build([seq], EOS, V, CPU)
    got = Sampler(V, CPU)._process(logits, batch)[0].tolist()
    # token 0: seen twice in output; 1: only in prompt; 2: once in output; 3: unseen
    assert got[0] == 2.0 / 2 - 0.25 * 2 - 0.5
    assert got[1] == -1.0 * 2
    assert got[2] == 1.0 / 2 - 0.25 - 0.5
    assert got[3] == 0.5


def test_logit_bias_can_force_a_token():
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0, 0, 0]])
    out = sample(logits, [seq_for(SamplingParams(temperature=0, logit_bias={4: 100.0}))])
    assert out.token_ids == [4]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.tensor([[0, 0, 0, 0, 0, 9.0, 0, 10.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,))
    assert sample(logits, [seq_for(params, output=[1])]).token_ids != [7]
    assert sample(logits, [seq_for(params, output=[1])]).token_ids != [5]
    assert sample(logits, [seq_for(params, output=[1, 1])]).token_ids == [7]


def test_logprobs_are_raw_model_log_softmax_with_top_entries():
    logits = torch.randn(2, V)
    params = SamplingParams(temperature=0, logprobs=3, logit_bias={1: 50.0})
    out = sample(logits, [seq_for(params), seq_for(SamplingParams(temperature=0))])
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == 1 and math.isclose(lp.logprob, ref[1].item(), abs_tol=1e-6)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_derived_sample_seeds_differ_and_sample_zero_keeps_seed():
    assert derive_seed(99, 0) == 99
    assert len({derive_seed(99, i) for i in range(8)}) == 8
