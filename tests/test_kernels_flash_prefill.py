"""kernels/triton/flash_prefill.py: the causal varlen flash attention against torch's SDPA with a
causal mask per sequence (fresh prompts and chunks after a longer context, MLA's shared rope key),
and a row's bits independent of the other sequences in its launch. Runs on CUDA when there is
one, else small shapes in Triton's interpreter; skipped without triton."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)

from deepserve.kernels.attention_metadata import CausalVarlen  # noqa: E402
from deepserve.kernels.triton.flash_prefill import FlashConfig, flash_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = FlashConfig(block_m=16, block_n=16, num_warps=4)  # several tiles and key blocks


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


class Case:
    """Sequences given as (context, fresh queries), with per-head keys over context + queries."""

    def __init__(self, seqs, heads=3, dn=16, dr=8, dv=16, seed=0):
        self.seqs = seqs
        tokens, keys = sum(n for _, n in seqs), sum(c + n for c, n in seqs)
        self.q = _rand(tokens, heads, dn + dr, seed=seed)
        self.k_nope = _rand(keys, heads, dn, seed=seed + 1)
        self.k_rope = _rand(keys, 1, dr, seed=seed + 2)  # one rope key per token, as in MLA
        self.v = _rand(keys, heads, dv, seed=seed + 3)
        self.dn, self.scale = dn, (dn + dr) ** -0.5

    def varlen(self) -> CausalVarlen:
        qlens = [n for _, n in self.seqs]

        def starts(lens):
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        return CausalVarlen(
            query_start_loc=starts(qlens).to(DEVICE),
            key_start_loc=starts([c + n for c, n in self.seqs]).to(DEVICE),
            context_lens=torch.tensor([c for c, _ in self.seqs], dtype=torch.int32).to(DEVICE),
            query_lens_cpu=qlens,
        )

    def flash(self, cfg: FlashConfig) -> torch.Tensor:
        heads = self.q.shape[1]
        q, dn = self.q, self.dn
        k_rope = self.k_rope.expand(-1, heads, -1)
        return flash_prefill(
            q[..., :dn], q[..., dn:], self.k_nope, k_rope, self.v, self.varlen(), self.scale, cfg
        )

    def sdpa(self) -> torch.Tensor:
        heads = self.q.shape[1]
        keys = torch.cat([self.k_nope, self.k_rope.expand(-1, heads, -1)], dim=-1)
        outs, q0, k0 = [], 0, 0
        for c, n in self.seqs:
            q = self.q[q0 : q0 + n].transpose(0, 1)  # [H, n, D]
            k = keys[k0 : k0 + c + n].transpose(0, 1)
            v = self.v[k0 : k0 + c + n].transpose(0, 1)
            mask = torch.arange(c + n, device=DEVICE)[None, :] <= c + torch.arange(n, device=DEVICE)[:, None]  # fmt: skip
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            outs.append(out.transpose(0, 1))
            q0, k0 = q0 + n, k0 + c + n
        return torch.cat(outs)


@pytest.mark.parametrize("cfg", [SMALL, FlashConfig()], ids=["16x16", "default"])
def test_flash_prefill_matches_sdpa_on_fresh_prompts_and_chunks_after_longer_contexts(cfg):
    # a fresh prompt, a chunk whose context (100) is longer than its 20 queries, one query
    case = Case([(0, 70), (100, 20), (37, 1)])
    torch.testing.assert_close(case.flash(cfg), case.sdpa(), rtol=1e-5, atol=1e-5)


# float16, not bfloat16: the interpreter's bfloat16 products are wrong (kernel_checks.py checks
# bfloat16 on the device)
def test_flash_prefill_in_half_precision_matches_float32_sdpa_to_its_rounding():
    case = Case([(0, 70), (100, 20)], seed=5)
    want = case.sdpa()
    case.q, case.k_nope, case.k_rope, case.v = (
        t.half() for t in (case.q, case.k_nope, case.k_rope, case.v)
    )
    got = case.flash(SMALL)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_flash_prefill_takes_head_dims_that_are_not_powers_of_two():
    case = Case([(30, 25), (0, 40)], heads=2, dn=32, dr=24, dv=20, seed=7)
    torch.testing.assert_close(case.flash(SMALL), case.sdpa(), rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_other_sequences_in_the_launch():
    """The same sequence alone, and after another whose 9 rows move it across tile boundaries."""
    alone = Case([(20, 45)], seed=3)
    both = Case([(4, 9), (20, 45)], seed=3)
    rows, keys = slice(9, 9 + 45), slice(13, 13 + 65)
    both.q[rows], both.k_nope[keys] = alone.q, alone.k_nope
    both.k_rope[keys], both.v[keys] = alone.k_rope, alone.v
    assert torch.equal(both.flash(SMALL)[rows], alone.flash(SMALL))
