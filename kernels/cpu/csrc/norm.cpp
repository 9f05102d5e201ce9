// RMSNorm for float32 or bfloat16 rows, alone or fused with the residual add that precedes it in
// every decoder layer (h += delta; x = rms_norm(h)): one pass over the row instead of torch's five
// ops (pow, mean, add, rsqrt, mul) and their temporaries, which cost more than the arithmetic at
// decode sizes. Rows are independent and each is reduced in a fixed order.
//
// bfloat16 rows take the reference's roundings (kernels/reference/ops.py, as the HF models do):
// the sum rounded to bf16 into h, the statistics and scaling in float32, the normed row rounded
// to bf16 before the bf16 weight multiplies it, and the product rounded once more.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "bf16.h"
#include "isa.h"

namespace {

constexpr int64_t kRowsPerTask = 8;

inline float sum_squares(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 u = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(u, u, a0);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  float s = 0.0f;
  for (float v : lanes) s += v;
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  const __m256 vr = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) out[i] = x[i] * r * w[i];
}

inline void add_row(float* h, const float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(d + i)));
  for (; i < n; ++i) h[i] += d[i];
}

using deepserve_cpu::bf16_to_float;
using deepserve_cpu::float_to_bf16;
using deepserve_cpu::load_bf16x8;
using deepserve_cpu::store_bf16x8;
using deepserve_cpu::store_exact_bf16x8;
using deepserve_cpu::to_bf16_precision;

// Widened to float32 into `xf` (the row's values, exact), adding `delta` first with the
// rounding of torch's bf16 add, which is also written back to `h`; from element `i` on.
inline void widen_row_bf16(uint16_t* h, const uint16_t* delta, float* xf, int64_t n, int64_t i) {
  if (delta != nullptr) {
    for (; i + 8 <= n; i += 8) {
      const __m256 sum =
          to_bf16_precision(_mm256_add_ps(load_bf16x8(h + i), load_bf16x8(delta + i)));
      store_exact_bf16x8(h + i, sum);
      _mm256_storeu_ps(xf + i, sum);
    }
    for (; i < n; ++i) {
      h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(delta[i]));
      xf[i] = bf16_to_float(h[i]);
    }
    return;
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(xf + i, load_bf16x8(h + i));
  for (; i < n; ++i) xf[i] = bf16_to_float(h[i]);
}

// out = bf16(w * bf16(x * r)), the reference's two roundings; from element `i` on.
inline void scale_row_bf16(const float* x, const uint16_t* w, float r, uint16_t* out, int64_t n,
                           int64_t i) {
  const __m256 vr = _mm256_set1_ps(r);
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = to_bf16_precision(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr));
    store_bf16x8(out + i, _mm256_mul_ps(load_bf16x8(w + i), normed));
  }
  for (; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(w[i]) * to_bf16_precision(x[i] * r));
}

// The float32 path's norm_rows for bfloat16 rows: each row widened once into a thread-local
// buffer, then reduced and scaled as the float32 path does. The widening and scaling take 16
// lanes a step where the CPU has AVX-512 (the same bits); the sum of squares is always this
// file's, so its order never depends on the path.
void norm_rows_bf16(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* out,
                    int64_t rows, int64_t n, float eps) {
  const bool wide = deepserve_cpu::isa() != deepserve_cpu::Isa::kAvx2;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(n);
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* row = h + r * n;
      const uint16_t* d = delta == nullptr ? nullptr : delta + r * n;
      widen_row_bf16(row, d, xf.data(), n,
                     wide ? deepserve_cpu::widen_row_bf16_avx512(row, d, xf.data(), n) : 0);
      const float inv = 1.0f / std::sqrt(sum_squares(xf.data(), n) / float(n) + eps);
      uint16_t* o = out + r * n;
      scale_row_bf16(xf.data(), w, inv, o, n,
                     wide ? deepserve_cpu::scale_row_bf16_avx512(xf.data(), w, inv, o, n) : 0);
    }
  });
}

template <class T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  w.scalar_type() == x.scalar_type(),
              "float32 or bfloat16 rows with a weight of the same dtype");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous rows only");
  TORCH_CHECK(x.size(-1) == w.numel(), "weight does not match the row size");
}

// `h += delta` (when given) then out = rms_norm(h) * w, row by row.
void norm_rows(float* h, const float* delta, const float* w, float* out, int64_t rows, int64_t n,
               float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = h + r * n;
      if (delta != nullptr) add_row(x, delta + r * n, n);
      const float inv = 1.0f / std::sqrt(sum_squares(x, n) / float(n) + eps);
      scale_row(x, w, inv, out + r * n, n);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1);
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows_bf16(ptr<uint16_t>(x), nullptr, ptr<uint16_t>(w), ptr<uint16_t>(out), x.numel() / n,
                   n, float(eps));
  } else {
    norm_rows(ptr<float>(x), nullptr, ptr<float>(w), ptr<float>(out), x.numel() / n, n,
              float(eps));
  }
  return out;
}

// In place on h (the residual stream): h += delta; returns rms_norm(h) * w.
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check(h, w);
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(),
              "delta mismatch");
  const at::Tensor d = delta.contiguous();
  at::Tensor out = at::empty_like(h);
  const int64_t n = h.size(-1);
  if (h.scalar_type() == at::kBFloat16) {
    norm_rows_bf16(ptr<uint16_t>(h), ptr<uint16_t>(d), ptr<uint16_t>(w), ptr<uint16_t>(out),
                   h.numel() / n, n, float(eps));
  } else {
    norm_rows(ptr<float>(h), ptr<float>(d), ptr<float>(w), ptr<float>(out), h.numel() / n, n,
              float(eps));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor",
        &add_rms_norm_);
}
