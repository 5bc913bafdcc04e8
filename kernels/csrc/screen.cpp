// The screened head (kernels/screened_head.py): the bf16 screen's logits and,
// per row, every entry that could still be the argmax under its error bound
// E_v = scale[row] * norms[v] + flushed recomputed in float32 and written over
// its screened value.
//
// screen: the logits by oneDNN's brgemm over the head packed by pack_bf16
// (AMX), or without AMX by vdpbf16ps (dot.h) over the head packed by
// pack_dot: the same float32 sums of exact bf16 products (both flush
// subnormals, which FLUSHED covers); and while each block of 64 columns is
// still in cache, each row's bounds over it: max(screen_v - E_v) and max(screen_v + E_v). Two passes over
// the whole vocabulary after the GEMM (the floor, then the candidates) read
// 6 MB of logits twice at 32 rows and took 3.6 ms of a decode step on one
// thread of the 2-core Xeon; the bounds are 48 kB.
//
// screen_recheck: per row, the floor max_v(screen_v - E_v) from its blocks'
// bounds, then only the blocks whose upper bound reaches it are read, and
// their entries with screen_v + E_v at or above it rechecked. Rows run in
// parallel. It takes any logits with their bounds (a machine without the
// brgemm screens by torch and computes the bounds the same way).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <tuple>

#include "dot.h"
#include "parallel.h"
#include "vec.h"
#include "vnni.h"

namespace sf {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

float dot(const float* a, const float* b, int64_t K) {
  vf acc{};
  int64_t k = 0;
  for (; k + W <= K; k += W) acc += load(a + k) * load(b + k);
  float s = hsum(acc);
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}

// E_v for W entries: the one expression both ops use, so a block's bounds and
// its entries' tests agree to the last bit.
inline vf bound(vf e, const float* norms, vf flushed) { return e * load(norms) + flushed; }

// bounds [V/NBLK][R][2] of logits [R][V]: for rows [r0, r1) of block b.
void block_bounds(const float* l, int64_t V, int64_t b, int64_t r0, int64_t r1, const float* norms,
                  const float* scale, float flushed, float* bounds, int64_t R) {
  const vf f = splat(flushed);
  for (int64_t r = r0; r < r1; ++r) {
    const vf e = splat(scale[r]);
    vf lo = splat(NEG_INF), hi = splat(NEG_INF);
    for (int64_t j = b * NBLK; j < (b + 1) * NBLK; j += W) {
      const vf x = load(l + r * V + j), eb = bound(e, norms + j, f);
      lo = vmax(lo, x - eb), hi = vmax(hi, x + eb);
    }
    bounds[(b * R + r) * 2] = hmax(lo);
    bounds[(b * R + r) * 2 + 1] = hmax(hi);
  }
}

#if defined(__AVX512BF16__)
// logits [R][V], rows [m0, m0 + mb) of block b's NBLK columns, from the head
// packed by pack_dot ([V/32][K/2][32][2]): the block is two of its blocks.
// `more`: the thread's next item is block b + 1's (its weights are asked for).
void dot_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t b, int64_t m0, int64_t mb, float* l,
               int64_t V, bool more) {
  const int64_t end = (b + 1) * NBLK / DOT_COLS;
  for (int64_t blk = b * NBLK / DOT_COLS; blk < end; ++blk) {
    const uint16_t* next = blk + 1 < end || (more && blk + 1 < V / DOT_COLS) ? w + (blk + 1) * K * DOT_COLS : nullptr;
    dot_gemm_f32(mb, DOT_COLS, K, x + m0 * K, K, w + blk * K * DOT_COLS, DOT_COLS, l + m0 * V + blk * DOT_COLS, V,
                 false, next);
  }
}
#endif

std::tuple<at::Tensor, at::Tensor> screen(const at::Tensor& x, const at::Tensor& packed, int64_t V,
                                          const at::Tensor& norms, const at::Tensor& scale, double flushed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [R, K]");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == V * K &&
                  V % NBLK == 0,
              "packed: the head by pack_bf16 (or pack_dot: 4-d), V a multiple of 64");
  const bool by_dot = packed.dim() == 4;
  TORCH_CHECK(!by_dot || DOT, "screen: a head packed by pack_dot needs AVX512-BF16");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == V, "norms: float32 [V]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == R, "scale: float32 [R]");
  at::Tensor logits = at::empty({R, V}, x.options().dtype(at::kFloat));
  at::Tensor bounds = at::empty({V / NBLK, R, 2}, logits.options());
  const c10::BFloat16 *xp = x.data_ptr<c10::BFloat16>(), *wp = packed.data_ptr<c10::BFloat16>();
  float *lp = logits.data_ptr<float>(), *bp = bounds.data_ptr<float>();
  const float *np = norms.data_ptr<float>(), *sp = scale.data_ptr<float>();
  const int64_t nblocks = V / NBLK, mblocks = (R + MBLK - 1) / MBLK;
  const int64_t items = nblocks * mblocks;
  parallel_items(
      items,
      [&](int64_t i, bool own) {
        const int64_t b = i / mblocks, m0 = (i % mblocks) * MBLK, mb = std::min<int64_t>(MBLK, R - m0);
        if (by_dot) {
#if defined(__AVX512BF16__)
          dot_block(reinterpret_cast<const uint16_t*>(xp), K, reinterpret_cast<const uint16_t*>(wp), b, m0, mb, lp,
                    V, own && i + 1 < items && (i + 1) / mblocks != b);
#endif
        } else {
          at::native::cpublas::brgemm(mb, NBLK, K, K, NBLK, V, false, xp + m0 * K, wp + b * NBLK * K,
                                      lp + m0 * V + b * NBLK, true);
        }
        block_bounds(lp, V, b, m0, m0 + mb, np, sp, static_cast<float>(flushed), bp, R);
      },
      [&] {
        if (!by_dot) at::native::cpublas::brgemm_release(true);
      });
  return {logits, bounds};
}

// Returns how many entries were rechecked (all rows together).
int64_t screen_recheck(at::Tensor logits, const at::Tensor& bounds, const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& norms, const at::Tensor& scale, double flushed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V % NBLK == 0, "V: a multiple of 64");
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.is_contiguous() && bounds.numel() == V / NBLK * R * 2,
              "bounds: float32 [V/64, R, 2]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == R,
              "x: contiguous float32 [R, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == V && w.size(1) == K,
              "w: contiguous float32 [V, K]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == V, "norms: float32 [V]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == R, "scale: float32 [R]");
  float* lp = logits.data_ptr<float>();
  const float *bp = bounds.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float *np = norms.data_ptr<float>(), *sp = scale.data_ptr<float>();
  const vf f = splat(static_cast<float>(flushed));
  const int64_t nblocks = V / NBLK;
  std::atomic<int64_t> rechecked{0};
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float floor = NEG_INF;
      for (int64_t b = 0; b < nblocks; ++b) floor = std::max(floor, bp[(b * R + r) * 2]);
      const vf e = splat(sp[r]), fv = splat(floor);
      float* l = lp + r * V;
      int64_t n = 0;
      for (int64_t b = 0; b < nblocks; ++b) {
        if (bp[(b * R + r) * 2 + 1] < floor) continue;  // no entry of the block reaches the floor
        for (int64_t j = b * NBLK; j < (b + 1) * NBLK; j += W) {
          for (unsigned hit = lanes_set(load(l + j) + bound(e, np + j, f) >= fv); hit; hit &= hit - 1) {
            const int64_t v = j + __builtin_ctz(hit);
            l[v] = dot(xp + r * K, wp + v * K, K);
            ++n;
          }
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
  m.def("screen(Tensor x, Tensor packed, int V, Tensor norms, Tensor scale, float flushed) -> (Tensor, Tensor)");
  m.impl("screen", c10::DispatchKey::CPU, &sf::screen);
  m.def(
      "screen_recheck(Tensor(a!) logits, Tensor bounds, Tensor x, Tensor w, Tensor norms, Tensor scale, "
      "float flushed) -> int");
  m.impl("screen_recheck", c10::DispatchKey::CPU, &sf::screen_recheck);
}
