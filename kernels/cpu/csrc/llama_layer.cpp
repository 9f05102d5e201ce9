// One llama decoder layer (GQA attention with RoPE, SwiGLU MLP, residual adds and RMSNorms) as a
// single op that calls the other native ops in the order engine/models/llama.py does, with the
// same arguments: the same bits, without the ~10 trips through Python and the dispatcher per
// layer that cost a few milliseconds of a ~15 ms batch-1 decode step.
//
// The ops are reached through the dispatcher (looked up once), so each keeps its own file and
// this one holds no arithmetic of its own.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using LinearQuant = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using AddNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Rope = void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                  const at::Tensor&, int64_t, int64_t);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);

template <class Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<Linear> linear = find<Linear>("deepserve_cpu::linear");
  c10::TypedOperatorHandle<Linear> linear_bf16 = find<Linear>("deepserve_cpu::linear_bf16");
  c10::TypedOperatorHandle<LinearQuant> linear_quant =
      find<LinearQuant>("deepserve_cpu::linear_quant");
  c10::TypedOperatorHandle<AddNorm> add_rms_norm = find<AddNorm>("deepserve_cpu::add_rms_norm_");
  c10::TypedOperatorHandle<Rope> rope = find<Rope>("deepserve_cpu::rope_qk_write_kv_");
  c10::TypedOperatorHandle<Attention> attention = find<Attention>("deepserve_cpu::paged_attention");
  c10::TypedOperatorHandle<SiluMul> silu_mul = find<SiluMul>("deepserve_cpu::silu_mul");
};

const Ops& ops() {
  static const Ops instance;  // after every file's registrations: built on the first call
  return instance;
}

// kernels/cpu/packed.py's `linear` for a PackedWeight: weights[i] are its panels (float32, or
// bfloat16 for bfloat16 rows, whose output is bfloat16 as well), weights[i + 1] its quantized
// blocks (empty when it has none), read by calls of at most `quant_max_rows` rows.
at::Tensor matmul(const at::Tensor& x, at::TensorList weights, int64_t i, int64_t format,
                  int64_t n, int64_t quant_max_rows) {
  const at::Tensor& quant = weights[i + 1];
  if (quant.numel() > 0 && x.size(0) <= quant_max_rows) {
    return ops().linear_quant.call(x, quant, n, format);
  }
  if (x.scalar_type() == at::kBFloat16) return ops().linear_bf16.call(x, weights[i], n);
  return ops().linear.call(x, weights[i], n);
}

// `h` (the residual stream) is updated in place; returns the next layer's normed input.
// weights: qkv, o, gate_up, down as (panels, quant) pairs; formats and outs: theirs, in order.
at::Tensor llama_layer_(at::Tensor& h, const at::Tensor& x, at::TensorList weights,
                        at::IntArrayRef formats, at::IntArrayRef outs,
                        const at::Tensor& mlp_norm, const at::Tensor& next_norm,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                        const at::Tensor& block_tables, int64_t hq, int64_t hkv, double eps,
                        double scale, int64_t quant_max_rows) {
  TORCH_CHECK(weights.size() == 8 && formats.size() == 4 && outs.size() == 4,
              "llama_layer_ takes 4 weights as (panels, quant) pairs");
  const int64_t tokens = x.size(0), d = k_cache.size(-1);
  auto mm = [&](const at::Tensor& in, int64_t w) {
    return matmul(in, weights, 2 * w, formats[w], outs[w], quant_max_rows);
  };
  at::Tensor qkv = mm(x, 0);
  ops().rope.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv);
  const at::Tensor q = qkv.narrow(1, 0, hq * d).view({tokens, hq, d});
  const at::Tensor attn = ops().attention.call(q, k_cache, v_cache, query_start_loc, seq_lens,
                                               block_tables, scale);
  at::Tensor normed = ops().add_rms_norm.call(h, mm(attn.reshape({tokens, hq * d}), 1),
                                              mlp_norm, eps);
  const at::Tensor act = ops().silu_mul.call(mm(normed, 2));
  return ops().add_rms_norm.call(h, mm(act, 3), next_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m) {
  m.def(
      "llama_layer_(Tensor(a!) h, Tensor x, Tensor[] weights, int[] formats, int[] outs, "
      "Tensor mlp_norm, Tensor next_norm, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, int hq, int hkv, float eps, float scale, int quant_max_rows) -> Tensor",
      &llama_layer_);
}
