// bf16 linear layers by the dot-product instruction (dot.h): y = x W^T +
// bias for bf16 x [M, K] and a bf16 weight [N, K], the answer rounded once
// to bf16, or kept float32 for the layers that join the float32 residual
// stream.
//
// The weight is packed once (kernels/linear.py) in blocks of 32 output
// columns, each k pair of a column adjacent: [N/32][K/2][32][2]. A register
// tile runs the whole of K; the block's weights come from L1/L2 for every
// row tile. Rows go in panels whose activations stay in L2 across the
// column blocks.
//
// Built only where the compiler targets AVX512-BF16 (the `avx512-bf16` ISA of
// kernels/cpu_build.py); elsewhere `dot_bf16()` is false and the layers keep
// oneDNN's GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>

#include "dot.h"
#include "parallel.h"
#include "vec.h"

namespace sf {
namespace {

constexpr int64_t NB = DOT_COLS;            // output columns per packed block
constexpr int64_t PANEL_BYTES = 256 << 10;  // activation rows kept in L2 across the column blocks

bool dot_bf16() { return DOT; }

// How M rows of K bf16 go in panels: (how many, rows each). Equal rows, none
// over PANEL_BYTES: a short last panel left the thread that got it idle (512
// rows of K = 576 as 224, 224 and 64 ran 1.53x faster on 2 threads than on 1;
// equal thirds, ~1.9x).
std::pair<int64_t, int64_t> row_panels(int64_t M, int64_t K) {
  const int64_t most = std::max<int64_t>(DOT_ROWS, PANEL_BYTES / (2 * K) / DOT_ROWS * DOT_ROWS);
  const int64_t panels = (M + most - 1) / most;
  return {panels, (M + panels - 1) / panels};
}

// w [N, K] bf16 -> [N/32][K/2][32][2]: column n's weights k, k+1 side by side.
at::Tensor pack_dot(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % NB == 0 && w.size(1) % 2 == 0,
              "w: bf16 [N, K], N a multiple of 32, K even");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / NB, NB, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
inline __m512 bias_vec(const void* bias, bool bias_bf16, int64_t n) {
  if (!bias) return _mm512_setzero_ps();
  if (!bias_bf16) return _mm512_loadu_ps(static_cast<const float*>(bias) + n);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(bias) + n));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[R rows][n0, n0 + 32) = x[R rows] . W[block]^T + bias, bf16 or float32
template <int R>
struct Layer {
  static void run(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_pairs, const NextBlock& next,
                  const void* bias, bool bias_bf16, int64_t n0, void* y, int64_t ldy, bool float_out) {
    __m512 acc[R][2];
    dot_tile<R>(x, lda, w, NB, k_pairs, acc, next);
    const __m512 b0 = bias_vec(bias, bias_bf16, n0), b1 = bias_vec(bias, bias_bf16, n0 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 v0 = _mm512_add_ps(acc[r][0], b0), v1 = _mm512_add_ps(acc[r][1], b1);
      if (float_out) {
        float* out = static_cast<float*>(y) + r * ldy + n0;
        _mm512_storeu_ps(out, v0), _mm512_storeu_ps(out + 16, v1);
      } else {
        uint16_t* out = static_cast<uint16_t*>(y) + r * ldy + n0;
        _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));  // round to nearest even
      }
    }
  }
};

// The gate and up projections in one: a block packed by pack_dot_gated holds
// 16 gate columns and the 16 up columns of the same outputs, so the tile's two
// accumulator vectors are gate and up of 16 outputs: y[R rows][o0, o0 + 16) =
// silu(gate) * up, rounded once to bf16 (no gate_up tensor written and read back).
template <int R>
struct Gated {
  static void run(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k_pairs, const NextBlock& next,
                  int64_t o0, uint16_t* y, int64_t ldy) {
    __m512 acc[R][2];
    dot_tile<R>(x, lda, w, NB, k_pairs, acc, next);
    for (int r = 0; r < R; ++r) {
      const vf v = silu((vf)acc[r][0]) * (vf)acc[r][1];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + o0), (__m256i)_mm512_cvtneps_pbh((__m512)v));
    }
  }
};
#endif

// w [2F, K] bf16, gate rows then up rows -> pack_dot's layout of [2F, K] whose
// block j holds gate rows [16j, 16j + 16) then up rows [16j, 16j + 16).
at::Tensor pack_dot_gated(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % NB == 0, "w: [2F, K], F a multiple of 16");
  const int64_t F = w.size(0) / 2, K = w.size(1);
  const at::Tensor halves = w.contiguous().view({2, F / (NB / 2), NB / 2, K});
  return pack_dot(halves.transpose(0, 1).reshape({2 * F, K}));
}

// y = x W^T + bias: bf16 (rounded once) or, with float_out, float32.
at::Tensor gemm_dot(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                    bool float_out) {
  TORCH_CHECK(DOT, "gemm_dot: this build has no AVX512-BF16 (kernels/cpu_build.py picks the avx512-bf16 ISA)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();  // rows may be strided
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == NB && packed.size(3) == 2,
              "packed: pack_dot's [N/32][K/2][32][2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), N = packed.size(0) * NB;
  TORCH_CHECK(K == 2 * K2, "x and the packed weight disagree on K");
  TORCH_CHECK(!bias || ((bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) &&
                        bias->is_contiguous() && bias->numel() == N),
              "bias: float32 or bf16 [N]");
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__)
  const int64_t lda = x.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const void* bp = bias ? bias->data_ptr() : nullptr;
  const bool bias_bf16 = bias && bias->scalar_type() == at::kBFloat16;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t esize = float_out ? 4 : 2;
  static constexpr auto tiles = dot_tiles<Layer>(std::make_index_sequence<DOT_ROWS>{});
  const std::pair<int64_t, int64_t> split = row_panels(M, K);
  const int64_t panels = split.first, panel = split.second, blocks = N / NB;
  parallel_items(panels * blocks, [&](int64_t i, bool own) {
    const int64_t p = i / blocks, blk = i % blocks, n0 = blk * NB;
    const int64_t m0 = p * panel, rows = std::min(panel, M - m0);
    const uint16_t* next = own && blk + 1 < blocks ? wp + (blk + 1) * K2 * 2 * NB : nullptr;
    dot_row_tiles_ahead(rows, K2, next, [&](int64_t r, int n, const NextBlock& ahead) {
      tiles[n - 1](xp + (m0 + r) * lda, lda, wp + blk * K2 * 2 * NB, K2, ahead, bp, bias_bf16, n0,
                   yp + (m0 + r) * N * esize, N, float_out);
    });
  });
#endif
  return y;
}

// silu(x W_gate^T) * (x W_up^T), bf16 [M, F], over pack_dot_gated's weight.
at::Tensor gemm_dot_silu(const at::Tensor& x_in, const at::Tensor& packed) {
  TORCH_CHECK(DOT, "gemm_dot_silu: this build has no AVX512-BF16 (kernels/cpu_build.py picks the avx512-bf16 ISA)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == NB && packed.size(3) == 2,
              "packed: pack_dot_gated's [2F/32][K/2][32][2]");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), blocks = packed.size(0), F = blocks * NB / 2;
  TORCH_CHECK(K == 2 * K2, "x and the packed weight disagree on K");
  at::Tensor y = at::empty({M, F}, x.options());
#if defined(__AVX512BF16__)
  const int64_t lda = x.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  static constexpr auto tiles = dot_tiles<Gated>(std::make_index_sequence<DOT_ROWS>{});
  const std::pair<int64_t, int64_t> split = row_panels(M, K);
  const int64_t panels = split.first, panel = split.second;
  parallel_items(panels * blocks, [&](int64_t i, bool own) {
    const int64_t p = i / blocks, blk = i % blocks;
    const int64_t m0 = p * panel, rows = std::min(panel, M - m0);
    const uint16_t* next = own && blk + 1 < blocks ? wp + (blk + 1) * K2 * 2 * NB : nullptr;
    dot_row_tiles_ahead(rows, K2, next, [&](int64_t r, int n, const NextBlock& ahead) {
      tiles[n - 1](xp + (m0 + r) * lda, lda, wp + blk * K2 * 2 * NB, K2, ahead, blk * NB / 2, yp + (m0 + r) * F, F);
    });
  });
#endif
  return y;
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("dot_bf16", &sf::dot_bf16);
  m.def("pack_dot(Tensor w) -> Tensor");
  m.impl("pack_dot", c10::DispatchKey::CPU, &sf::pack_dot);
  m.def("pack_dot_gated(Tensor w) -> Tensor");
  m.impl("pack_dot_gated", c10::DispatchKey::CPU, &sf::pack_dot_gated);
  m.def("gemm_dot_silu(Tensor x, Tensor packed) -> Tensor");
  m.impl("gemm_dot_silu", c10::DispatchKey::CPU, &sf::gemm_dot_silu);
  m.def("gemm_dot(Tensor x, Tensor packed, Tensor? bias, bool float_out) -> Tensor");
  m.impl("gemm_dot", c10::DispatchKey::CPU, &sf::gemm_dot);
}
