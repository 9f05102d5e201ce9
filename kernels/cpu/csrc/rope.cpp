// RoPE on the fused q|k|v projection, in place, plus the KV-cache write, in one pass per token:
// what torch does as two slices, four multiplies, an add, a subtract and a concatenation for the
// rotation and two index_copy_ calls for the cache. The rotation multiplies and adds separately
// (no FMA), as torch's elementwise ops do, so float32 results are bitwise torch's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>

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

inline void store_head(const float* src, float* cache, int64_t slot, int64_t block_size,
                       const at::IntArrayRef st, int64_t head, int64_t d) {
  float* dst = cache + (slot / block_size) * st[0] + (slot % block_size) * st[1] + head * st[2];
  std::memcpy(dst, src, d * sizeof(float));
}

// qkv [T, (hq + 2 hkv) * d]: rotate q and k heads of each token, then store its k and v heads
// at slot_mapping[t] of k_cache / v_cache [blocks, block_size, hkv, d] (strided views).
void rope_qk_write_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous");
  const int64_t tokens = qkv.size(0), d = k_cache.size(3), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && cos.size(-1) == half, "shape mismatch");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t bs = k_cache.size(1), width = qkv.size(1);
  at::parallel_for(0, tokens, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = base + t * width;
      for (int64_t h = 0; h < hq + hkv; ++h) rotate(row + h * d, cp + t * half, snp + t * half, half);
      for (int64_t h = 0; h < hkv; ++h) {
        store_head(row + (hq + h) * d, kc, sp[t], bs, k_cache.strides(), h, d);
        store_head(row + (hq + hkv + h) * d, vc, sp[t], bs, v_cache.strides(), h, d);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def(
      "rope_qk_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int hq, int hkv) -> ()",
      &rope_qk_write_kv_);
}
