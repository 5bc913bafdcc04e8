// Products on oneDNN's batch-reduce GEMM micro-kernel (ATen's cpublas::brgemm):
// bf16 weights packed into VNNI pairs for decode-sized batches (AMX where
// present), and int8 weights for chunk-sized batches (`--compute int8`, AMX-INT8).
// The compact-weight kernels that widen bf16 / Q8_0 / Q4_1 in registers are
// gemm.cpp's; which layer takes which is kernels/linear.py's choice.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"
#include "vnni.h"

namespace sf {
namespace {

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

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
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
}
