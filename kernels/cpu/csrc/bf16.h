// bfloat16 rows in AVX2 registers, for the elementwise kernels that take a bf16 model's rows
// (norm.cpp, rope.cpp, activation.cpp): 8 bf16 widened to float32 (exact: the bf16 bits are the
// float's top half) and 8 float32 rounded back to nearest even the way torch's cast rounds (a
// NaN stays a quiet NaN), so a kernel that mirrors torch's float32 math and roundings gives
// torch's bits wherever its own float32 values do.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace deepserve_cpu {

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// v rounded to bf16 precision, still as float32 lanes: round to nearest even, NaN lanes 0x7FC0
// (torch's c10::BFloat16 does the same). Integer ops on the float's bits, no packing.
inline __m256 to_bf16_precision(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(-65536)));
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Stores 8 floats that are already of bf16 precision (their low halves zero) as bf16.
inline void store_exact_bf16x8(uint16_t* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  // 32-bit lanes holding 16-bit values -> 8 packed uint16 (packus works per 128-bit half)
  const __m256i packed = _mm256_packus_epi32(hi, hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

inline void store_bf16x8(uint16_t* p, __m256 v) { store_exact_bf16x8(p, to_bf16_precision(v)); }

// One value each way, for the tails of rows that are not a multiple of 8.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// A float32 value as torch holds it after a bf16 op: rounded to bf16 and widened back.
inline float to_bf16_precision(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace deepserve_cpu
