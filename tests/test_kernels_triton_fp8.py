"""The block-scaled FP8 GEMM (kernels/triton/fp8_matmul.py), the default set's few-row
weight-streaming kernel (kernels/triton/fp8_gemv.py, x unquantized), the fused MoE with FP8 and MXFP4
experts (kernels/triton/fused_moe.py) and the weight types they take (kernels/block_quant.py):
activation codes exactly torch's, products close to the dequantized float32 ones, rows batch
invariant under a fixed tile, the set's `linear` dispatching on the weight. "Close" is against
the float32 product of both dequantized operands (x's own e4m3 codes too); against unquantized x
the bound is e4m3's rounding. Runs on CUDA when there is one, else at small shapes in Triton's
interpreter (fp8 dots included: the harness widens the codes exactly); skipped without triton.
The production shapes and the timing are the GPU job's (benchmarks/gpu/kernel_checks.py
`run_fp8`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import
pytest.importorskip("triton")

import test_kernels_invariant_triton  # noqa: E402,F401  (patches the interpreter when used)


def _patch_fp8() -> None:
    """More fixes to Triton's CPU interpreter, for this harness only: it rounds float32 -> fp8
    half-up and drops the carry into the exponent (7.95 becomes 4.0), and truncates float32 ->
    bf16, where the GPU's cvt rounds both to nearest even, so torch casts here; and the
    row-by-row dot patched in by
    test_kernels_invariant_triton multiplies the raw bits of fp8 and bf16 operands, so they are
    widened first (exactly: every e4m3 and bf16 value is a float32)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp
    truncating = interpreter.InterpreterBuilder.create_fp_trunc
    row_dot = interpreter.InterpreterBuilder.create_dot

    def widened(h):
        if h.dtype.scalar == tl.bfloat16:  # stored as the uint16 top half of a float32
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        if h.dtype.scalar != tl.float8e4nv:
            return h
        codes = torch.from_numpy(np.ascontiguousarray(h.data)).view(torch.float8_e4m3fn)
        return interpreter.TensorHandle(codes.float().numpy(), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return row_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type, rounding_mode)
        codes = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(codes.view(torch.uint8).numpy(), dst_type.scalar)

    def fp_trunc(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return truncating(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.uint16).numpy(), tl.bfloat16)

    interpreter.InterpreterBuilder.create_fp_to_fp = fp_to_fp
    interpreter.InterpreterBuilder.create_fp_trunc = fp_trunc
    interpreter.InterpreterBuilder.create_dot = dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_fp8()

from deepserve.kernels import block_quant  # noqa: E402
from deepserve.kernels.registry import triton_kernels  # noqa: E402
from deepserve.kernels.triton import fp8_gemv, fp8_matmul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def test_quantize_groups_gives_torchs_codes_and_one_scale_per_128_columns():
    x = _rand(5, 300, seed=1) * torch.linspace(0.01, 30, 300, device=DEVICE)  # K=300: a cut group
    x[2, 128:256] = 0.0  # an all-zero group: codes 0, scale the floor's
    q, s = fp8_matmul.quantize_groups(x)
    want_q, want_s = fp8_matmul.quantize_groups_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert float(q.float().abs().max()) == fp8_matmul.FP8_MAX  # each group's amax maps to 448


def test_quantize_fp8_round_trips_within_e4m3_precision():
    w = _rand(200, 260, seed=2)  # edge blocks cut on both dims
    fw = block_quant.quantize_fp8(w)
    assert fw.data.shape == (200, 260) and fw.scale.shape == (2, 3)
    assert _rel(fw.dequantize(), w) < 0.04  # e4m3: 3 mantissa bits, relative step 1/16


def _dequantized_product(x: torch.Tensor, w: block_quant.Fp8Weight) -> torch.Tensor:
    """The float32 product of the two dequantized operands: x's per-group codes times their
    scales, against w's blocks times theirs."""
    q, s = fp8_matmul.quantize_groups_reference(x)
    k = x.shape[1]
    xq = (q.float() * s.repeat_interleave(fp8_matmul.GROUP, dim=1)[:, :k]).view(x.shape)
    return xq @ w.dequantize().T


@pytest.mark.parametrize("m", [1, 3, 40])
def test_fp8_linear_is_close_to_the_dequantized_float32_product(m):
    n, k = 200, 384
    w = block_quant.quantize_fp8(_rand(n, k, seed=3) / k**0.5)
    x = _rand(m, k, seed=4, dtype=torch.bfloat16)
    got = fp8_matmul.fp8_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel(got, _dequantized_product(x.float(), w)) < 2e-2


def test_fp8_linear_applies_the_scales_per_k_block_in_float32():
    """In float32 out, the kernel's sum is the dequantized operands' product up to float32
    summation order: each K block's dot scaled by its own activation and weight scales."""
    n, k = 64, 256
    w = block_quant.quantize_fp8(_rand(n, k, seed=5))
    x = _rand(4, k, seed=6) * torch.tensor([[1.0], [10.0], [0.1], [3.0]], device=DEVICE)
    torch.testing.assert_close(
        fp8_matmul.fp8_linear(x, w), _dequantized_product(x, w), rtol=1e-5, atol=1e-4
    )


def test_fp8_linear_error_against_unquantized_activations_is_e4m3s_rounding():
    """Quantizing x to e4m3 (3 mantissa bits: about 3% rms on Gaussian rows) is the scheme's
    only loss beyond the weights' own: within 4e-2 of x @ dequant(w).T."""
    w = block_quant.quantize_fp8(_rand(96, 512, seed=17) / 512**0.5)
    x = _rand(8, 512, seed=18)
    assert _rel(fp8_matmul.fp8_linear(x, w), x @ w.dequantize().T) < 4e-2


def test_fp8_linear_handles_k_not_a_multiple_of_the_group():
    w = block_quant.quantize_fp8(_rand(48, 200, seed=7) / 15)
    x = _rand(2, 200, seed=8)
    assert _rel(fp8_matmul.fp8_linear(x, w), _dequantized_product(x, w)) < 1e-5


def test_fp8_linear_rows_equal_for_any_row_count_under_a_fixed_tile():
    w = block_quant.quantize_fp8(_rand(80, 256, seed=9))
    x = _rand(37, 256, seed=10, dtype=torch.bfloat16)
    cfg = fp8_matmul.DECODE
    full = fp8_matmul.fp8_linear(x, w, cfg)
    for m in (1, 5, 17):
        assert torch.equal(fp8_matmul.fp8_linear(x[:m], w, cfg), full[:m]), m
    assert torch.equal(fp8_matmul.fp8_linear(x[20:21], w, cfg)[0], full[20])


@pytest.mark.parametrize("k", [256, 200])
def test_the_gemm_quantizing_x_itself_gives_the_bits_of_the_separate_quantize_kernel(k):
    w = block_quant.quantize_fp8(_rand(48, k, seed=19) / 15)
    x = _rand(5, k, seed=20, dtype=torch.bfloat16) * 3
    x[1, :128] = 0.0  # an all-zero group
    inline = fp8_matmul.fp8_linear(x, w, fp8_matmul.DECODE, inline_quant=True)
    separate = fp8_matmul.fp8_linear(x, w, fp8_matmul.DECODE, inline_quant=False)
    assert torch.equal(inline, separate)


@pytest.mark.parametrize("cfg", ["SPLIT", "SPLIT_NARROW"])
@pytest.mark.parametrize("k", [1024, 1000])
def test_split_k_runs_added_in_order_are_the_dequantized_product(k, cfg):
    """The split tiles' K runs (8 here, the last one cut at K = 1,000) summed by the tile's last
    program: the float32 product of the dequantized operands up to summation order."""
    cfg = getattr(fp8_matmul, cfg)
    w = block_quant.quantize_fp8(_rand(200, k, seed=60))
    x = _rand(40, k, seed=61)
    tiles = -(-40 // cfg.block_m) * -(-200 // cfg.block_n)
    assert fp8_gemv.split_runs(tiles, 8, cfg.waves) == 8
    got = fp8_matmul.fp8_linear(x, w, cfg)
    torch.testing.assert_close(got, _dequantized_product(x, w), rtol=1e-5, atol=1e-4)
    assert _counters_at_rest()


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's program order is what is shuffled")
@pytest.mark.parametrize("seed", [0, 1])
def test_whichever_split_k_program_counts_last_the_gemm_gives_the_same_bits(seed):
    w = block_quant.quantize_fp8(_rand(200, 1000, seed=62) / 32)
    x = _rand(24, 1000, seed=63, dtype=torch.bfloat16)
    want = fp8_matmul.fp8_linear(x, w, fp8_matmul.SPLIT)
    with _programs_shuffled(seed):
        got = fp8_matmul.fp8_linear(x, w, fp8_matmul.SPLIT)
    assert torch.equal(got, want)
    assert _counters_at_rest()


def test_batch_sized_calls_split_k_where_whole_k_tiles_leave_sms_idle():
    """At 64 rows: V4's q_a [1,024 x 4,096] takes the narrow split tile, its wo_b [4,096 x 8,192]
    the wide one; its wq_b [32,768 x 1,024] fills the GPU with MEDIUM's tiles; a short K (V2-Lite's
    o_proj) runs whole on 16-row tiles; one row stays on the decode tile, never split."""
    f = fp8_matmul
    assert f.default_config(64, 1024, 4096) is f.SPLIT_NARROW
    assert f.default_config(64, 4096, 8192) is f.SPLIT
    assert f.default_config(128, 4096, 2048) is f.SPLIT
    assert f.default_config(64, 32768, 1024) is f.MEDIUM
    assert f.default_config(64, 2048, 2048) == f.decode_config(2048, 64)
    assert f.default_config(1, 1024, 4096).waves == 0
    assert f.decode_config(1024).waves == 0  # --batch-invariant's tile


def test_the_invariant_tiles_stay_on_mma_rows_and_never_split_k():
    """--batch-invariant: a row's K steps stay one chain in K order at every row count, on 16-
    and 32-row tiles, whose e4m3 mma sums as the decode tile's (wgmma, from 64 rows, does not)."""
    f = fp8_matmul
    for n in (1024, 4096, 2048, 32768):
        tiles = {f.invariant_config(m, n) for m in (1, 16, 17, 64, 65, 128, 4096)}
        assert all(cfg.waves == 0 and cfg.block_m in (16, 32) for cfg in tiles), n
        assert f.invariant_config(4096, n) == f.INVARIANT_PREFILL


def test_the_decode_tile_narrows_until_a_weights_n_tiles_fill_the_gpu():
    """No split-K: at M = 1 the N tiles are the launch's only parallelism."""
    narrowest = fp8_matmul.MIN_DECODE_BLOCK_N
    widths = {n: fp8_matmul.decode_config(n).block_n for n in (576, 2048, 7168, 24576)}
    assert widths[24576] == 64 and widths[7168] == 32 and widths[576] == narrowest
    for n, block_n in widths.items():
        assert -(-n // block_n) >= fp8_matmul.FILL_PROGRAMS or block_n == narrowest


def test_ue8m0_scales_are_read_as_the_same_float32_powers_of_two():
    """DeepSeek-V4's block scales are exponent bytes; loaded they are float32 2^e: same kernel."""
    base = block_quant.quantize_fp8(_rand(64, 128, seed=11))
    pow2 = torch.exp2(torch.ceil(torch.log2(base.scale)))
    w = block_quant.Fp8Weight(base.data, pow2, base.block)
    x = _rand(2, 128, seed=12)
    assert _rel(fp8_matmul.fp8_linear(x, w), _dequantized_product(x, w)) < 1e-5


def test_the_invariant_set_runs_fp8_weights_and_plain_ones_alike():
    k = triton_kernels()
    assert k.fp8_weights
    w = block_quant.quantize_fp8(_rand(64, 128, seed=13))
    x = _rand(3, 128, seed=14)
    want = fp8_matmul.fp8_linear(x, w, fp8_matmul.decode_config(64))
    assert torch.equal(k.linear(x, w), want)
    plain = w.dequantize()
    torch.testing.assert_close(k.linear(x, plain), x @ plain.T, rtol=1e-5, atol=1e-5)


def test_a_weight_the_kernel_does_not_read_goes_through_its_dequantization():
    """A 64-input scale block is not the kernel's 128-step: the set's linear dequantizes it."""
    w = block_quant.quantize_fp8(_rand(32, 128, seed=15), block=(64, 64))
    assert not fp8_matmul.supports(w)
    x = _rand(2, 128, seed=16)
    linear = fp8_matmul.linear_or(torch.nn.functional.linear)
    torch.testing.assert_close(linear(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


# ---- the default set's few-row path: fp8_gemv (w8a16, split-K) ------------------------------


@pytest.mark.parametrize("m", [1, 3, 20])
def test_gemv_is_the_dequantized_float32_product_with_x_unquantized(m):
    """x is not quantized: in float32 the kernel's sum is x @ dequant(w).T up to summation order."""
    n, k = 200, 384  # N not a multiple of the row block: its edge rows repeat a real one
    w = block_quant.quantize_fp8(_rand(n, k, seed=30) / k**0.5)
    x = _rand(m, k, seed=31)
    torch.testing.assert_close(fp8_gemv.fp8_gemv(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_on_bf16_rows_loses_only_the_outputs_bf16_rounding(m):
    """e4m3 values are exact in bf16, so the products are; the error is the bf16 store's."""
    w = block_quant.quantize_fp8(_rand(96, 512, seed=32) / 512**0.5)
    x = _rand(m, 512, seed=33, dtype=torch.bfloat16)
    got = fp8_gemv.fp8_gemv(x, w)
    assert got.dtype == torch.bfloat16
    assert _rel(got, x.float() @ w.dequantize().T) < 4e-3  # bf16: relative step 2^-8


def test_gemv_handles_k_not_a_multiple_of_the_group():
    w = block_quant.quantize_fp8(_rand(48, 200, seed=34) / 15)
    x = _rand(2, 200, seed=35)
    assert fp8_gemv.split_k(48, 200) == 2  # a cut last step in the second split
    torch.testing.assert_close(fp8_gemv.fp8_gemv(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


def test_split_k_is_fixed_by_the_shape_and_reaches_the_waves_where_k_allows():
    """A narrow weight's row blocks cannot fill the GPU: K is cut into runs of whole 128-steps
    until they do, never into more runs than steps; a wide weight is not split."""
    cfg = fp8_gemv.GEMV
    for n, k in ((576, 2048), (2048, 2048), (3072, 2048), (2048, 10944), (36864, 7168)):
        split, tiles, steps = fp8_gemv.split_k(n, k), -(-n // cfg.block_n), -(-k // 128)
        per_run = fp8_gemv.steps_per_split(k, split)
        assert split * per_run >= steps > (split - 1) * per_run, (n, k)  # no empty run
        assert tiles * split >= cfg.waves * fp8_gemv.FILL_PROGRAMS or split == steps, (n, k)
    assert fp8_gemv.split_k(36864, 7168) == 1


TWO_LAUNCH = replace(fp8_gemv.GEMV, one_launch=False)  # partials summed by a second kernel
# (M, N, K): split K with N a multiple of the row block or not, K a multiple of 128 or not
ONE_LAUNCH_SHAPES = [(1, 576, 2048), (2, 200, 1000), (5, 130, 384), (16, 64, 200), (1, 48, 640)]


def _counters_at_rest() -> bool:
    return all(int(c.abs().sum()) == 0 for c in fp8_gemv._COUNTERS.values())


@pytest.mark.parametrize("m,n,k", ONE_LAUNCH_SHAPES)
def test_one_launch_split_sum_is_the_two_launch_sum_bit_for_bit(m, n, k):
    """The last program of a row block adds the partials in split order: the second kernel's
    bits, and the float32 product up to bf16 rounding."""
    assert fp8_gemv.split_k(n, k) > 1
    w = block_quant.quantize_fp8(_rand(n, k, seed=40) / k**0.5)
    x = _rand(m, k, seed=41, dtype=torch.bfloat16)
    got = fp8_gemv.fp8_gemv(x, w)
    assert torch.equal(got, fp8_gemv.fp8_gemv(x, w, TWO_LAUNCH))
    assert _rel(got, x.float() @ w.dequantize().T) < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", ONE_LAUNCH_SHAPES)
def test_plain_weights_stream_through_the_same_one_launch_split_sum(m, n, k, dtype):
    w = (_rand(n, k, seed=42) / k**0.5).to(dtype)
    x = _rand(m, k, seed=43, dtype=dtype)
    got = fp8_gemv.gemv(x, w)
    assert got.dtype == dtype
    assert torch.equal(got, fp8_gemv.gemv(x, w, TWO_LAUNCH))
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
    assert _rel(got, x.float() @ w.float().T) < tol


@pytest.mark.parametrize("n,k", [(200, 1000), (576, 2048), (64, 200)])
def test_one_row_with_x_read_in_the_weights_layout_is_the_same_product(n, k):
    """GemvConfig.x_tile changes where x's values come from (L1, not shared memory), not the
    arithmetic: close to the float32 product, and one launch equals two."""
    tile = replace(fp8_gemv.GEMV, x_tile=True)
    w8 = block_quant.quantize_fp8(_rand(n, k, seed=53) / k**0.5)
    w = (_rand(n, k, seed=54) / k**0.5).to(torch.bfloat16)
    x = _rand(1, k, seed=55, dtype=torch.bfloat16)
    got8, got = fp8_gemv.fp8_gemv(x, w8, tile), fp8_gemv.gemv(x, w, tile)
    assert torch.equal(got8, fp8_gemv.fp8_gemv(x, w8, replace(tile, one_launch=False)))
    assert torch.equal(got, fp8_gemv.gemv(x, w, replace(tile, one_launch=False)))
    assert _rel(got8, x.float() @ w8.dequantize().T) < 4e-3
    assert _rel(got, x.float() @ w.float().T) < 4e-3


@contextlib.contextmanager
def _programs_shuffled(seed: int):
    """The interpreter runs a grid's programs one after another, row block by row block and
    splits in order, so the last to count is always the last split; here they run in a seeded
    random order instead, so any split of a row block may be the one that adds the partials."""
    from triton.runtime import interpreter

    cls = interpreter.InterpreterBuilder
    original, orders = cls.set_grid_idx, {}

    def shuffled(self, x, y, z):
        gx, gy, gz = self.grid_dim
        total = gx * gy * gz
        if total not in orders:
            orders[total] = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        flat = int(orders[total][(x * gy + y) * gz + z])
        original(self, flat // (gy * gz), flat // gz % gy, flat % gz)

    cls.set_grid_idx = shuffled
    try:
        yield
    finally:
        cls.set_grid_idx = original


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's program order is what is shuffled")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whichever_program_counts_last_the_sum_is_the_same_bits(seed):
    m, n, k = 2, 200, 1000  # 4 row blocks of 8 splits
    w8 = block_quant.quantize_fp8(_rand(n, k, seed=50) / k**0.5)
    w = (_rand(n, k, seed=51) / k**0.5).to(torch.bfloat16)
    x = _rand(m, k, seed=52, dtype=torch.bfloat16)
    want8, want = fp8_gemv.fp8_gemv(x, w8, TWO_LAUNCH), fp8_gemv.gemv(x, w, TWO_LAUNCH)
    with _programs_shuffled(seed):
        got8, got = fp8_gemv.fp8_gemv(x, w8), fp8_gemv.gemv(x, w)
    assert torch.equal(got8, want8) and torch.equal(got, want)
    assert _counters_at_rest()


def test_repeated_calls_leave_the_counters_at_zero_and_reuse_them():
    """Every call's reducing program zeroes its row block's counter: the next call (another
    shape on the same buffer too) counts from zero and gives the same bits."""
    w = block_quant.quantize_fp8(_rand(200, 1000, seed=44) / 32)
    plain = _rand(130, 384, seed=45, dtype=torch.bfloat16) / 20
    x, xp = _rand(3, 1000, seed=46), _rand(2, 384, seed=47, dtype=torch.bfloat16)
    first, first_plain = fp8_gemv.fp8_gemv(x, w), fp8_gemv.gemv(xp, plain)
    buffers = {d: c.data_ptr() for d, c in fp8_gemv._COUNTERS.items()}
    for _ in range(3):
        assert _counters_at_rest()
        assert torch.equal(fp8_gemv.fp8_gemv(x, w), first)
        assert torch.equal(fp8_gemv.gemv(xp, plain), first_plain)
    assert {d: c.data_ptr() for d, c in fp8_gemv._COUNTERS.items()} == buffers  # allocated once


def test_the_default_sets_plain_linear_streams_few_rows_of_large_weights_only(monkeypatch):
    # the rule's thresholds come from the GPU job; the interpreter checks the routing at smaller ones
    monkeypatch.setattr(fp8_gemv, "PLAIN_ROWS", 2)
    monkeypatch.setattr(fp8_gemv, "PLAIN_MIN_ELEMENTS", 1 << 20)
    w = (_rand(256, 4096, seed=48) / 64).to(torch.bfloat16)
    small = w[:8, :128].contiguous()
    x = _rand(fp8_gemv.PLAIN_ROWS + 1, 4096, seed=49, dtype=torch.bfloat16)
    linear = fp8_gemv.streaming_linear_or(torch.nn.functional.linear)
    assert fp8_gemv.plain_path(2, w) and not fp8_gemv.plain_path(len(x), w)
    assert torch.equal(linear(x[:2], w), fp8_gemv.gemv(x[:2], w))
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    assert not fp8_gemv.plain_path(1, small)
    assert torch.equal(linear(x[:1, :128], small), torch.nn.functional.linear(x[:1, :128], small))


def test_the_default_set_takes_the_gemv_for_few_rows_and_the_invariant_set_never():
    w = block_quant.quantize_fp8(_rand(64, 256, seed=36))
    x = _rand(fp8_matmul.GEMV_ROWS + 1, 256, seed=37, dtype=torch.bfloat16)
    fast = fp8_matmul.linear_or(torch.nn.functional.linear)
    few, many = x[:2], x
    assert fp8_matmul.path(2, w) == "gemv" and fp8_matmul.path(len(x), w) == "gemm"
    assert torch.equal(fast(few, w), fp8_gemv.fp8_gemv(few, w))
    assert torch.equal(fast(many, w), fp8_matmul.fp8_linear(many, w))
    assert fp8_matmul.path(1, w, batch_invariant=True) == "gemm"
    invariant = triton_kernels().linear
    assert torch.equal(
        invariant(few, w), fp8_matmul.fp8_linear(few, w, fp8_matmul.decode_config(64))
    )


# ---- the grouped projection (DeepSeek-V4's wo_a) ---------------------------------------------


def _grouped_case(m: int, groups: int = 2, rows: int = 128, k: int = 256):
    """A weight of `groups` groups of `rows` rows over k columns (each group quantized on its
    own blocks) and x [m, groups * k]."""
    parts = [block_quant.quantize_fp8(_rand(rows, k, seed=40 + g) / k**0.5) for g in range(groups)]
    w = block_quant.cat_rows(parts, torch.float32)
    assert isinstance(w, block_quant.Fp8Weight)
    return parts, w, _rand(m, groups * k, seed=39)


@pytest.mark.parametrize("m", [1, 3, fp8_matmul.GEMV_ROWS + 4])
def test_grouped_linear_is_each_groups_product_on_its_own_columns(m):
    """Few rows through the GEMV (x as it is), more through the GEMM (x's e4m3 codes): group g's
    rows against x's g-th run of columns, as a separate call on that slice gives it."""
    parts, w, x = _grouped_case(m)
    k = w.shape[1]
    got = fp8_matmul.grouped_linear_or_none()(x, w, len(parts))
    fast = fp8_matmul.linear_or(torch.nn.functional.linear)
    want = torch.cat([fast(x[:, g * k : (g + 1) * k], p) for g, p in enumerate(parts)], dim=1)
    assert got.shape == (m, w.shape[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", ["SPLIT", "SPLIT_NARROW"])
def test_a_split_k_grouped_linear_is_each_groups_split_product(cfg):
    """K runs inside a group's columns (V4's wo_a at batch sizes): each group's rows against its
    own run of x's columns, as the same split GEMM on that slice gives it."""
    cfg = getattr(fp8_matmul, cfg)
    parts, w, x = _grouped_case(24, k=512)
    got = fp8_matmul.fp8_linear(x, w, cfg, groups=len(parts))
    want = torch.cat(
        [fp8_matmul.fp8_linear(x[:, g * 512 : (g + 1) * 512], p, cfg) for g, p in enumerate(parts)],
        dim=1,
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert _counters_at_rest()


def test_the_invariant_grouped_linear_keeps_a_row_alone_equal_to_it_in_its_batch():
    parts, w, x = _grouped_case(fp8_matmul.GEMV_ROWS + 4)
    grouped = fp8_matmul.grouped_linear_or_none(batch_invariant=True)
    full = grouped(x, w, len(parts))
    assert torch.equal(grouped(x[2:3], w, len(parts)), full[2:3])


def test_grouped_linear_declines_groups_that_cut_a_scale_block_or_plain_weights():
    w = block_quant.quantize_fp8(_rand(256, 256, seed=38))
    x = _rand(2, 4 * 256, seed=39)
    grouped = fp8_matmul.grouped_linear_or_none()  # 4 groups of 64 rows: inside 128-row blocks
    assert grouped(x, w, 4) is None
    assert grouped(x, w.dequantize(), 4) is None


def test_a_v4_model_on_kept_fp8_and_mxfp4_weights_runs_the_default_set_as_its_dequantized_load(
    tmp_path,
):
    """V4 as published (FP8 dense, MXFP4 experts) kept for the default CUDA set: few-row
    linears through the GEMV (x unquantized), experts through the fused MoE on e2m1 codes, both
    exact products, so a prefill and a decode step give the reference set's logits on the
    dequantized load up to float32 summation order."""
    from model_loop import SequenceLoop

    from deepserve.engine.loading.hf_loader import read_hf_folder
    from deepserve.engine.models.common import WeightStore
    from deepserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4
    from deepserve.kernels.reference import KERNELS
    from deepserve.kernels.registry import fast_kernels

    folder = write_tiny_deepseek_v4(tmp_path / "v4", quantization="mxfp4")
    logits = []
    for keep, kernels in ((False, KERNELS), (True, fast_kernels())):
        ckpt = read_hf_folder(folder, torch.float32, keep_quantized=keep)
        store = WeightStore(ckpt.weights, torch.device(DEVICE), torch.float32)
        with torch.inference_mode():
            model = DeepseekV4ForCausalLM(ckpt.config, store, kernels, "t")
        loop = SequenceLoop(model, 32, block_size=4)
        logits.append([loop.logits([5, 9, 2, 7, 1]), loop.logits([3])])
    assert isinstance(model.layers[2].moe.gate_up, block_quant.Mxfp4Weight)
    for want, got in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- fused MoE with FP8 and MXFP4 experts ---------------------------------------------------


def _moe_case(tokens: int, e: int = 4, h: int = 256, i: int = 128, k: int = 2):
    from deepserve.kernels.triton import fused_moe

    gate_up, down = _rand(e, 2 * i, h, seed=21) / h**0.5, _rand(e, h, i, seed=22) / i**0.5
    x = _rand(tokens, h, seed=23)
    ids = _rand(tokens, e, seed=24).topk(k, dim=-1)[1]
    w = _rand(tokens, k, seed=25).abs()
    return fused_moe, gate_up, down, x, ids, w


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_moe_with_fp8_experts_matches_the_loop_on_quantized_inputs(tokens):
    """Both GEMMs quantize their inputs per 1 x 128 group; the wide tiles' 64-step K is raised
    to the scales' 128."""
    fused_moe, gate_up, down, x, ids, w = _moe_case(tokens)
    gu8, d8 = block_quant.quantize_fp8(gate_up), block_quant.quantize_fp8(down)
    want = fused_moe.fused_moe_reference(x, gu8, d8, w, ids)
    for cfg in (fused_moe.DECODE, fused_moe.PREFILL):
        got = fused_moe.fused_moe(x, gu8, d8, w, ids, cfg)
        assert _rel(got, want) < 2e-2, cfg


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_moe_with_fp8_experts_unquantized_inputs_is_the_dequantized_product(tokens):
    """`fp8_inputs` off (the default set's decode-sized calls): the e4m3 tile widened to x's
    dtype, x as it is: the float32 loop on the dequantized experts, up to summation order."""
    fused_moe, gate_up, down, x, ids, w = _moe_case(tokens)
    gu8, d8 = block_quant.quantize_fp8(gate_up), block_quant.quantize_fp8(down)
    want = fused_moe.fused_moe_reference(x, gu8, d8, w, ids, fp8_inputs=False)
    assert fused_moe.default_config(tokens * 2, 4) is fused_moe.DECODE_W8A16
    torch.testing.assert_close(fused_moe.fused_moe(x, gu8, d8, w, ids), want, rtol=1e-4, atol=1e-4)
    w8a8 = fused_moe.fused_moe(x, gu8, d8, w, ids, fused_moe.DECODE)
    assert _rel(w8a8, want) > 1e-3  # the other scheme: x's e4m3 rounding shows


def test_fused_moe_with_fp8_experts_keeps_rows_batch_invariant_under_a_fixed_tile():
    fused_moe, gate_up, down, x, ids, w = _moe_case(5)
    gu8, d8 = block_quant.quantize_fp8(gate_up), block_quant.quantize_fp8(down)
    full = fused_moe.fused_moe(x, gu8, d8, w, ids, fused_moe.DECODE)
    alone = fused_moe.fused_moe(x[-1:], gu8, d8, w[-1:], ids[-1:], fused_moe.DECODE)
    assert torch.equal(alone, full[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_mxfp4_experts_matches_the_loop_on_their_dequantization(dtype):
    """e2m1 times a power of two is exact in bf16: the kernel computes with the very weights the
    loader's dequantization gives."""
    fused_moe, gate_up, down, x, ids, w = _moe_case(5)
    gu4, d4 = block_quant.quantize_mxfp4(gate_up), block_quant.quantize_mxfp4(down)
    x = x.to(dtype)
    want = fused_moe.fused_moe_reference(x, gu4, d4, w, ids)
    for cfg in (fused_moe.DECODE, fused_moe.PREFILL):
        got = fused_moe.fused_moe(x, gu4, d4, w, ids, cfg)
        tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: the intermediates rounded
        assert _rel(got, want) < tol, cfg


def test_fused_moe_with_mxfp4_experts_masks_a_k_not_a_multiple_of_the_tiles_step():
    """down's K of 96 under a 128-step: the last step's codes, scales and activations masked."""
    fused_moe, gate_up, down, x, ids, w = _moe_case(3, i=96)
    gu4, d4 = block_quant.quantize_mxfp4(gate_up), block_quant.quantize_mxfp4(down)
    want = fused_moe.fused_moe_reference(x, gu4, d4, w, ids)
    assert _rel(fused_moe.fused_moe(x, gu4, d4, w, ids, fused_moe.DECODE), want) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: compiled on a GPU only")
def test_fused_moe_with_mxfp4_experts_decodes_in_ptx_to_the_integer_paths_bits():
    """bf16 activations on E8M0 experts take fused_moe.py's `E2M1_BF16_PTX`: an exact decode, as
    the integer one, so the same products under the same tile (tests/test_kernels_e2m1_ptx.py
    checks the asm's bits on the CPU; this, Triton's packing of them)."""
    fused_moe, gate_up, down, x, ids, w = _moe_case(5)
    gu4, d4 = block_quant.quantize_mxfp4(gate_up), block_quant.quantize_mxfp4(down)
    x = x.bfloat16()
    for cfg in (fused_moe.DECODE, fused_moe.PREFILL):
        integer = replace(cfg, e2m1_ptx=False)
        got = fused_moe.fused_moe(x, gu4, d4, w, ids, cfg)
        assert torch.equal(got, fused_moe.fused_moe(x, gu4, d4, w, ids, integer)), cfg


def test_fused_moe_with_mxfp4_experts_clamps_at_the_swiglu_limit():
    fused_moe, gate_up, down, x, ids, w = _moe_case(3)
    gu4, d4 = block_quant.quantize_mxfp4(gate_up * 8), block_quant.quantize_mxfp4(down)
    want = fused_moe.fused_moe_reference(x, gu4, d4, w, ids, swiglu_limit=0.5)
    assert _rel(fused_moe.fused_moe_reference(x, gu4, d4, w, ids), want) > 0.05  # it bites
    assert _rel(fused_moe.fused_moe(x, gu4, d4, w, ids, swiglu_limit=0.5), want) < 1e-4


def test_mxfp4_weights_read_as_the_loader_reads_the_checkpoints_bytes():
    from deepserve.engine.loading.quantized import dequantize_mxfp4

    w = block_quant.quantize_mxfp4(_rand(6, 64, seed=26))
    want = dequantize_mxfp4(w.data.cpu().view(torch.int8), w.scale.cpu(), torch.float32)
    assert torch.equal(w.dequantize().cpu(), want)
    assert _rel(w.dequantize(), _rand(6, 64, seed=26)) < 0.2  # e2m1: 1 mantissa bit


_SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepserve.kernels.triton import fp8_gemv as fv, fp8_matmul as f, fused_moe as fm

def build(fn, types, consts, cfg):
    sig = dict(types, **{k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

names = ("a_ptr as_ptr b_ptr bs_ptr c_ptr part_ptr count_ptr M N K steps_per_split n_split s_am "
         "s_asm s_bn s_bsn s_cm").split()
gemm = dict(zip(names, ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*fp32", "*i32"]
                + ["i32"] * 10))
for cfg, group_n in ((f.decode_config(2048), 0), (f.LARGE, 0), (f.decode_config(8192), 1024),
                     (f.MEDIUM, 1024), (f.SPLIT, 0), (f.SPLIT, 1024), (f.SPLIT_NARROW, 0)):
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128, SCALE_N=128, GROUP_M=8,
                  EVEN_K=False, QUANT_A=cfg.block_m <= 16, FP8_MAX=448.0, AMAX_FLOOR=1e-10,
                  GROUP_N=group_n, SPLIT_K=cfg.waves > 0)
    a_type = "*bf16" if consts["QUANT_A"] else "*fp8e4nv"
    ptx = build(f._fp8_gemm_kernel, dict(gemm, a_ptr=a_type), consts, cfg)
    assert cfg.block_m < 64 or "wgmma" in ptx, "large fp8 tiles on Hopper's wgmma"
    assert not cfg.waves or "atom.global.gpu.acq_rel.add" in ptx, "split runs counted acq_rel"
names = ("a_ptr w_ptr c_ptr pair_ptr block_expert_ptr scale_ptr as_ptr ws_ptr num_pairs N K s_am "
         "s_we s_wn s_wk s_cm s_asm s_wse s_wsn s_wsk").split()
for wfmt, a, w, ws, cfg, ptx, even_k in (
    (1, "*fp8e4nv", "*fp8e4nv", "*fp32", fm.DECODE, False, True),
    (3, "*bf16", "*fp8e4nv", "*fp32", fm.DECODE, False, True),
    (2, "*bf16", "*u8", "*u8", fm.PREFILL, False, False),
    (2, "*bf16", "*u8", "*u8", fm.DECODE, True, True),
    (2, "*bf16", "*u8", "*u8", fm.PREFILL, True, False),
):
    types = dict(zip(names, [a, w, "*bf16", "*i64", "*i32", "*fp32", "*fp32", ws] + ["i32"] * 12))
    consts = dict(A_DIV=1, SCALE=True, PRECISION="tf32", WFMT=wfmt, SCALE_N=128, E8M0=wfmt == 2,
                  PTX=ptx, EVEN_K=even_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k if wfmt == 2 else 128)
    ptx_text = build(fm._moe_gemm_kernel, types, consts, cfg)
    assert ("mul.rn.bf16x2" in ptx_text) == ptx, "the e2m1 decode taken as asked"
names = ("x_ptr w_ptr ws_ptr out_ptr y_ptr count_ptr M N K steps_per_split n_split s_xm s_wn "
         "s_wsn s_os s_om").split()
for block_m, x, w, out, one, group_n in (
    (1, "*bf16", "*fp8e4nv", "*fp32", True, 0), (16, "*bf16", "*fp8e4nv", "*bf16", False, 0),
    (64, "*fp32", "*fp8e4nv", "*fp32", True, 0), (1, "*bf16", "*bf16", "*fp32", True, 0),
    (8, "*bf16", "*bf16", "*fp32", True, 0), (4, "*fp32", "*fp32", "*fp32", True, 0),
    (1, "*bf16", "*fp8e4nv", "*fp32", True, 1024), (16, "*bf16", "*fp8e4nv", "*fp32", True, 1024),
):
    types = dict(zip(names, [x, w, "*fp32" if w == "*fp8e4nv" else w, out, x, "*i32"]
                     + ["i32"] * 10))
    consts = dict(BLOCK_M=block_m if block_m == 1 else max(16, block_m), BLOCK_N=64, BLOCK_K=128,
                  SCALE_N=128, EVEN_K=False, IEEE=x == "*fp32", SCALED=w == "*fp8e4nv",
                  ONE_LAUNCH=one, X_TILE=block_m == 1 and w == "*bf16", GROUP_N=group_n)
    ptx = build(fv._gemv_kernel, types, consts, fv.GEMV)
    assert not one or "atom.global.gpu.acq_rel.add" in ptx, "the split count is an acq_rel atomic"
types = dict(p_ptr="*fp32", y_ptr="*bf16", total="i32")
build(fv._sum_splits_kernel, types, dict(SPLIT=8, BLOCK=1024), fv.GEMV)
"""


def test_the_fp8_and_mxfp4_kernels_build_for_hopper():
    """The interpreter runs kernels as Python and misses what only the compiler refuses (a
    module global read in a kernel, an fp8 dot shape): the GEMM's decode and wide tiles, the
    GEMV's one-row and dot variants and its partials' sum (both also grouped), and the MoE's FP8 (w8a8, w8a16) and
    MXFP4 variants (integer and PTX e2m1 decode) compiled for sm90, in a process without the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", _SM90_BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
