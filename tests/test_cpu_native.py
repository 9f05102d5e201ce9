"""The native CPU kernels (kernels/csrc/) build on this machine and run on torch's own thread pool."""

from __future__ import annotations

import pytest
import torch

from deepserve.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="needs an AVX2 CPU")


def test_native_kernels_build_and_load():
    assert cpu_native.load()
    assert cpu_native.ops().abi_version() == 1


def test_native_parallel_loops_use_torchs_thread_count():
    cpu_native.load()
    assert cpu_native.ops().parallel_threads(64) == torch.get_num_threads()


def test_process_keeps_one_openmp_runtime():
    # A second libgomp would mean a second thread pool: both stop spin-waiting and slow down.
    cpu_native.load()
    cpu_native.ops().parallel_threads(64)
    torch.matmul(torch.randn(256, 256), torch.randn(256, 256))
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) <= 1, gomps
