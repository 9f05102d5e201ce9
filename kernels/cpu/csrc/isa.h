// Which instruction-set path the native kernels take, and the entry points of the paths that
// live in their own translation units (compiled for their own target, see linear_avx512.cpp).
//
// The path is chosen once per process from cpuid (the widest the CPU has: AVX512-BF16, AVX-512,
// AVX2) and can be forced to any path the CPU supports through the `set_isa` op, so tests and
// benchmarks run every path a machine has. Each path keeps batch invariance on its own: a row's
// result never depends on the batch, whatever path computed it. AVX2 and AVX-512 give the same bits for the linear (the same
// per-lane FMA chains, only wider); AVX512-BF16 multiplies bf16 pairs in one instruction, a
// different rounding, so its bits are its own.
#pragma once

#include <cstdint>

namespace deepserve_cpu {

enum class Isa : int { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2 };

Isa isa();

// One thread's share of a linear (panels [p0, p1) for every row), kernels/cpu/csrc/linear.cpp's
// panel layout: x [M, K] row-major, w [P, K, 16], y [M, N].
void linear_panels_avx512_f32(const float* x, int64_t M, int64_t K, const float* w, float* y,
                              int64_t N, int64_t p0, int64_t p1);
void linear_panels_avx512_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, float* y,
                               int64_t N, int64_t p0, int64_t p1);
// bfloat16 rows against bfloat16 panels with vdpbf16ps (AVX512-BF16).
void linear_panels_avx512bf16_dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                                  float* y, int64_t N, int64_t p0, int64_t p1);
// The same, y stored as bfloat16 (each output rounded as a cast of the float32 one rounds).
void linear_panels_avx512bf16_dot(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                                  uint16_t* y, int64_t N, int64_t p0, int64_t p1);

// bfloat16 elementwise rows, 16 lanes a step (elementwise_avx512.cpp): each does a row's first
// multiple of 16 elements, with the AVX2 code's bits, and returns how many it did.
int64_t widen_row_bf16_avx512(uint16_t* h, const uint16_t* delta, float* xf, int64_t n);
int64_t scale_row_bf16_avx512(const float* x, const uint16_t* w, float r, uint16_t* out,
                              int64_t n);
int64_t silu_mul_row_bf16_avx512(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n);
}  // namespace deepserve_cpu
