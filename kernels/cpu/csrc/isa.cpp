// The ISA path in use (kernels/cpu/csrc/isa.h): the default cpuid gives (`best`), unless `set_isa`
// forced another that the CPU supports.
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "isa.h"

namespace deepserve_cpu {
namespace {

const char* const kNames[] = {"avx2", "avx512", "avx512_bf16"};

bool supported(Isa path) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (path) {
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512: return avx512;
    case Isa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

// The widest path cpuid reports. AVX512-BF16 differs from AVX-512 only in the bfloat16 x bfloat16
// linear, whose vdpbf16ps kernel (one broadcast load per row pair since issue 32) runs 1.6-1.8x
// the FMA path's rate from 4 rows up and as fast at 1 row on a Zen 5 EPYC (benchmarks/RESULTS.md,
// issue 32); issue 19 had measured the older kernel at 0.5-0.6x on a Sapphire Rapids Xeon.
Isa best() {
  if (supported(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  return supported(Isa::kAvx512) ? Isa::kAvx512 : Isa::kAvx2;
}

std::atomic<int>& chosen() {
  static std::atomic<int> path{static_cast<int>(best())};
  return path;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (int i = 0; i < 3; ++i) {
    if (supported(static_cast<Isa>(i))) out.emplace_back(kNames[i]);
  }
  return out;
}

std::string get_isa() { return kNames[static_cast<int>(isa())]; }

// Returns the path that was in use, so a caller can put it back.
std::string set_isa(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kNames[i]) {
      TORCH_CHECK(supported(static_cast<Isa>(i)), "this CPU does not support ", name);
      return kNames[chosen().exchange(i)];
    }
  }
  TORCH_CHECK(false, "unknown ISA path ", name, " (avx2, avx512, avx512_bf16)");
}

}  // namespace

Isa isa() { return static_cast<Isa>(chosen().load(std::memory_order_relaxed)); }

}  // namespace deepserve_cpu

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def("supported_isas() -> str[]", &deepserve_cpu::supported_isas);
  m.def("isa() -> str", &deepserve_cpu::get_isa);
  m.def("set_isa(str name) -> str", &deepserve_cpu::set_isa);
}
