// The screened head's rechecks (kernels/screened_head.py): in each row of
// screened logits, every entry that could still be the argmax under its
// error bound E_v = scale[row] * norms[v] + flushed is recomputed in float32
// and written over its screened value. Two passes over the row: the floor
// max_v(screen_v - E_v), then the entries with screen_v + E_v at or above it.
// Rows run in parallel; a row's passes read its V logits and the V norms once each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "vec.h"

namespace sf {
namespace {

float dot(const float* a, const float* b, int64_t K) {
  vf acc{};
  int64_t k = 0;
  for (; k + W <= K; k += W) acc += load(a + k) * load(b + k);
  float s = hsum(acc);
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}

// Returns how many entries were rechecked (all rows together).
int64_t screen_recheck(at::Tensor logits, const at::Tensor& x, const at::Tensor& w, const at::Tensor& norms,
                       const at::Tensor& scale, double flushed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == R,
              "x: contiguous float32 [R, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == V && w.size(1) == K,
              "w: contiguous float32 [V, K]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == V, "norms: float32 [V]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == R, "scale: float32 [R]");
  float* lp = logits.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *np = norms.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float fl = static_cast<float>(flushed);
  std::atomic<int64_t> rechecked{0};
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* l = lp + r * V;
      const vf e = splat(sp[r]), f = splat(fl);
      vf m = splat(-std::numeric_limits<float>::infinity());
      int64_t v = 0;
      for (; v + W <= V; v += W) m = vmax(m, load(l + v) - (e * load(np + v) + f));
      float floor = hmax(m);
      for (; v < V; ++v) floor = std::max(floor, l[v] - (sp[r] * np[v] + fl));
      int64_t n = 0;
      for (v = 0; v < V; ++v) {
        if (l[v] + (sp[r] * np[v] + fl) >= floor) {
          l[v] = dot(xp + r * K, wp + v * K, K);
          ++n;
        }
      }
      rechecked += n;
    }
  });
  return rechecked.load();
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("screen_recheck(Tensor(a!) logits, Tensor x, Tensor w, Tensor norms, Tensor scale, float flushed) -> int");
  m.impl("screen_recheck", c10::DispatchKey::CPU, &sf::screen_recheck);
}
