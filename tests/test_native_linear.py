"""The native CPU linear (kernels/cpu/csrc/linear.cpp through kernels/cpu/packed.py's PackedWeight):
F.linear's values for any row count and awkward shapes, and a row's bits independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from deepserve.engine.loading.gguf_format import dequantize
from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu.packed import (
    ONEDNN_MIN_ROWS,
    QUANT_MAX_ROWS,
    PackedWeight,
    linear,
    pack_linear_weight,
)
from deepserve.kernels.quant_panels import QuantizedMatrix

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="needs an AVX2 CPU")

# (out, in): SmolLM2's qkv and down, and remainders of the 16-column panels and of everything else.
SHAPES = [(960, 576), (576, 1536), (37, 13), (17, 1), (5, 100), (300, 96), (49, 577)]


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _packed(w: torch.Tensor) -> PackedWeight:
    packed = pack_linear_weight(w)
    assert isinstance(packed, PackedWeight)
    return packed


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_matches_float64_linear_for_row_counts_1_to_70(out_features: int, in_features: int):
    w = _rand(out_features, in_features, seed=1)
    packed = _packed(w)
    x = _rand(70, in_features, seed=2)
    expect = F.linear(x.double(), w.double())
    # float32 rounding of a length-K dot product of unit normals: ~K * 2^-24 * sqrt(K) at worst.
    atol = 1e-6 * in_features
    for rows in range(1, 71):
        got = linear(x[:rows], packed)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expect[:rows], rtol=1e-5, atol=atol)


def test_row_is_bitwise_equal_alone_and_inside_a_batch_of_16():
    w = _packed(_rand(960, 576, seed=3))
    x = _rand(16, 576, seed=4)
    batch = linear(x, w)
    for i in range(16):
        assert torch.equal(linear(x[i : i + 1], w)[0], batch[i]), i


def test_row_bits_do_not_depend_on_row_count_or_offset():
    w = _packed(_rand(300, 96, seed=5))
    x = _rand(200, 96, seed=6)
    full = linear(x, w)
    for rows in (1, 2, 3, 5, 7, 8, 13, 16, 33, 64, 97, 150):
        for off in (0, 3):
            assert torch.equal(linear(x[off : off + rows], w), full[off : off + rows]), (rows, off)


def test_leading_dims_and_non_contiguous_input():
    w = _rand(40, 64, seed=7)
    x = _rand(3, 64, 5, seed=8).transpose(1, 2)  # [3, 5, 64], strided
    torch.testing.assert_close(linear(x, _packed(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 16, 33])
def test_bfloat16_weight_streams_as_bfloat16_and_matches_a_float32_accumulated_gemm(rows: int):
    w = _rand(333, 576, seed=9).bfloat16()
    packed = _packed(w)
    assert packed.panels.dtype == torch.bfloat16
    x = _rand(rows, 576, seed=10).bfloat16()
    got = linear(x, packed)
    assert got.dtype == torch.bfloat16
    expect = F.linear(x.double(), w.double())
    # one bf16 rounding of the float32 result
    torch.testing.assert_close(got.double(), expect, rtol=8e-3, atol=1e-2)


def test_bfloat16_row_is_bitwise_equal_alone_and_inside_a_batch():
    w = _packed(_rand(100, 64, seed=11).bfloat16())
    x = _rand(16, 64, seed=12).bfloat16()
    batch = linear(x, w)
    for i in range(16):
        assert torch.equal(linear(x[i : i + 1], w)[0], batch[i]), i


@pytest.mark.parametrize("rows", [ONEDNN_MIN_ROWS, 64])
def test_a_bfloat16_weight_with_onednns_copy_takes_it_from_its_row_threshold(rows: int):
    w = _rand(333, 576, seed=9).bfloat16()
    vendor = pack_linear_weight(w, onednn=True)
    assert vendor.onednn is not None
    x = _rand(rows, 576, seed=10).bfloat16()
    got = linear(x, vendor)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), rtol=8e-3, atol=1e-2)
    onednn = torch.ops.mkldnn._linear_pointwise(x, vendor.onednn, None, "none", [], "")
    assert torch.equal(got, onednn)


def test_a_bfloat16_weight_with_onednns_copy_stays_native_below_the_threshold():
    w = _rand(333, 576, seed=9).bfloat16()
    vendor, own = pack_linear_weight(w, onednn=True), _packed(w)
    x = _rand(ONEDNN_MIN_ROWS - 1, 576, seed=10).bfloat16()
    assert torch.equal(linear(x, vendor), linear(x, own))


def test_only_bfloat16_weights_keep_a_onednn_copy():
    assert _packed(_rand(20, 8, seed=14)).onednn is None
    assert pack_linear_weight(_rand(20, 8, seed=14), onednn=True).onednn is None
    assert _packed(_rand(20, 8, seed=14).bfloat16()).onednn is None


def test_packing_keeps_one_copy_the_size_of_the_weight():
    w = _rand(960, 576, seed=13)
    packed = _packed(w)
    assert packed.panels.numel() == w.numel() and packed.in_features == 576


def test_empty_batch_gives_empty_output():
    w = _packed(_rand(20, 8, seed=14))
    assert linear(torch.empty(0, 8), w).shape == (0, 20)


def _quantized(
    fmt: str, out_features: int, in_features: int
) -> tuple[torch.Tensor, QuantizedMatrix]:
    """A random matrix through gguf's own quantizer: its exact dequantization and its blocks."""
    qtype = GGMLQuantizationType[fmt]
    w = _rand(out_features, in_features, seed=out_features) * 0.1
    rows = torch.from_numpy(quants.quantize(w.numpy(), qtype)).view(torch.uint8)
    rows = rows.reshape(out_features, -1)
    deq = dequantize(rows.reshape(-1), qtype, (out_features, in_features))
    return deq, QuantizedMatrix(fmt, rows, in_features)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (37, 64), (5, 32)])
def test_quantized_weight_gives_the_bits_of_its_dequantization(fmt, out_features, in_features):
    deq, blocks = _quantized(fmt, out_features, in_features)
    plain = _packed(deq)
    packed = pack_linear_weight(deq, blocks)
    assert packed.quant is not None
    x = _rand(QUANT_MAX_ROWS + 3, in_features, seed=7)
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(linear(x[:rows], packed), linear(x[:rows], plain)), rows


def test_quantized_weight_row_bits_do_not_depend_on_the_batch():
    """Few-row calls read the blocks, larger ones the float32 panels: a row comes out the same."""
    deq, blocks = _quantized("Q4_1", 96, 64)
    packed = pack_linear_weight(deq, blocks)
    x = _rand(16, 64, seed=3)
    batch = linear(x, packed)
    for i in range(16):
        assert torch.equal(linear(x[i : i + 1], packed)[0], batch[i]), i


def test_quantized_blocks_of_another_shape_are_rejected():
    deq, blocks = _quantized("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="quantized blocks"):
        pack_linear_weight(deq[:8], blocks)
