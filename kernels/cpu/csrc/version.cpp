// The library's identity ops: let a test check that the native build loaded and that its
// parallel loops run on torch's own OpenMP pool (one pool per process; see kernels/cpu/native.py).
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {
int64_t abi_version() { return 1; }

// How many threads a parallel loop of `n` iterations ran on.
int64_t parallel_threads(int64_t n) {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def("abi_version() -> int", &abi_version);
  m.def("parallel_threads(int n) -> int", &parallel_threads);
}
