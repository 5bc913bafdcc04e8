// The machine's limits on one thread, measured: the roofline every kernel is
// judged against (bench.engine.engine_profile, `stallfree profile`).
//   fma_f32     independent vector FMAs in registers: the float32 FMA peak
//   dot_bf16    the same with AVX512-BF16's vdpbf16ps (0 where the build has none)
//   brgemm_*    oneDNN's brgemm micro-kernel on cache-resident operands, the
//               rate the chunk path's products can reach per dtype (AMX tiles
//               for bf16 and int8 where present; AVX-512 / AVX2 FMAs else)
//   read_bw     a vector sum over a buffer far larger than the caches
// Each runs for about `seconds` and reports operations (or bytes) per second.
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <vector>

#include "vec.h"

namespace sf {
namespace {

using Clock = std::chrono::steady_clock;

double elapsed(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Calls fn(reps) with growing reps until it takes `seconds`; returns work per second.
template <typename F>
double rate(double seconds, double work_per_rep, F fn) {
  int64_t reps = 1;
  while (true) {
    const auto t0 = Clock::now();
    fn(reps);
    const double dt = elapsed(t0);
    if (dt >= seconds) return work_per_rep * reps / dt;
    reps = dt > 0 ? std::max<int64_t>(reps * 2, static_cast<int64_t>(reps * seconds / dt * 1.1)) : reps * 16;
  }
}

double fma_f32(double seconds) {
  constexpr int A = 12;  // independent chains: covers FMA latency x ports
  constexpr int INNER = 1024;
  volatile float sink = 0.f;
  const double r = rate(seconds, 2.0 * A * W * INNER, [&](int64_t reps) {
    vf acc[A];
    for (int j = 0; j < A; ++j) acc[j] = splat(1.f + j * 1e-3f);
    const vf b = splat(0.999999f), c = splat(1e-7f);
    for (int64_t i = 0; i < reps; ++i)
      for (int k = 0; k < INNER; ++k)
        for (int j = 0; j < A; ++j) acc[j] = acc[j] * b + c;
    vf s{};
    for (int j = 0; j < A; ++j) s += acc[j];
    sink = sink + hsum(s);
  });
  (void)sink;
  return r;
}

double dot_bf16(double seconds) {
#if defined(__AVX512BF16__)
  constexpr int A = 12;
  constexpr int INNER = 1024;
  volatile float sink = 0.f;
  const double r = rate(seconds, 2.0 * 2 * A * 16 * INNER, [&](int64_t reps) {
    __m512 acc[A];
    for (int j = 0; j < A; ++j) acc[j] = _mm512_set1_ps(1.f + j * 1e-3f);
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.5f));
    for (int64_t i = 0; i < reps; ++i)
      for (int k = 0; k < INNER; ++k)
        for (int j = 0; j < A; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    __m512 s = _mm512_setzero_ps();
    for (int j = 0; j < A; ++j) s = _mm512_add_ps(s, acc[j]);
    sink = sink + _mm512_reduce_add_ps(s);
  });
  (void)sink;
  return r;
#else
  (void)seconds;
  return 0.0;
#endif
}

// M x N x K on operands that stay in L1/L2, B packed as the kernel wants it.
template <typename TA, typename TB, typename TC>
double brgemm_shape(double seconds, bool vnni, at::ScalarType b_type, int64_t M, int64_t N, int64_t K) {
  std::vector<TA> a(M * K, TA(1));
  std::vector<TB> b(K * N, TB(1)), packed(K * N);
  std::vector<TC> c(M * N);
  const TB* bp = b.data();
  if (vnni) {
    if (!at::native::cpublas::could_pack(b_type)) return 0.0;
    at::native::cpublas::pack(K, N, N, N, b_type, b_type, b.data(), packed.data());
    bp = packed.data();
  }
  const double r = rate(seconds, 2.0 * M * N * K, [&](int64_t reps) {
    for (int64_t i = 0; i < reps; ++i) at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), bp, c.data(), vnni);
  });
  at::native::cpublas::brgemm_release(vnni);
  return r;
}

// The best of a few shapes the prefill path uses: on AMX the rate moves a
// lot with the shape (measured 0.5-1.8 TFLOP/s for bf16 on one machine).
template <typename TA, typename TB, typename TC>
double brgemm_rate(double seconds, bool vnni, at::ScalarType b_type) {
  double best = 0.0;
  for (const auto [m, n, k] : {std::tuple{64, 64, 512}, std::tuple{256, 64, 512}, std::tuple{128, 64, 1024}})
    best = std::max(best, brgemm_shape<TA, TB, TC>(seconds / 3, vnni, b_type, m, n, k));
  return best;
}

double read_bw(double seconds) {
  const int64_t n = int64_t(1) << 26;  // 256 MiB of floats
  std::vector<float> buf(n, 1.f);
  volatile float sink = 0.f;
  const double r = rate(seconds, 4.0 * n, [&](int64_t reps) {
    for (int64_t i = 0; i < reps; ++i) {
      vf s0{}, s1{}, s2{}, s3{};
      for (int64_t j = 0; j < n; j += 4 * W) {
        s0 += load(&buf[j]), s1 += load(&buf[j + W]), s2 += load(&buf[j + 2 * W]), s3 += load(&buf[j + 3 * W]);
      }
      sink = sink + hsum(s0 + s1 + s2 + s3);
    }
  });
  (void)sink;
  return r;
}

// {fma_f32, dot_bf16, brgemm_f32, brgemm_bf16, brgemm_int8, read_bw}; 0 where the machine has no such kernel.
std::vector<double> roofline(double seconds) {
  return {
      fma_f32(seconds),
      dot_bf16(seconds),
      brgemm_rate<float, float, float>(seconds, false, at::kFloat),
      brgemm_rate<c10::BFloat16, c10::BFloat16, float>(seconds, true, at::kBFloat16),
      brgemm_rate<uint8_t, int8_t, int32_t>(seconds, true, at::kChar),
      read_bw(seconds),
  };
}

}  // namespace
}  // namespace sf

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("roofline(float seconds) -> float[]", &sf::roofline);
}
