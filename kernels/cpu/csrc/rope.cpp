// RoPE on the fused q|k|v projection, in place, plus the KV-cache write, in one pass per token:
// what torch does as two slices, four multiplies, an add, a subtract and a concatenation for the
// rotation and two index_copy_ calls for the cache. The rotation multiplies and adds separately
// (no FMA), as torch's elementwise ops do, so float32 results are bitwise torch's; bfloat16 rows
// (with bf16 cos/sin and a bf16 cache) round each product and the sum to bf16 as torch's bf16 ops
// do, so they are bitwise torch's too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>

#include "bf16.h"

// GCC would fuse the intrinsics' multiply and add into FMAs: keep torch's rounding.
#pragma GCC optimize("fp-contract=off")

namespace {

// x[0:half], x[half:2*half] <- rotated by cos/sin (half-split layout).
inline void rotate(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, vc), _mm256_mul_ps(x2, vs)));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, vc), _mm256_mul_ps(x1, vs)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * s[i];
    x[half + i] = x2 * c[i] + x1 * s[i];
  }
}

using deepserve_cpu::bf16_to_float;
using deepserve_cpu::float_to_bf16;
using deepserve_cpu::load_bf16x8;
using deepserve_cpu::store_bf16x8;
using deepserve_cpu::to_bf16_precision;

inline __m256 mul_bf16(__m256 a, __m256 b) { return to_bf16_precision(_mm256_mul_ps(a, b)); }

inline float mul_bf16(float a, float b) { return to_bf16_precision(a * b); }

inline void rotate(uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load_bf16x8(x + i), x2 = load_bf16x8(x + half + i);
    const __m256 vc = load_bf16x8(c + i), vs = load_bf16x8(s + i);
    store_bf16x8(x + i, _mm256_sub_ps(mul_bf16(x1, vc), mul_bf16(x2, vs)));
    store_bf16x8(x + half + i, _mm256_add_ps(mul_bf16(x2, vc), mul_bf16(x1, vs)));
  }
  for (; i < half; ++i) {
    const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[half + i]);
    const float ci = bf16_to_float(c[i]), si = bf16_to_float(s[i]);
    x[i] = float_to_bf16(mul_bf16(x1, ci) - mul_bf16(x2, si));
    x[half + i] = float_to_bf16(mul_bf16(x2, ci) + mul_bf16(x1, si));
  }
}

template <class T>
inline void store_head(const T* src, T* cache, int64_t slot, int64_t block_size,
                       const at::IntArrayRef st, int64_t head, int64_t d) {
  T* dst = cache + (slot / block_size) * st[0] + (slot % block_size) * st[1] + head * st[2];
  std::memcpy(dst, src, d * sizeof(T));
}

template <class T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <class T>
void rope_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
               at::Tensor& v_cache, const int64_t* sp, int64_t hq, int64_t hkv) {
  const int64_t tokens = qkv.size(0), d = k_cache.size(3), half = d / 2;
  T* base = ptr<T>(qkv);
  const T* cp = ptr<T>(cos);
  const T* snp = ptr<T>(sin);
  T* kc = ptr<T>(k_cache);
  T* vc = ptr<T>(v_cache);
  const int64_t bs = k_cache.size(1), width = qkv.size(1);
  at::parallel_for(0, tokens, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* row = base + t * width;
      for (int64_t h = 0; h < hq + hkv; ++h) rotate(row + h * d, cp + t * half, snp + t * half, half);
      for (int64_t h = 0; h < hkv; ++h) {
        store_head(row + (hq + h) * d, kc, sp[t], bs, k_cache.strides(), h, d);
        store_head(row + (hq + hkv + h) * d, vc, sp[t], bs, v_cache.strides(), h, d);
      }
    }
  });
}

// qkv [T, (hq + 2 hkv) * d]: rotate q and k heads of each token, then store its k and v heads
// at slot_mapping[t] of k_cache / v_cache [blocks, block_size, hkv, d] (strided views).
void rope_qk_write_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       int64_t hq, int64_t hkv) {
  const at::ScalarType dtype = qkv.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "float32 or bfloat16 rows, tables and caches, all one dtype");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous");
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && cos.size(-1) == d / 2, "shape mismatch");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (dtype == at::kBFloat16) {
    rope_rows<uint16_t>(qkv, cos, sin, k_cache, v_cache, sp, hq, hkv);
  } else {
    rope_rows<float>(qkv, cos, sin, k_cache, v_cache, sp, hq, hkv);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def(
      "rope_qk_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int hq, int hkv) -> ()",
      &rope_qk_write_kv_);
}
