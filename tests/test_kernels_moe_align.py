"""The fused MoE's `align` kernel against its torch oracle (`align_reference`, the stable argsort
path): the same table and block experts, bit for bit, since the grouped GEMM's rows follow the
table's order. Runs on CUDA when there is one, else in Triton's interpreter; skipped without
triton."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)

from deepserve.kernels.triton import fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _router_ids(tokens: int, top_k: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Distinct experts per token, as a router's top-k picks them."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)[1].to(DEVICE)


def _assert_matches_reference(ids: torch.Tensor, experts: int, block_m: int) -> None:
    table, block_expert = fused_moe.align_kernel(ids, experts, block_m)
    want_table, want_block_expert = fused_moe.align_reference(ids, experts, block_m)
    assert table.dtype == want_table.dtype and block_expert.dtype == want_block_expert.dtype
    assert torch.equal(table, want_table)
    assert torch.equal(block_expert, want_block_expert)


@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m",
    [(64, 6, 256, 16), (64, 6, 64, 16), (1, 6, 256, 16), (3, 2, 4, 2), (200, 8, 256, 16)],
)
def test_align_kernel_equals_the_reference_at_decode_sizes(tokens, top_k, experts, block_m):
    _assert_matches_reference(_router_ids(tokens, top_k, experts), experts, block_m)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m", [(2000, 6, 64, 64), (8192, 8, 256, 128)]
)
def test_align_kernel_equals_the_reference_over_many_chunks(tokens, top_k, experts, block_m):
    _assert_matches_reference(_router_ids(tokens, top_k, experts, seed=1), experts, block_m)


def test_align_kernel_equals_the_reference_past_one_chunk():
    pairs = fused_moe.ALIGN_CHUNK + 300  # a second, partial chunk after a full one
    _assert_matches_reference(_router_ids(pairs // 4, 4, 64, seed=2), 64, 16)


def test_align_kernel_equals_the_reference_when_most_experts_are_never_chosen():
    g = torch.Generator().manual_seed(3)
    chosen = torch.tensor([0, 7, 8, 100, 255])
    ids = chosen[torch.randint(0, len(chosen), (64, 6), generator=g)].to(DEVICE)
    _assert_matches_reference(ids, 256, 16)


@pytest.mark.parametrize("expert", [0, 37, 63])
def test_align_kernel_equals_the_reference_with_every_pair_on_one_expert(expert):
    _assert_matches_reference(torch.full((64, 6), expert, device=DEVICE), 64, 16)


def test_align_takes_the_kernel_up_to_its_limit_and_matches_the_reference():
    ids = _router_ids(64, 6, 256, seed=4)
    assert ids.numel() <= fused_moe.ALIGN_KERNEL_MAX_PAIRS
    got, want = fused_moe.align(ids, 256, 16), fused_moe.align_reference(ids, 256, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
