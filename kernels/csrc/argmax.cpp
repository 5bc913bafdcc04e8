// Each row's argmax, the first index on ties, as torch's `max(dim=-1)`
// returns it: the greedy sampler's choice over the vocabulary. torch's
// reduction took 1.3 ms for 32 rows of 49,152 on the Zen 4 on one thread
// or two (3% of a 2-thread decode step); here each lane keeps the first of
// its largest values, the lanes are compared once at the end, and the rows
// run in parallel.
//
// A row holding NaN answers its first NaN (torch's max propagates NaN); a row
// of -inf answers 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "vec.h"

namespace sf {
namespace {

constexpr int CHAINS = 4;  // independent (max, index) pairs a row, so compares overlap

int64_t argmax_row(const float* x, int64_t n) {
  const int64_t wide = n / (W * CHAINS) * (W * CHAINS);
  vf best[CHAINS];
  vi at[CHAINS];
  vi lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  for (int c = 0; c < CHAINS; ++c) best[c] = splat(-std::numeric_limits<float>::infinity()), at[c] = vi{};
  vi nan{};
  for (int64_t j = 0; j < wide; j += W * CHAINS)
    for (int c = 0; c < CHAINS; ++c) {
      const vf v = load(x + j + c * W);
      const vi idx = lane + static_cast<int32_t>(j + c * W);
      const vi more = v > best[c];  // strict: a lane keeps its first index on ties
      best[c] = more ? v : best[c];
      at[c] = more ? idx : at[c];
      nan |= v != v;
    }
  float top = -std::numeric_limits<float>::infinity();
  int64_t first = 0;
  for (int c = 0; c < CHAINS; ++c)
    for (int i = 0; i < W; ++i)
      if (best[c][i] > top || (best[c][i] == top && at[c][i] < first)) top = best[c][i], first = at[c][i];
  for (int64_t j = wide; j < n; ++j) {  // the tail, in order: later indices win only by being larger
    if (x[j] != x[j]) nan[0] = -1;
    if (x[j] > top) top = x[j], first = j;
  }
  bool any_nan = false;
  for (int i = 0; i < W; ++i) any_nan |= nan[i] != 0;
  if (any_nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return first;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: float32 [rows, n], the last dim contiguous");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "logits: 1 to 2^31 - 1 columns");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = argmax_row(x + r * ld, n);
  });
  return out;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &sf::argmax_rows);
}
