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


def test_sparse_attention_without_entries_is_window_attention():
    q, window_kv, window_slots, _, _, sinks = _attention_case(tokens=3, window=20)
    got = sa.sparse_attention(q, window_kv, window_slots, None, None, sinks, 0.2)
    want = attention_oracle(q, window_kv, window_slots, None, None, sinks, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


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
    assert kernelset._with_v4_ops(BatchedSet()).sparse_attention is sa.sparse_attention
