"""The MTP proposer's chaining: which rows it runs, where their KV goes, what hidden feeds what.

The model here is a test stub that records its calls; the real DeepSeek MTP layer is exercised by the
engine tests (tests/test_spec_decode_engine.py).
"""

import torch

from deepserve.engine.spec_decode.mtp import MtpProposer, MtpRows

VOCAB = HIDDEN = 50
BLOCK = 4


class CountingMtp:
    """hidden = one-hot(token + 1) + previous hidden; logits = hidden: drafts count upwards."""

    def __init__(self):
        self.calls = []

    def forward_mtp(self, input_ids, positions, previous_hidden, attn, kv_cache):
        self.calls.append((input_ids.tolist(), positions.tolist(), previous_hidden.clone()))
        kv_cache[-1].view(-1, kv_cache.shape[-1])[attn.slot_mapping, 0] = input_ids.float()
        return torch.nn.functional.one_hot(input_ids + 1, VOCAB).float() + 0.5 * previous_hidden

    def compute_mtp_logits(self, hidden):
        return hidden


def _cache(num_blocks=8):
    return torch.full((2, num_blocks, BLOCK, 1), -1.0)


def test_drafts_chain_from_the_newest_token():
    model = CountingMtp()
    rows = MtpRows(
        [3, 5], start=2, token_ids=[10, 11], prev_hidden=torch.zeros(2, HIDDEN), num_drafts=3
    )
    assert MtpProposer(model, BLOCK).propose([rows], _cache()) == [[12, 13, 14]]
    assert [c[1] for c in model.calls] == [[2, 3], [4], [5]]  # catch-up rows, then one per draft
    assert [c[0] for c in model.calls] == [[10, 11], [12], [13]]


def test_chained_rows_get_the_mtp_output_hidden_as_previous_hidden():
    model = CountingMtp()
    prev = torch.randn(1, HIDDEN)
    rows = MtpRows([0], start=0, token_ids=[7], prev_hidden=prev, num_drafts=2)
    MtpProposer(model, BLOCK).propose([rows], _cache())
    assert torch.equal(model.calls[0][2], prev)
    expected = torch.nn.functional.one_hot(torch.tensor([8]), VOCAB).float() + 0.5 * prev
    assert torch.equal(model.calls[1][2], expected)


def test_kv_is_written_at_each_rows_paged_slot():
    cache = _cache()
    rows = MtpRows(
        [6, 2], start=3, token_ids=[20, 21], prev_hidden=torch.zeros(2, HIDDEN), num_drafts=2
    )
    MtpProposer(CountingMtp(), BLOCK).propose([rows], cache)
    written = cache[-1, :, :, 0]
    # positions 3 (block 6, offset 3), 4 and 5 (block 2, offsets 0 and 1)
    assert written[6, 3] == 20 and written[2, 0] == 21 and written[2, 1] == 22
    assert (written[2, 2:] == -1).all()  # the last draft is proposed, not written


def test_sequences_with_different_draft_counts_in_one_batch():
    model = CountingMtp()
    work = [
        MtpRows([0], start=1, token_ids=[1], prev_hidden=torch.zeros(1, HIDDEN), num_drafts=1),
        MtpRows(
            [1, 2],
            start=2,
            token_ids=[30, 31, 32],
            prev_hidden=torch.zeros(3, HIDDEN),
            num_drafts=3,
        ),
        MtpRows([3], start=0, token_ids=[40], prev_hidden=torch.zeros(1, HIDDEN), num_drafts=0),
    ]
    assert MtpProposer(model, BLOCK).propose(work, _cache()) == [[2], [33, 34, 35], []]
    assert model.calls[0][1] == [1, 2, 3, 4, 0]
    assert model.calls[1][1] == [5] and model.calls[2][1] == [6]
