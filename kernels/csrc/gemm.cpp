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
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <array>
#include <utility>
#include <vector>

#include "vec.h"
#include "vnni.h"

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

// ---- bf16 operands by oneDNN's brgemm (AMX where present) ------------------
// Weights are packed once into VNNI pairs, in blocks of 64 output columns
// (vnni.h). Products are summed in float32; the layers whose
// outputs join the float32 residual stream (attention out, MLP down) keep
// them (a bf16 GEMM's output rounding moved the embedded model's first
// answer token), the others round them to bf16 once.
bool bf16_brgemm() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor pack_bf16(const at::Tensor& w) {  // w [N, K] bf16
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0 && w.size(0) % NBLK == 0,
              "w: bf16 [N, K], N a multiple of 64, K even");
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor wt = w.t().contiguous();  // [K, N]: brgemm's B
  at::Tensor out = at::empty({N * K}, w.options());
  for (int64_t n0 = 0; n0 < N; n0 += NBLK) {
    at::native::cpublas::pack(K, NBLK, N, NBLK, at::kBFloat16, at::kBFloat16, wt.data_ptr<c10::BFloat16>() + n0,
                              out.data_ptr<c10::BFloat16>() + n0 * K);
  }
  return out;
}

// y = x W^T + bias, float32 (float_out) or rounded to bf16.
at::Tensor gemm_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                     bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bf16 [M, K], rows strided");
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.numel() == N * K && N % NBLK == 0,
              "packed weight does not match x");
  TORCH_CHECK(!bias || (bias->numel() == N), "bias: [N]");
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  const int64_t nblocks = N / NBLK, mblocks = (M + MBLK - 1) / MBLK;
  at::parallel_for(0, nblocks * mblocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[MBLK * NBLK];  // a bf16 output's products before rounding
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = (i / mblocks) * NBLK, m0 = (i % mblocks) * MBLK;  // a weight block stays in cache over the rows
      const int64_t mb = std::min<int64_t>(MBLK, M - m0);
      float* yf = float_out ? y.data_ptr<float>() + m0 * N + n0 : c;
      const int64_t ldc = float_out ? N : NBLK;
      at::native::cpublas::brgemm(mb, NBLK, K, lda, NBLK, ldc, false, xp + m0 * lda, wp + n0 * K, yf, true);
      if (!float_out) {
        c10::BFloat16* yb = y.data_ptr<c10::BFloat16>() + m0 * N + n0;
        for (int64_t r = 0; r < mb; ++r)
          for (int64_t j = 0; j < NBLK; j += W) {
            vf v = load(c + r * NBLK + j);
            if (bp) v += load(bp + n0 + j);
            store(yb + r * N + j, v);
          }
      } else if (bp) {
        for (int64_t r = 0; r < mb; ++r)
          for (int64_t j = 0; j < NBLK; j += W) store(yf + r * N + j, load(yf + r * N + j) + load(bp + n0 + j));
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// ---- int8 products for chunk-sized batches (`--compute int8`) ----------------
// Weights as int8 with one scale per output column (w ~ scale[n] * q[n][k]),
// packed for oneDNN's u8 x s8 brgemm (ATen offers it with AMX-INT8 only); activations
// quantized per row to int8 as llama.cpp does on CPUs, shifted by 128 to u8:
//   y[m][n] = sx[m] * scale[n] * (sum_k (xq[m][k] + 128) q[n][k] - 128 sum_k q[n][k]) + bias[n]
bool int8_brgemm() { return at::native::cpublas::could_pack(at::kChar); }

// w [N, K] float32 -> (packed int8 [N * K], scale [N] float32, shift [N] int32 = 128 * sum_k q)
std::vector<at::Tensor> pack_int8(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % NBLK == 0 && w.size(1) % 64 == 0,
              "w: float32 [N, K], N and K multiples of 64");
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor scale = w.abs().amax(1).clamp_min(1e-12) / 127.0;
  const at::Tensor q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  const at::Tensor shift = q.to(at::kInt).sum(1).mul(128).to(at::kInt);
  const at::Tensor qt = q.t().contiguous();  // [K, N]: brgemm's B
  at::Tensor out = at::empty({N * K}, q.options());
  for (int64_t n0 = 0; n0 < N; n0 += NBLK) {
    at::native::cpublas::pack(K, NBLK, N, NBLK, at::kChar, at::kChar, qt.data_ptr<int8_t>() + n0,
                              out.data_ptr<int8_t>() + n0 * K);
  }
  return {out, scale.contiguous(), shift.contiguous()};
}

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& shift,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = scale.numel();
  TORCH_CHECK(packed.numel() == N * K && N % NBLK == 0 && K % 64 == 0, "packed weight does not match x");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N), "bias: float32 [N]");
  typedef uint8_t vb __attribute__((vector_size(W)));
  std::vector<uint8_t> xq(M * K);
  std::vector<float> sx(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* r = xp + m * K;
      vf mx{};
      for (int64_t k = 0; k < K; k += W) {
        const vf v = load(r + k);
        mx = vmax(mx, vmax(v, -v));
      }
      const float amax = hmax(mx);
      sx[m] = amax > 0.f ? amax / 127.f : 1.f;
      const vf inv = splat(1.f / sx[m]);
      for (int64_t k = 0; k < K; k += W) {
        const vb q = __builtin_convertvector(vround(load(r + k) * inv) + 128, vb);
        std::memcpy(&xq[m * K + k], &q, sizeof(q));
      }
    }
  });
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sw = scale.data_ptr<float>();
  const int32_t* sh = shift.data_ptr<int32_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t nblocks = N / NBLK, mblocks = (M + MBLK - 1) / MBLK;
  at::parallel_for(0, nblocks * mblocks, 1, [&](int64_t begin, int64_t end) {
    int32_t acc[MBLK * NBLK];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = (i / mblocks) * NBLK, m0 = (i % mblocks) * MBLK;
      const int64_t mb = std::min<int64_t>(MBLK, M - m0);
      at::native::cpublas::brgemm(mb, NBLK, K, K, NBLK, NBLK, false, xq.data() + m0 * K, wp + n0 * K, acc, true);
      for (int64_t r = 0; r < mb; ++r) {
        float* out = yp + (m0 + r) * N + n0;
        for (int64_t j = 0; j < NBLK; j += W) {
          vi c;
          std::memcpy(&c, acc + r * NBLK + j, sizeof(c));
          vi s;
          std::memcpy(&s, sh + n0 + j, sizeof(s));
          vf v = __builtin_convertvector(c - s, vf) * (load(sw + n0 + j) * sx[m0 + r]);
          if (bp) v += load(bp + n0 + j);
          store(out + j, v);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

int64_t simd_width() { return W; }

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("simd_width", &sf::simd_width);
  m.def("bf16_brgemm", &sf::bf16_brgemm);
  m.def("int8_brgemm", &sf::int8_brgemm);
  m.def("pack_int8(Tensor w) -> Tensor[]");
  m.impl("pack_int8", c10::DispatchKey::CPU, &sf::pack_int8);
  m.def("gemm_int8(Tensor x, Tensor packed, Tensor scale, Tensor shift, Tensor? bias) -> Tensor");
  m.impl("gemm_int8", c10::DispatchKey::CPU, &sf::gemm_int8);
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.impl("pack_bf16", c10::DispatchKey::CPU, &sf::pack_bf16);
  m.def("gemm_vnni(Tensor x, Tensor packed, int N, Tensor? bias, bool float_out) -> Tensor");
  m.impl("gemm_vnni", c10::DispatchKey::CPU, &sf::gemm_vnni);
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemm_bf16", c10::DispatchKey::CPU, &sf::gemm_bf16);
  m.def("gemm_q8_0(Tensor x, Tensor d, Tensor q, Tensor? bias) -> Tensor");
  m.impl("gemm_q8_0", c10::DispatchKey::CPU, &sf::gemm_q8_0);
  m.def("gemm_q4_1(Tensor x, Tensor d, Tensor m, Tensor q, Tensor? bias) -> Tensor");
  m.impl("gemm_q4_1", c10::DispatchKey::CPU, &sf::gemm_q4_1);
}
