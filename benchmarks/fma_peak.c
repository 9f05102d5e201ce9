// The FMA ceiling of this CPU: every thread runs 12 independent chains of 256-bit fused
// multiply-adds (enough to cover the FMA latency on two pipes), nothing else. A matmul cannot
// beat this rate; benchmarks/RESULTS.md divides FLOP counts by it.
//
//     gcc -O2 -mavx2 -mfma -pthread benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak 1 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { kChains = 12, kFlopsPerFma = 16 };  // 8 lanes x (multiply + add)
static const long kIters = 200000000;
static volatile float sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* spin(void* unused) {
  (void)unused;
  __m256 a[kChains];
  const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < kChains; i++) a[i] = _mm256_set1_ps((float)i);
  for (long k = 0; k < kIters; k++) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
  }
  float s = 0, lanes[8];
  for (int i = 0; i < kChains; i++) {
    _mm256_storeu_ps(lanes, a[i]);
    s += lanes[0];
  }
  sink = s;  // keeps the chains live
  return NULL;
}

int main(int argc, char** argv) {
  for (int arg = 1; arg < argc; arg++) {
    const int threads = atoi(argv[arg]);
    pthread_t tid[64];
    const double t0 = now();
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, spin, NULL);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    const double flops = (double)threads * kIters * kChains * kFlopsPerFma;
    printf("%d thread(s): %.1f GFLOP/s\n", threads, flops / (now() - t0) / 1e9);
  }
  return 0;
}
