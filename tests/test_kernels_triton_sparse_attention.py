"""DeepSeek-V4's Triton attention ops (kernels/triton/sparse_attention.py) against torch oracles
written here from V4SPEC.md, and their batch invariance. Runs on CUDA when there is one, else
small shapes in Triton's interpreter; skipped without triton."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)

from deepserve.kernels.reference.sparse_attention import compress_pool as reference_compress_pool
from deepserve.kernels.triton import sparse_attention as sa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _patch_interpreter_bf16_dot() -> None:
    """The interpreter keeps bfloat16 as its uint16 bits and its tl.dot multiplies those bits:
    widen bfloat16 operands to float32 first (exact, as a tensor core's products are)."""
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(h):
        if h.dtype.scalar.name != "bf16":
            return h
        bits = h.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), interpreter.tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE, dtype)


# ---- sparse_attention ----------------------------------------------------------------------


def attention_oracle(q, window_kv, window_slots, entry_kv, entry_slots, sinks, scale):
    """Per token: gather its keys (window list, then entry list, -1 skipped), softmax over the
    float32 scores and the head's sink logit, drop the sink's column, weight the keys."""
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        keys = [window_kv[window_slots[t][window_slots[t] >= 0]]]
        if entry_slots is not None:
            keys.append(entry_kv[entry_slots[t][entry_slots[t] >= 0]])
        kv = torch.cat(keys).float()
        scores = q[t].float() @ kv.T * scale  # [H, L]
        logits = torch.cat([scores, sinks.float()[:, None]], dim=1)
        out[t] = (torch.softmax(logits, dim=1)[:, :-1] @ kv).to(q.dtype)
    return out


def _slots(tokens: int, width: int, rows: int, seed: int, holes: float = 0.3) -> torch.Tensor:
    """Random row ids with -1 holes, and the last row of slots all -1 (a token without keys)."""
    g = _gen(seed)
    slots = torch.randint(0, rows, (tokens, width), generator=g)
    slots[torch.rand(tokens, width, generator=g) < holes] = -1
    return slots.to(DEVICE)


def _attention_case(tokens=4, heads=20, dim=48, window=130, entries=300, dtype=torch.float32):
    """q and strided views of a wider flattened cache (the window and entry columns of wider
    rows), as the model passes them; `dim` 48 and 20 heads exercise the padded tiles."""
    cache = _rand(500, 2 * dim + 24, seed=1, dtype=dtype)
    window_kv, entry_kv = cache[:, 8 : 8 + dim], cache[:, dim + 16 : 2 * dim + 16]
    q = _rand(tokens, heads, dim, seed=2, dtype=dtype)
    sinks = _rand(heads, seed=3)
    return q, window_kv, _slots(tokens, window, 500, 4), entry_kv, _slots(tokens, entries, 500, 5), sinks  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_program_per_split", [True, False])
def test_sparse_attention_matches_the_oracle(dtype, one_program_per_split):
    case = _attention_case(dtype=dtype)
    case[2][-1] = -1
    case[4][-1] = -1  # the last token sees no key: zeros
    got = sa.sparse_attention(*case, 0.2, split_programs_max=10**6 if one_program_per_split else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, attention_oracle(*case, 0.2), rtol=tol, atol=tol)
    assert got.dtype == dtype and torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_sparse_attention_of_any_split_size_matches_the_oracle():
    case = _attention_case(tokens=2, window=40, entries=50)
    for split in (16, 48):
        got = sa.sparse_attention(*case, 0.2, split=split)
        torch.testing.assert_close(got, attention_oracle(*case, 0.2), rtol=1e-5, atol=1e-5)


def test_sparse_attention_without_entries_is_window_attention():
    q, window_kv, window_slots, _, _, sinks = _attention_case(tokens=3, window=20)
    got = sa.sparse_attention(q, window_kv, window_slots, None, None, sinks, 0.2)
    want = attention_oracle(q, window_kv, window_slots, None, None, sinks, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_reads_slot_lists_of_any_strides():
    q, window_kv, window_slots, entry_kv, entry_slots, sinks = _attention_case(tokens=3, window=20)
    want = sa.sparse_attention(q, window_kv, window_slots, entry_kv, entry_slots, sinks, 0.2)
    column_major = window_slots.T.contiguous().T, entry_slots.T.contiguous().T
    got = sa.sparse_attention(q, window_kv, column_major[0], entry_kv, column_major[1], sinks, 0.2)
    assert torch.equal(got, want)


def test_sparse_attention_without_any_key_slot_gives_zeros():
    q, window_kv, window_slots, *_, sinks = _attention_case(tokens=2)
    got = sa.sparse_attention(q, window_kv, window_slots[:, :0], None, None, sinks, 0.2)
    assert torch.equal(got, torch.zeros_like(q))


def test_sparse_attention_takes_d512_heads_64_bf16():
    case = _attention_case(tokens=1, heads=64, dim=512, window=16, entries=40, dtype=torch.bfloat16)
    got = sa.sparse_attention(*case, 512**-0.5)
    torch.testing.assert_close(got, attention_oracle(*case, 512**-0.5), rtol=2e-2, atol=2e-2)


def test_sparse_attention_row_bits_do_not_depend_on_the_batch_path_or_padding():
    q, window_kv, window_slots, entry_kv, entry_slots, sinks = _attention_case()
    full = sa.sparse_attention(q, window_kv, window_slots, entry_kv, entry_slots, sinks, 0.2)
    args = (q, window_kv, window_slots, entry_kv, entry_slots, sinks, 0.2)
    assert torch.equal(sa.sparse_attention(*args, split_programs_max=0), full)
    wider = torch.cat([entry_slots, torch.full_like(entry_slots, -1)], dim=1)  # a longer batch
    for t in range(q.shape[0]):
        rows = slice(t, t + 1)
        alone = sa.sparse_attention(
            q[rows], window_kv, window_slots[rows], entry_kv, wider[rows], sinks, 0.2
        )
        assert torch.equal(alone, full[rows]), t


# ---- indexer_topk --------------------------------------------------------------------------


def indexer_scores_oracle(q, weights, keys, entry_slots, token_seq, visible, scale):
    """score[t, j] = sum_h weights[t, h] * relu(q[t, h] . keys[slot]) * scale for j < visible[t]
    (slot = entry_slots[token_seq[t], j]), -inf elsewhere; float32."""
    tokens, entries = q.shape[0], entry_slots.shape[1]
    scores = torch.full((tokens, entries), float("-inf"), device=q.device)
    for t in range(tokens):
        n = int(visible[t])
        rows = keys[entry_slots[token_seq[t], :n]].float()
        dots = torch.relu(q[t].float() @ rows.T) * scale  # [Hi, n]
        scores[t, :n] = (dots * weights[t].float()[:, None]).sum(0)
    return scores


def topk_oracle(scores, visible, k):
    """The k best visible entries (a stable descending sort: ties to the lower index), then
    ascending, -1 padded at the end."""
    k = min(k, scores.shape[1])
    out = torch.full((scores.shape[0], k), -1, dtype=torch.long, device=scores.device)
    for t in range(scores.shape[0]):
        n = min(k, int(visible[t]))
        order = torch.sort(scores[t], descending=True, stable=True).indices[:n]
        out[t, :n] = order.sort().values
    return out


def _indexer_case(dtype=torch.float32):
    """Five tokens of two sequences over 150 entries (three blocks, the last one partial) of
    keys in a strided column of wider rows; entries past a sequence's count hold slots no key
    has (the kernel must not read them)."""
    heads, dim, entries = 4, 32, 150
    rows = _rand(400, 3 * dim, seed=11, dtype=dtype)
    keys = rows[:, dim : 2 * dim]
    q = _rand(5, heads, dim, seed=12, dtype=dtype)
    weights = _rand(5, heads, seed=13)
    entry_slots = torch.randint(0, 400, (2, entries), generator=_gen(14)).to(DEVICE)
    entry_slots[0, 100:] = 10**9  # sequence 0 has 100 entries
    token_seq = torch.tensor([0, 0, 1, 1, 0], device=DEVICE)
    visible = torch.tensor([0, 1, 37, 150, 100], device=DEVICE)
    return q, weights, keys, entry_slots, token_seq, visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_match_the_oracle_and_mask_what_a_token_cannot_see(dtype):
    case = _indexer_case(dtype)
    got = sa.indexer_scores(*case, 0.3)
    want = indexer_scores_oracle(*case, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("k", [8, 150, 400])
def test_indexer_topk_matches_the_oracle(k):
    case = _indexer_case()
    got = sa.indexer_topk(*case, k, 0.3)
    want = topk_oracle(indexer_scores_oracle(*case, 0.3), case[-1], k)
    assert got.shape == (5, min(k, 150)) and torch.equal(got, want)


def test_topk_breaks_ties_to_the_lower_index_and_pads_at_the_end():
    scores = torch.randint(0, 3, (6, 70), generator=_gen(15)).float().to(DEVICE)
    scores[0, :5] = -0.0  # -0.0 and 0.0 are one score
    scores[1] = float("-inf")
    visible = torch.tensor([70, 70, 3, 0, 69, 20], device=DEVICE)
    scores[visible[:, None] <= torch.arange(70, device=DEVICE)] = float("-inf")
    got = sa.topk_ascending(scores, visible, 10)
    assert torch.equal(got, topk_oracle(scores, visible, 10))
    assert torch.equal(got[2], torch.tensor([0, 1, 2] + [-1] * 7, device=DEVICE))


def test_indexer_topk_picks_the_lower_of_equal_entries():
    q, weights, keys, entry_slots, token_seq, visible = _indexer_case()
    entry_slots[1] = entry_slots[1, :10].repeat(15)  # every key ten times over: exact ties
    got = sa.indexer_topk(q, weights, keys, entry_slots, token_seq, visible, 4, 0.3)
    scores = sa.indexer_scores(q, weights, keys, entry_slots, token_seq, visible, 0.3)
    best = int(scores[3, :10].argmax())  # the best key's first copy, then its next three
    assert torch.equal(got[3], best + torch.arange(0, 40, 10, device=DEVICE))


def test_indexer_scores_of_a_token_do_not_depend_on_the_batch():
    case = _indexer_case()
    full = sa.indexer_scores(*case, 0.3)
    q, weights, keys, entry_slots, token_seq, visible = case
    for t in range(5):
        r = slice(t, t + 1)
        alone = sa.indexer_scores(
            q[r], weights[r], keys, entry_slots, token_seq[r], visible[r], 0.3
        )
        assert torch.equal(alone, full[r]), t


# ---- compress_pool -------------------------------------------------------------------------


# the oracle is the torch reference op itself: DeepseekV4ForCausalLM's pooling before the norm
pool_oracle = reference_compress_pool


def _pool_case(series: int, ratio: int, dim=40, groups=5, dtype=torch.float32):
    """Groups of shuffled rows of a cache whose kv and gate columns sit inside wider
    rows; group 0 has no previous group."""
    width = series * dim
    rows = _rand(2 * groups * ratio + 50, 2 * width + 12, seed=21, dtype=dtype)
    perm = torch.randperm(rows.shape[0], generator=_gen(22))[: 2 * groups * ratio].to(DEVICE)
    tokens, previous = perm[: groups * ratio].view(groups, ratio), perm[groups * ratio :].view(groups, ratio)  # fmt: skip
    has_previous = torch.arange(groups, device=DEVICE) > 0
    ape = _rand(ratio, width, seed=23)
    kv_cols, gate_cols = slice(5, 5 + width), slice(width + 9, 2 * width + 9)
    return rows, tokens, previous, has_previous, ape, kv_cols, gate_cols, dim, series


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("series,ratio", [(1, 8), (1, 128), (2, 4), (2, 3)])
def test_compress_pool_matches_the_models_pooling(series, ratio, dtype):
    case = _pool_case(series, ratio, dtype=dtype)
    got = sa.compress_pool(*case)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, pool_oracle(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("series,ratio", [(1, 8), (2, 4)])
def test_compress_pool_of_a_group_does_not_depend_on_the_batch(series, ratio):
    rows, tokens, previous, has_previous, ape, *cols = _pool_case(series, ratio)
    full = sa.compress_pool(rows, tokens, previous, has_previous, ape, *cols)
    for g in range(tokens.shape[0]):
        r = slice(g, g + 1)
        alone = sa.compress_pool(rows, tokens[r], previous[r], has_previous[r], ape, *cols)
        assert torch.equal(alone, full[r]), g


# ---- registration --------------------------------------------------------------------------


def test_kernel_sets_take_the_batched_ops_only_where_the_set_has_their_fields():
    from dataclasses import dataclass

    from deepserve.kernels.triton import kernelset

    @dataclass(frozen=True)
    class PerSequenceSet:  # today's contract: indexer_topk of the per-sequence signature
        indexer_topk: object = None

    @dataclass(frozen=True)
    class BatchedSet:  # V4SPEC.md's
        sparse_attention: object = None
        indexer_topk: object = None
        compress_pool: object = None

    assert kernelset._with_v4_ops(PerSequenceSet()) == PerSequenceSet()
    batched = kernelset._with_v4_ops(BatchedSet())
    assert batched == BatchedSet(sa.sparse_attention, sa.indexer_topk, sa.compress_pool)
