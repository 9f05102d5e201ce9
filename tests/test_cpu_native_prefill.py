"""The native CPU linear at prefill sizes (issue 32): a row computed inside a batch of hundreds of
rows (several row chunks of the kernel, every tile shape) has exactly the bits it has computed
alone, on every ISA path this CPU has, for float32 and bfloat16 rows and panels, with an odd K
and an N off the panel width; and the AVX512-BF16 pair-dot kernel stays within bfloat16 rounding
of a float64 linear."""

from __future__ import annotations

import pytest
import torch

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu.packed import pack_panels

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")

ISAS = cpu_native.supported_isas() if cpu_native.load() else []
# Rows the kernel treats differently: a chunk's first and last, a tile's, the last partial one.
PROBES = (0, 1, 5, 11, 12, 95, 96, 97, 190, 191)


def _rand(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_native.op("linear")(x, pack_panels(w), w.shape[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(200, 577), (1536, 576)])
def test_a_row_inside_a_prefill_sized_batch_has_its_single_row_bits(isa, dtype, shape):
    n, k = shape
    w, x = _rand(n, k, seed=1, dtype=dtype), _rand(300, k, seed=2, dtype=dtype)
    with cpu_native.use_isa(isa):
        alone = {i: _linear(x[i : i + 1], w)[0] for i in PROBES + (250, 299)}
        for rows, offset in [(192, 0), (300, 0), (257, 43), (64, 200)]:
            got = _linear(x[offset : offset + rows], w)
            for i in [i for i in alone if offset <= i < offset + rows]:
                assert torch.equal(got[i - offset], alone[i]), (rows, offset, i)


@pytest.mark.skipif("avx512_bf16" not in ISAS, reason="needs AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 64, 200])
def test_the_pair_dot_kernel_is_a_bfloat16_linear_accumulated_in_float32(rows):
    w, x = _rand(200, 577, seed=3, dtype=torch.bfloat16), _rand(rows, 577, seed=4)
    x = x.to(torch.bfloat16)
    expect = x.double() @ w.double().T
    with cpu_native.use_isa("avx512_bf16"):
        got = _linear(x, w)
    assert got.dtype == torch.float32
    # the products of bf16 values are exact in float32; only the float32 sums round
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-4)
