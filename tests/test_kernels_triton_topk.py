"""The one-launch top-k (kernels/triton/topk.py) against its torch twin
(sparse_attention.topk_ascending): the same entries in the same order, ties to the lower index,
-1 padding past a row's visible count. On CUDA when there is one, else Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

from deepserve.kernels.triton import sparse_attention, topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _masked(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """-inf past each row's visible count, as the indexer writes its scores."""
    past = visible[:, None] <= torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(past, float("-inf"))


@pytest.mark.parametrize("k", [1, 7, 64, 300])
def test_random_scores_choose_what_torch_topk_chooses(k):
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(5, 300, generator=g).to(DEVICE)
    visible = torch.tensor([300, 299, 64, 1, 150], device=DEVICE)
    scores = _masked(scores, visible)
    want = sparse_attention.topk_ascending(scores, visible, k)
    assert torch.equal(topk.topk_ascending(scores, visible, k), want)


def test_ties_go_to_the_lower_index_and_signed_zeros_are_one_score():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-2, 3, (4, 90), generator=g).float().to(DEVICE)
    scores[0, :40] = -0.0
    scores[1] = 5.0  # one score throughout: the first k entries
    visible = torch.tensor([90, 90, 90, 45], device=DEVICE)
    scores = _masked(scores, visible)
    got = topk.topk_ascending(scores, visible, 10)
    assert torch.equal(got, sparse_attention.topk_ascending(scores, visible, 10))
    assert torch.equal(got[1], torch.arange(10, device=DEVICE))


def test_a_row_shorter_than_k_keeps_every_visible_entry_then_pads():
    scores = torch.randn(3, 20).to(DEVICE)
    visible = torch.tensor([20, 5, 0], device=DEVICE)
    got = topk.topk_ascending(_masked(scores, visible), visible, 16)
    assert torch.equal(got[1], torch.tensor([0, 1, 2, 3, 4] + [-1] * 11, device=DEVICE))
    assert torch.equal(got[2], torch.full((16,), -1, device=DEVICE))


def test_rows_longer_than_one_block_select_across_blocks():
    g = torch.Generator().manual_seed(9)
    n = topk.BLOCK * 2 + 37
    scores = torch.randn(2, n, generator=g).to(DEVICE)
    scores[0, -5:] = 100.0  # the best entries in the last block
    visible = torch.tensor([n, n - 100], device=DEVICE)
    scores = _masked(scores, visible)
    want = sparse_attention.topk_ascending(scores, visible, 50)
    assert torch.equal(topk.topk_ascending(scores, visible, 50), want)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(6, 200, generator=g).to(DEVICE)
    visible = torch.tensor([200, 180, 90, 200, 10, 150], device=DEVICE)
    scores = _masked(scores, visible)
    full = topk.topk_ascending(scores, visible, 32)
    alone = topk.topk_ascending(scores[2:3], visible[2:3], 32)
    assert torch.equal(full[2:3], alone)
