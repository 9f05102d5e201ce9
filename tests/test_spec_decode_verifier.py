"""Draft acceptance: the longest prefix of drafts equal to the target's own samples, the sampling
of verified rows (each as plain decoding samples its position), and the acceptance counters."""

import torch

from deepserve.engine.request import Request, Sequence
from deepserve.engine.sampler import Sampler, SamplingBatch
from deepserve.engine.sampling_params import SamplingParams
from deepserve.engine.spec_decode.decoder import sampling_views
from deepserve.engine.spec_decode.stats import SpecDecodeStats
from deepserve.engine.spec_decode.verifier import num_matching

V = 64
CPU = torch.device("cpu")


def test_stats_count_acceptance_by_position_and_mean_length():
    stats = SpecDecodeStats()
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    stats.observe(0, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.acceptance_rate == 0.5
    assert stats.acceptance_rate_by_position() == [2 / 3, 1 / 3, 1 / 2]
    assert stats.mean_accepted_length == (4 + 2 + 1) / 3


def test_num_matching_counts_leading_equal_drafts():
    assert num_matching([4, 5, 6], [4, 5, 7, 8]) == 2
    assert num_matching([], [3]) == 0
    assert num_matching([1, 2], [1, 2, 9]) == 2


def _sequence(params: SamplingParams, tokens: list[int], drafts: list[int]) -> Sequence:
    request = Request("r", tokens[:3], params, seed=99, max_tokens=16, arrival=0.0)
    seq = Sequence(0, request, 0, 99, list(tokens), num_prompt_tokens=3)
    seq.spec_token_ids = list(drafts)
    return seq


def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    return Sampler(V, CPU).sample(logits, SamplingBatch.build(seqs, (), V, CPU)).token_ids


def test_verified_row_samples_what_plain_decoding_samples_after_the_drafts_before_it():
    """Row j is keyed by the output position plain decoding samples there (seeded noise) and
    penalised by the history it has then, so the same logits give the same token."""
    params = SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4)
    tokens, drafts = [1, 2, 3, 4, 5], [5, 6, 5]
    logits = torch.randn(len(drafts) + 1, V, generator=torch.Generator().manual_seed(0))
    verified = _sample(logits, sampling_views(_sequence(params, tokens, drafts)))
    plain = [
        _sample(logits[j : j + 1], [_sequence(params, tokens + drafts[:j], [])])[0]
        for j in range(len(drafts) + 1)
    ]
    assert verified == plain


def test_a_rows_randomness_does_not_depend_on_the_draft_tokens():
    """Without penalties a row's sample depends on its logits, seed and position only: other
    drafts before it (which the drafter chose without any randomness) leave it unchanged."""
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(4, V)  # flat logits: the noise alone picks the token
    one = _sample(logits, sampling_views(_sequence(params, [1, 2, 3, 4], [7, 8, 9])))
    other = _sample(logits, sampling_views(_sequence(params, [1, 2, 3, 4], [30, 31, 32])))
    assert one == other
    assert len(set(one)) > 1  # each position draws its own noise
