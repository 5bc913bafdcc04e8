// A Llama model's decoder layers in one call, where every linear layer runs
// on the dot-product kernel (dot_gemm.cpp): the ops core/model/llama.py's
// loop calls, in its order, on the same tensors, without going back to
// Python between them: that return (dispatch, the wrappers' checks, views)
// is serial, the other threads waiting for it at the next op. 32 streams
// decoding, 8-step blocks alternating in one process (scratch, Zen 4): the
// op-by-op loop's steps took 1.07-1.12x these at 2 threads, 1.09-1.10x at 1.
// Each op through the dispatcher, so it is the registered one (its checks
// included) and the results are the Python loop's, bit for bit.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "parallel.h"

namespace sf {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// h: the embedded tokens (float32 [T, hidden], taken as the residual stream
// and updated in place); returns (the last layer's output, the residual).
std::vector<at::Tensor> dot_layers(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos_sin,
                                   at::TensorList input_norms, at::TensorList post_norms, at::TensorList qkv,
                                   const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                                   at::TensorList gate_up, at::TensorList down, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_start, int64_t heads, int64_t kv_heads, double scale,
                                   double eps) {
  using T = at::Tensor;
  static const auto norm = op<T(const T&, T, const T&, double, bool)>("stallfree::add_rms_norm");
  static const auto gemm = op<T(const T&, const T&, const c10::optional<T>&, bool)>("stallfree::gemm_dot");
  static const auto gated = op<T(const T&, const T&)>("stallfree::gemm_dot_silu");
  static const auto rope = op<void(T, T, const T&, const T&)>("stallfree::rope");
  static const auto write_kv = op<void(T, T, const T&, const T&, const T&)>("stallfree::write_kv");
  static const auto attention =
      op<T(const T&, const T&, const T&, const T&, const T&, const T&, double)>("stallfree::paged_attention");
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(layers > 0 && input_norms.size() == qkv.size() && post_norms.size() == qkv.size() &&
                  qkv_bias.size() == qkv.size() && o.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  down.size() == qkv.size() && k_cache.size(0) == layers && v_cache.size(0) == layers,
              "dot_layers: one of each weight a layer, and a cache layer each");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h: contiguous float32 [T, hidden]");
  const int64_t t = h.size(0), D = k_cache.size(-1), q_size = heads * D, kv_size = kv_heads * D;
  const T residual = h;
  with_team([&] {  // the ops' parallel loops in one team: no barrier between them (parallel.h)
    T x = norm.call(residual, residual, input_norms[0], eps, false);  // the first layer's norm adds nothing
    for (int64_t i = 0; i < layers; ++i) {
      if (i > 0) x = norm.call(h, residual, input_norms[i], eps, true);
      const T y = gemm.call(x, qkv[i], qkv_bias.get(i), false);
      const T q = y.narrow(1, 0, q_size).view({t, heads, D});
      const T k = y.narrow(1, q_size, kv_size).view({t, kv_heads, D});
      const T v = y.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, D});
      rope.call(q, k, positions, cos_sin);
      const T kc = k_cache.select(0, i), vc = v_cache.select(0, i);
      write_kv.call(kc, vc, k, v, slot_mapping);
      const T attn = attention.call(q, kc, vc, block_tables, seq_lens, query_start, scale);
      h = gemm.call(attn.view({t, q_size}), o[i], c10::nullopt, true);
      x = norm.call(h, residual, post_norms[i], eps, true);
      h = gemm.call(gated.call(x, gate_up[i]), down[i], c10::nullopt, true);
    }
  });
  return {h, residual};
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("dot_layers(Tensor(a!) h, Tensor positions, Tensor cos_sin, Tensor[] input_norms, Tensor[] post_norms, "
        "Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
        "int heads, int kv_heads, float scale, float eps) -> Tensor[]");
  m.impl("dot_layers", c10::DispatchKey::CPU, &sf::dot_layers);
}
