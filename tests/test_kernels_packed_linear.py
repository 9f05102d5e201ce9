"""The native CPU backend's packed weights give F.linear's values for any number of rows."""

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels.cpu.packed import PackedWeight, linear, pack_linear_weight


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_packed_weight_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    x = torch.randn(rows, 96, generator=g)
    packed = pack_linear_weight(w)
    assert isinstance(packed, PackedWeight)
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16])
def test_packed_bfloat16_weight_matches_a_float32_accumulated_gemm(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    got = linear(x, pack_linear_weight(w))
    assert got.dtype == torch.bfloat16
    expect = F.linear(x.float(), w.float()).bfloat16()
    torch.testing.assert_close(got, expect, rtol=1e-2, atol=1e-2)


def test_integer_weight_is_left_plain() -> None:
    w = torch.ones(8, 4, dtype=torch.int32)
    assert pack_linear_weight(w) is w
