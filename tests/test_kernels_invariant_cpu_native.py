"""The `--batch-invariant` CPU set over the native kernels (kernels/cpu/kernelset.py): each op's
rows bitwise independent of the batch around them (row count, position, neighbours, prefill vs
chunks vs decode), the same bits whatever the layout of the input, and the same function as the
torch invariant ops it replaces (kernels/reference/invariant.py, the oracle), within float32
tolerance. Every test runs on each ISA path this CPU has (AVX2, AVX-512, AVX512-BF16: see
kernels/cpu/csrc/isa.h), each path forced in turn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_kv import PagedCase

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu.packed import PackedWeight, pack_linear_weight, vendor_gemm_faster
from deepserve.kernels.reference.invariant import invariant_kernels
from deepserve.kernels.registry import get_kernels, invariant_cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")

ORACLE = invariant_kernels()


ISAS = cpu_native.supported_isas() if cpu_native.load() else []
DTYPES = [torch.float32, torch.bfloat16]  # the native elementwise ops' row dtypes


@pytest.fixture(scope="module", params=ISAS)
def ops(request):
    with cpu_native.use_isa(request.param):
        yield invariant_cpu_kernels()


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rows_alone_equal_batched(fn, x: torch.Tensor, counts=(1, 2, 3, 5, 7, 16, 33)) -> None:
    alone = [fn(x[i : i + 1])[0] for i in range(len(x))]
    for m in counts:
        for off in (0, 3):
            got = fn(x[off : off + m])
            for i in range(len(got)):
                assert torch.equal(got[i], alone[off + i]), (m, off, i)


def test_the_flag_on_this_cpu_runs_the_native_set():
    assert get_kernels("cpu", True).name == "batch_invariant_cpu_native"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_rows_do_not_depend_on_the_batch(ops, dtype):
    w = pack_linear_weight(_rand(200, 576, seed=1, dtype=dtype))
    assert isinstance(w, PackedWeight)
    _rows_alone_equal_batched(lambda x: ops.linear(x, w), _rand(40, 576, seed=2, dtype=dtype))


def test_packed_linear_matches_the_oracle(ops):
    w, x = _rand(200, 576, seed=3), _rand(21, 576, seed=4)
    got = ops.linear(x, pack_linear_weight(w))
    torch.testing.assert_close(got, ORACLE.linear(x, w), rtol=1e-5, atol=1e-4)


def test_unpacked_weight_takes_the_torch_invariant_linear(ops):
    w, x = _rand(64, 96, seed=5), _rand(9, 96, seed=6)
    assert torch.equal(ops.linear(x, w), ORACLE.linear(x, w))


def test_native_calls_are_not_recorded_as_torch_calls():
    ops = invariant_cpu_kernels()
    x = _rand(9, 96, seed=7)
    ops.linear(x, pack_linear_weight(_rand(64, 96, seed=8)))
    ops.rms_norm(x, _rand(96, seed=9), 1e-6)
    assert ops.torch_calls.ops == []


def test_an_unpacked_linear_is_recorded_as_a_torch_call():
    ops = invariant_cpu_kernels()
    ops.linear(_rand(9, 96, seed=5), _rand(64, 96, seed=6))
    assert ops.torch_calls.ops == ["linear"]


def test_ops_taken_as_they_are_from_the_torch_set_are_recorded():
    ops = invariant_cpu_kernels()
    got = ops.softmax(_rand(3, 40, seed=10), -1)
    assert torch.equal(got, ORACLE.softmax(_rand(3, 40, seed=10), -1))
    assert ops.torch_calls.ops == ["softmax"]


def test_a_fused_op_that_declines_is_recorded_as_a_torch_call():
    ops = invariant_cpu_kernels()
    assert ops.silu_mul(_rand(4, 64, seed=11), limit=7.0) is None
    assert ops.torch_calls.ops == ["silu_mul"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(ops, dtype):
    w, x = _rand(576, seed=7, dtype=dtype), _rand(40, 576, seed=8, dtype=dtype) * 3
    _rows_alone_equal_batched(lambda x: ops.rms_norm(x, w, 1e-5), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_column_slice_has_the_bits_of_its_copy(ops, dtype):
    # a one-row slice counts as contiguous and a many-row one does not: both must take one path
    wide, w = _rand(12, 640, seed=9, dtype=dtype), _rand(512, seed=10, dtype=dtype)
    sliced = ops.rms_norm(wide[:, :512], w, 1e-6)
    assert torch.equal(sliced, ops.rms_norm(wide[:, :512].contiguous(), w, 1e-6))
    assert torch.equal(ops.rms_norm(wide[:1, :512], w, 1e-6)[0], sliced[0])


def test_rms_norm_matches_the_oracle(ops):
    x, w = _rand(9, 576, seed=11) * 3, _rand(576, seed=12)
    got = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, ORACLE.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_has_the_bits_of_add_then_norm(ops, dtype):
    h, delta = _rand(7, 576, seed=13, dtype=dtype), _rand(7, 576, seed=14, dtype=dtype)
    w = _rand(576, seed=15, dtype=dtype)
    expect = ops.rms_norm(h + delta, w, 1e-5)
    fused = h.clone()
    assert torch.equal(ops.add_rms_norm_(fused, delta, w, 1e-5), expect)
    assert torch.equal(fused, h + delta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_do_not_depend_on_the_batch_or_layout(ops, dtype):
    gu = _rand(40, 2 * 1536, seed=16, dtype=dtype) * 4
    _rows_alone_equal_batched(ops.silu_mul, gu)
    wide = torch.cat([gu, gu[:, :8]], dim=1)[:, : 2 * 1536]  # same values, not contiguous
    assert torch.equal(ops.silu_mul(wide), ops.silu_mul(gu))


def test_silu_mul_matches_torch(ops):
    gu = _rand(5, 2 * 100, seed=17) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def _case(layout: str, dtype=torch.float32) -> PagedCase:
    return PagedCase(layout, [2 * 128 + 37, 5, 40, 128 + 1], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_across_prefill_chunking_and_decode(ops, layout, dtype):
    case = _case(layout, dtype)
    n = case.lengths[0]
    whole = case.run(ops, [(0, 0, n)])[0]
    for chunk in [7, 16, 33, 200]:
        rows = [case.run(ops, [(0, c, min(chunk, n - c))])[0] for c in range(0, n, chunk)]
        assert torch.equal(torch.cat(rows), whole), chunk
    for pos in [0, 1, 15, 16, n - 1]:
        assert torch.equal(case.run(ops, [(0, pos, 1)])[0][0], whole[pos]), pos


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_rows_equal_inside_mixed_batches(ops, layout):
    case = _case(layout)
    alone = [case.run(ops, [(i, n - 1, 1)])[0] for i, n in enumerate(case.lengths)]
    decodes = [(i, n - 1, 1) for i, n in enumerate(case.lengths)]
    for batch in [decodes, decodes[::-1], decodes[1:], [(0, 100, 50), *decodes[1:]]]:
        for (i, _, m), o in zip(batch, case.run(ops, batch), strict=True):
            if m == 1:
                assert torch.equal(o[0], alone[i][0]), (batch, i)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_attention_matches_the_oracle(ops, layout):
    case = _case(layout)
    for seqs in [[(0, 0, case.lengths[0])], [(0, 60, 90), (1, 4, 1), (2, 39, 1)]]:
        got = torch.cat(case.run(ops, seqs))
        torch.testing.assert_close(got, torch.cat(case.run(ORACLE, seqs)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not vendor_gemm_faster(), reason="no AMX: the flag's bf16 linears stay native")
def test_the_flags_bf16_linear_runs_onednn_in_calls_of_at_most_32_rows_row_invariantly():
    """oneDNN picks its blocking by row count, but every call of 1 to 32 rows gives a row its
    one-row bits: under the flag every bf16 call goes through it in such calls."""
    k = invariant_cpu_kernels()
    w = k.pack_weight(_rand(192, 576, seed=3, dtype=torch.bfloat16))
    assert w.onednn is not None and w.onednn_chunk == 32
    x = _rand(100, 576, seed=4, dtype=torch.bfloat16)
    alone = torch.cat([k.linear(x[i : i + 1], w) for i in range(len(x))])
    for m in (2, 7, 32, 33, 64, 100):
        assert torch.equal(k.linear(x[100 - m :], w), alone[100 - m :]), m
    assert k.torch_calls.ops == []  # probed on one thread and on all: the count follows the load


def test_a_weight_whose_small_onednn_calls_are_not_row_invariant_stays_native(monkeypatch):
    from deepserve.kernels.cpu import packed

    monkeypatch.setattr(packed, "onednn_rows_invariant", lambda *a: False)
    w = _rand(64, 32, seed=3, dtype=torch.bfloat16)
    assert pack_linear_weight(w, onednn=True, onednn_chunk=32).onednn is None
    assert pack_linear_weight(w, onednn=True).onednn is not None  # the default set's copy
