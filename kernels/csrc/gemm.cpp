// Decode-sized GEMMs (a few rows of float32 activations) over compact
// weights: y = x W^T + bias with W read as bf16, GGUF Q8_0 or GGUF Q4_1 and
// widened to float32 in registers. A decode step is a stream through every
// weight of the model, so its time is the bytes read: 2 (bf16), 8.5 (Q8_0)
// or 5 (Q4_1) bits a weight here against 32 for the float32 copy oneDNN
// reads. The widened values equal the float32 weights bit for bit (a bf16
// widens exactly; d*q is exact in float32 for Q8_0 and Q4_1, so d*q + m rounds
// once, as the loader's dequantization does), so only the order of the sums
// differs from the float32 path.
//
// Layouts (packed by kernels/linear.py), B = 2*W output columns per block:
//   bf16  w[N/B][K][B]
//   q8_0  d[N/B][K/32][B] f32, q[N/B][K/32][32][B] int8         w = d*q
//   q4_1  d, m[N/B][K/32][B] f32, q[N/B][K/32][32][W] uint8     w = d*q + m
//         (column j in the low nibble of byte j, column W+j in the high one)
// The micro-kernel keeps an MT x B tile of y in registers and broadcasts x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <utility>
#include <vector>

#include "vec.h"

namespace sf {
namespace {

constexpr int B = 2 * W;  // output columns per block: two vectors
constexpr int QK = 32;    // GGUF quantization block along K
#if defined(__AVX512F__)
constexpr int REGS = 32;  // zmm0-31
#else
constexpr int REGS = 16;  // ymm0-15
#endif

// Rows of a register tile: 2 accumulators a row, two weight vectors and one
// broadcast x, and `extra` registers of the format's own (scales, a widening
// temporary), all in the vector registers. More rows a tile read each weight
// vector fewer times: on AVX-512, 32 registers hold 14 rows where AVX2's 16 hold 6.
constexpr int tile_rows(int extra) { return (REGS - 3 - extra) / 2; }

// One column block's weights for one k, as two float32 vectors.
struct Bf16 {
  static constexpr int MT = tile_rows(0);
  const c10::BFloat16* w;
  int64_t K;
  void begin(int64_t, int64_t) {}
  void at(int64_t blk, int64_t k, vf& w0, vf& w1) const {
    const c10::BFloat16* p = w + (blk * K + k) * B;
    w0 = load(p), w1 = load(p + W);
  }
};

struct Q8_0 {
  static constexpr int MT = tile_rows(3);
  const float* d;
  const int8_t* q;
  int64_t K;
  vf d0, d1;
  void begin(int64_t blk, int64_t kb) {
    const float* p = d + (blk * (K / QK) + kb) * B;
    d0 = load(p), d1 = load(p + W);
  }
  void at(int64_t blk, int64_t k, vf& w0, vf& w1) const {
    const int8_t* p = q + (blk * K + k) * B;
    w0 = d0 * __builtin_convertvector(widen(p), vf), w1 = d1 * __builtin_convertvector(widen(p + W), vf);
  }
};

struct Q4_1 {
  static constexpr int MT = tile_rows(5);
  const float* d;
  const float* m;
  const uint8_t* q;
  int64_t K;
  vf d0, d1, m0, m1;
  void begin(int64_t blk, int64_t kb) {
    const int64_t o = (blk * (K / QK) + kb) * B;
    d0 = load(d + o), d1 = load(d + o + W), m0 = load(m + o), m1 = load(m + o + W);
  }
  void at(int64_t blk, int64_t k, vf& w0, vf& w1) const {
    const vi n = widen(q + (blk * K + k) * W);
    w0 = d0 * __builtin_convertvector(n & 15, vf) + m0;
    w1 = d1 * __builtin_convertvector(n >> 4, vf) + m1;
  }
};

// y[rows, blk*B : blk*B+B] (+)= x[rows, k0:k1] W[k0:k1, block] for `rows` (<= MT)
// rows of x: `add` accumulates onto y (a later slice of K), else starts from
// the bias.
template <int R, typename F>
void tile(F f, int64_t blk, const float* x, int64_t K, int64_t k0, int64_t k1, bool add,
          const float* bias, float* y, int64_t N) {
  float* yb = y + blk * B;
  vf acc[R][2];
  const vf b0 = bias ? load(bias + blk * B) : vf{}, b1 = bias ? load(bias + blk * B + W) : vf{};
  for (int r = 0; r < R; ++r) {
    acc[r][0] = add ? load(yb + r * N) : b0;
    acc[r][1] = add ? load(yb + r * N + W) : b1;
  }
  for (int64_t kb = k0; kb < k1; kb += QK) {
    f.begin(blk, kb / QK);
    for (int64_t k = kb; k < kb + QK; ++k) {
      vf w0, w1;
      f.at(blk, k, w0, w1);
      for (int r = 0; r < R; ++r) {
        const vf xv = splat(x[r * K + k]);
        acc[r][0] += xv * w0;
        acc[r][1] += xv * w1;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store(yb + r * N, acc[r][0]);
    store(yb + r * N + W, acc[r][1]);
  }
}

template <typename F, size_t... R>
constexpr auto tiles_of(std::index_sequence<R...>) {
  return std::array{&tile<R + 1, F>...};
}

// All M rows of y for one column block, in tiles of at most MT rows, as
// equal as can be: a short tile costs nearly as much as a full one (32 rows
// with MT = 14 run as 11, 11, 10, not 14, 14, 4).
template <typename F>
void rows(F f, int64_t blk, int64_t M, const float* x, int64_t K, int64_t k0, int64_t k1, bool add,
          const float* bias, float* y, int64_t N) {
  static constexpr auto tiles = tiles_of<F>(std::make_index_sequence<F::MT>{});
  const int64_t count = (M + F::MT - 1) / F::MT;
  for (int64_t t = 0, r = 0; t < count; ++t) {
    const int64_t n = (M - r + count - t - 1) / (count - t);
    tiles[n - 1](f, blk, x + r * K, K, k0, k1, add, bias, y + r * N, N);
    r += n;
  }
}

// A slice of a column block widened into float32 scratch (blk ignored):
// batches of many tiles widen each weight once, not once per tile.
struct F32 {
  static constexpr int MT = tile_rows(0);
  const float* w;
  int64_t k0;  // the slice's first k
  void begin(int64_t, int64_t) {}
  void at(int64_t, int64_t k, vf& w0, vf& w1) const { w0 = load(w + (k - k0) * B), w1 = load(w + (k - k0) * B + W); }
};

// Rows of K per widened slice: its 32 KiB of float32 stay in L1 for every
// tile that reads them (the whole block's, up to 192 KiB, came from L2).
constexpr int64_t KC = 256;

template <typename F>
at::Tensor run(F f, const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0 && N % B == 0, "K must be a multiple of 32 and N of ", B);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias: float32 [N]");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // column blocks in parallel; each block's weights stay in L1 across the row tiles
  at::parallel_for(0, N / B, 4, [&](int64_t b0, int64_t b1) {
    F g = f;
    // widening into scratch pays off from three tiles on (bench.kernels.linear_kernels)
    const bool widen_once = M > 2 * F::MT;
    std::vector<float> scratch(widen_once ? KC * B : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      if (!widen_once) {
        rows(g, blk, M, xp, K, 0, K, false, bp, yp, N);
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        for (int64_t kb = k0; kb < k1; kb += QK) {
          g.begin(blk, kb / QK);
          for (int64_t k = kb; k < kb + QK; ++k) {
            vf w0, w1;
            g.at(blk, k, w0, w1);
            store(&scratch[(k - k0) * B], w0), store(&scratch[(k - k0) * B + W], w1);
          }
        }
        rows(F32{scratch.data(), k0}, blk, M, xp, K, k0, k1, k0 > 0, bp, yp, N);
      }
    }
  });
  return y;
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == B && w.scalar_type() == at::kBFloat16 && w.is_contiguous());
  TORCH_CHECK(w.size(1) == x.size(1), "x and w disagree on K");
  return run(Bf16{w.data_ptr<c10::BFloat16>(), x.size(1)}, x, w.size(0) * B, bias);
}

at::Tensor gemm_q8_0(const at::Tensor& x, const at::Tensor& d, const at::Tensor& q,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == QK && q.size(3) == B && q.scalar_type() == at::kChar && q.is_contiguous());
  TORCH_CHECK(q.size(1) * QK == x.size(1), "x and q disagree on K");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == q.size(0) * q.size(1) * B);
  return run(Q8_0{d.data_ptr<float>(), q.data_ptr<int8_t>(), x.size(1)}, x, q.size(0) * B, bias);
}

at::Tensor gemm_q4_1(const at::Tensor& x, const at::Tensor& d, const at::Tensor& m, const at::Tensor& q,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == QK && q.size(3) == W && q.scalar_type() == at::kByte && q.is_contiguous());
  TORCH_CHECK(q.size(1) * QK == x.size(1), "x and q disagree on K");
  const int64_t scales = q.size(0) * q.size(1) * B;
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == scales);
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.numel() == scales);
  return run(Q4_1{d.data_ptr<float>(), m.data_ptr<float>(), q.data_ptr<uint8_t>(), x.size(1)}, x, q.size(0) * B,
             bias);
}

int64_t simd_width() { return W; }

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("simd_width", &sf::simd_width);
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemm_bf16", c10::DispatchKey::CPU, &sf::gemm_bf16);
  m.def("gemm_q8_0(Tensor x, Tensor d, Tensor q, Tensor? bias) -> Tensor");
  m.impl("gemm_q8_0", c10::DispatchKey::CPU, &sf::gemm_q8_0);
  m.def("gemm_q4_1(Tensor x, Tensor d, Tensor m, Tensor q, Tensor? bias) -> Tensor");
  m.impl("gemm_q4_1", c10::DispatchKey::CPU, &sf::gemm_q4_1);
}
