"""The native kernels' ISA paths (kernels/cpu/csrc/isa.h): the widest cpuid reports is the default,
any path the CPU has can be forced and put back, one it lacks is refused, and the linear's
AVX2 and AVX-512 paths give the same bits. Each path's batch invariance is tested by
tests/test_kernels_invariant_cpu_native.py, on every path this CPU has."""

from __future__ import annotations

import pytest
import torch

from deepserve.kernels.cpu import native as cpu_native
from deepserve.kernels.cpu.packed import pack_panels

pytestmark = pytest.mark.skipif(not cpu_native.load(), reason="native CPU kernels unavailable")

ORDER = ["avx2", "avx512", "avx512_bf16"]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_native.op("linear")(x, pack_panels(w), w.shape[0])


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_every_supported_path_is_a_known_one_and_avx2_is_always_there():
    supported = cpu_native.supported_isas()
    assert supported[0] == "avx2"
    assert supported == [isa for isa in ORDER if isa in supported]


def _default() -> str:
    return cpu_native.supported_isas()[-1]


def test_the_default_path_is_the_widest_the_cpu_has():
    assert cpu_native.isa() == _default()


def test_a_forced_path_is_used_inside_the_block_and_put_back_after():
    before = cpu_native.isa()
    with cpu_native.use_isa("avx2"):
        assert cpu_native.isa() == "avx2"
    assert cpu_native.isa() == before


def test_a_path_the_cpu_lacks_is_refused():
    missing = [isa for isa in ORDER if isa not in cpu_native.supported_isas()]
    if not missing:
        pytest.skip("this CPU has every path")
    with pytest.raises(RuntimeError, match="does not support"), cpu_native.use_isa(missing[0]):
        pass
    assert cpu_native.isa() == _default()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_rows_give_the_bits_of_their_float32_widening_on_the_fma_paths(dtype):
    w, x = _rand(200, 577, seed=1).to(dtype), _rand(13, 577, seed=2).to(torch.bfloat16)
    for isa in [isa for isa in cpu_native.supported_isas() if isa != "avx512_bf16"]:
        with cpu_native.use_isa(isa):
            assert torch.equal(_linear(x, w), _linear(x.float(), w)), isa


@pytest.mark.skipif(
    not cpu_native.load() or "avx512" not in cpu_native.supported_isas(), reason="needs AVX-512"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx512_linear_has_the_avx2_bits(dtype):
    w, x = _rand(200, 577, seed=3).to(dtype), _rand(40, 577, seed=4)
    with cpu_native.use_isa("avx2"):
        expect = _linear(x, w)
    with cpu_native.use_isa("avx512"):
        assert torch.equal(_linear(x, w), expect)
