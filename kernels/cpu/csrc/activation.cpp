// SwiGLU's elementwise half on the fused gate|up projection: out = silu(gate) * up in one pass,
// where torch makes a silu temporary and then multiplies. float32 or bfloat16 rows, each
// independent; bfloat16 rows round as torch's two bf16 ops do (silu(gate) rounded to bf16, then
// the product), with the float32 path's math in between.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "bf16.h"
#include "isa.h"
#include "vec_math.h"

#include <cmath>

namespace {

using deepserve_cpu::bf16_to_float;
using deepserve_cpu::exp8;
using deepserve_cpu::float_to_bf16;
using deepserve_cpu::load_bf16x8;
using deepserve_cpu::store_bf16x8;
using deepserve_cpu::to_bf16_precision;

inline __m256 silu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n, int64_t i) {
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  for (; i < n; ++i) out[i] = silu(g[i]) * u[i];
}

// From element `i` on (elementwise_avx512.cpp may have done the row's start, with these bits).
inline void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n,
                         int64_t i) {
  // Two independent vectors a step: exp's long dependency chain overlaps with the other's.
  for (; i + 16 <= n; i += 16) {
    const __m256 s0 = to_bf16_precision(silu8(load_bf16x8(g + i)));
    const __m256 s1 = to_bf16_precision(silu8(load_bf16x8(g + i + 8)));
    store_bf16x8(out + i, _mm256_mul_ps(s0, load_bf16x8(u + i)));
    store_bf16x8(out + i + 8, _mm256_mul_ps(s1, load_bf16x8(u + i + 8)));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 s = to_bf16_precision(silu8(load_bf16x8(g + i)));
    store_bf16x8(out + i, _mm256_mul_ps(s, load_bf16x8(u + i)));
  }
  for (; i < n; ++i)
    out[i] = float_to_bf16(to_bf16_precision(silu(bf16_to_float(g[i]))) * bf16_to_float(u[i]));
}

// How much of a row the AVX-512 code does: a bf16 row's first multiple of 16 on any path but
// AVX2; none of a float32 row (its native op predates the bf16 one and stays AVX2).
inline int64_t wide_part(const float*, const float*, float*, int64_t, bool) { return 0; }

inline int64_t wide_part(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n,
                         bool wide) {
  return wide ? deepserve_cpu::silu_mul_row_bf16_avx512(g, u, out, n) : 0;
}

template <class T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out, int64_t rows, int64_t n) {
  const T* src = reinterpret_cast<const T*>(gate_up.data_ptr());
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  const int64_t width = 2 * n;
  const bool wide = deepserve_cpu::isa() != deepserve_cpu::Isa::kAvx2;
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *g = src + r * width, *u = g + n;
      silu_mul_row(g, u, dst + r * n, n, wide_part(g, u, dst + r * n, n, wide));
    }
  });
}

// gate_up [T, 2 I] (gate columns first) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || gate_up.scalar_type() == at::kFloat) && gate_up.is_contiguous(),
              "float32 or bfloat16 rows");
  const int64_t width = gate_up.size(-1), n = width / 2, rows = gate_up.numel() / width;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gate_up.options());
  if (bf16) {
    silu_mul_rows<uint16_t>(gate_up, out, rows, n);
  } else {
    silu_mul_rows<float>(gate_up, out, rows, n);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) { m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul); }
