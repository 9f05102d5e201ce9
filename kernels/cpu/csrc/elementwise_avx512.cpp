// The AVX-512 halves of the bfloat16 elementwise kernels (norm.cpp's bf16 rows, activation.cpp's
// bf16 silu_mul): 16 lanes a step where the AVX2 code takes 8, for the calls cpuid allows
// (isa.h: any path but AVX2). Each function does a row's first multiple of 16 elements and
// returns how many it did; the caller's AVX2 code does the rest. Every lane runs the AVX2 code's
// operations in the same order (the same exp polynomial, the same roundings), so both paths
// give the same bits; nothing here reduces across lanes (the norm's sum of squares stays in
// norm.cpp).
//
// As in linear_avx512.cpp: internal linkage inside the pragma, standard headers before it.
#include <immintrin.h>

#include <cstdint>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

#include "vec_math_avx512.h"

namespace {

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// bf16.h's to_bf16_precision, 16 lanes.
inline __m512 to_bf16_precision(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __m512i r = _mm512_and_si512(up, _mm512_set1_epi32(-65536));
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}

inline void store_exact_bf16x16(uint16_t* p, __m512 v) {
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
}

inline void store_bf16x16(uint16_t* p, __m512 v) { store_exact_bf16x16(p, to_bf16_precision(v)); }

}  // namespace

#pragma GCC pop_options

namespace deepserve_cpu {

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t widen_row_bf16_avx512(
    uint16_t* h, const uint16_t* delta, float* xf, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = load_bf16x16(h + i);
    if (delta != nullptr) {
      v = to_bf16_precision(_mm512_add_ps(v, load_bf16x16(delta + i)));
      store_exact_bf16x16(h + i, v);
    }
    _mm512_storeu_ps(xf + i, v);
  }
  return i;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t scale_row_bf16_avx512(
    const float* x, const uint16_t* w, float r, uint16_t* out, int64_t n) {
  const __m512 vr = _mm512_set1_ps(r);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 normed = to_bf16_precision(_mm512_mul_ps(_mm512_loadu_ps(x + i), vr));
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(w + i), normed));
  }
  return i;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t silu_mul_row_bf16_avx512(
    const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load_bf16x16(g + i);
    const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, x))));
    store_bf16x16(out + i, _mm512_mul_ps(to_bf16_precision(silu), load_bf16x16(u + i)));
  }
  return i;
}

}  // namespace deepserve_cpu
