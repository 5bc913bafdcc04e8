// Portable SIMD for the CPU kernels: GCC vector extensions, so one source
// compiles to AVX2 or AVX-512 by the -m flags the build picks at run time.
// All arithmetic is float32; bf16 is only a storage format (loads widen by a
// shift, stores round to nearest even).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sf {

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

inline vf splat(float x) {  // one broadcast (`vf{} + x` costs an add; a lane loop, inserts)
  const vf v{x};
  return __builtin_shuffle(v, vi{});
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf load(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // one widening load and a shift (GCC's convertvector split it in halves)
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vf)_mm512_slli_epi32(u, 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline void store(c10::BFloat16* p, vf v) {
#if defined(__AVX512BF16__)  // one vcvtneps2bf16: the same rounding, values below 2^-126 to 0
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  vu u = (vu)v;
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof(h));
#endif
}

// W bytes widened to W int32 lanes (one vpmovzx/sx; GCC's convertvector
// of byte vectors extracts them one by one).
inline vi widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vi v;
  for (int i = 0; i < W; ++i) v[i] = p[i];
  return v;
#endif
}

inline vi widen(const int8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vi v;
  for (int i = 0; i < W; ++i) v[i] = p[i];
  return v;
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Horizontal sum and max by halving shuffles (log2(W) steps) rather than W
// dependent scalar operations: the lane loop showed as a fifth of the float32
// prefill tile's own samples under perf (the tile's time moved within noise).
// To the nearest integer, ties to even (the default rounding mode), as std::nearbyint.
inline vi vround(vf x) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtps_epi32((__m512)x);
#elif defined(__AVX2__)
  return (vi)_mm256_cvtps_epi32((__m256)x);
#else
  vi r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<int32_t>(std::nearbyint(x[i]));
  return r;
#endif
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#else
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// out[j] = hsum(d[j]) for W vectors: log2(W) rounds of pairwise
// shuffle-and-add, ~2 instructions a sum instead of a W-lane scalar loop.
inline vf reduce_lanes(vf* d) {
#if defined(__AVX512F__)
  const vi e0 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi e1 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi e2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi e3 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi masks[] = {e0, e1, e2, e3};
#else
  const vi e0 = {0, 8, 2, 10, 4, 12, 6, 14};
  const vi e1 = {0, 1, 8, 9, 4, 5, 12, 13};
  const vi e2 = {0, 1, 2, 3, 8, 9, 10, 11};
  const vi masks[] = {e0, e1, e2};
#endif
  int n = W, g = 1;
  for (const vi& e : masks) {  // after round r, d[i] holds 2^(r+1) tokens' partial sums
    for (int i = 0; i < n / 2; ++i)
      d[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], e) + __builtin_shuffle(d[2 * i], d[2 * i + 1], e + g);
    n /= 2, g *= 2;
  }
  return d[0];
}

// Bit i set where lane i of a comparison's result is true.
inline unsigned lanes_set(vi m) {
#if defined(__AVX512F__)
  return _mm512_movepi32_mask((__m512i)m);
#elif defined(__AVX2__)
  return static_cast<unsigned>(_mm256_movemask_ps((__m256)m));
#else
  unsigned bits = 0;
  for (int i = 0; i < W; ++i) bits |= (m[i] != 0) << i;
  return bits;
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// exp(x) for x in float range: 2^n * 2^f, n = round(x log2 e), |f| <= 1/2,
// 2^f by its degree-6 Taylor series (relative error ~1e-7). Inputs are
// clamped to [-87, 88], so exp(-inf) gives ~1e-38, not 0: callers zero
// masked entries themselves.
inline vf vexp(vf x) {
  x = vmin(vmax(x, splat(-87.f)), splat(88.f));
  vf t = x * 1.44269504088896341f;
  vf r = (t + 12582912.f) - 12582912.f;  // round to nearest integer
  vf f = (t - r) * 0.693147180559945309f;
  vf p = splat(1.f / 720);
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  vi n = __builtin_convertvector(r, vi);
  return p * (vf)((n + 127) << 23);
}

// 2^x for x <= 0 (clamped below at -126: masked -inf entries give ~1e-38,
// not 0): 2^n * 2^f, n = round(x), |f| <= 1/2, 2^f by the Taylor series of
// e^(f ln 2) to degree DEG: relative error 5.6e-5 at degree 4 (enough for
// bf16's 8 bits), 1.2e-7 at degree 6. AVX-512 rounds and scales by 2^n in
// one instruction each.
template <int DEG>
inline vf vexp2(vf x) {
  constexpr auto coef = [] {  // (ln 2)^k / k!
    std::array<float, DEG + 1> c{};
    double f = 1.0;
    for (int k = 0; k <= DEG; ++k) c[k] = static_cast<float>(f *= (k ? 0.693147180559945309 / k : 1.0));
    return c;
  }();
  x = vmax(x, splat(-126.f));
#if defined(__AVX512F__)
  const vf r = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf r = (x + 12582912.f) - 12582912.f;  // round to nearest integer
#endif
  const vf f = x - r;
  vf p = splat(coef[DEG]);
  for (int k = DEG - 1; k >= 0; --k) p = p * f + coef[k];
#if defined(__AVX512F__)
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)r);
#else
  return p * (vf)((__builtin_convertvector(r, vi) + 127) << 23);
#endif
}

#if defined(__AVX512F__)
// 2^x for results rounded to bf16 (8 bits), x finite: 2^n * 2^f as vexp2's,
// 2^f by the cubic fitted to it over [-1/2, 1/2] (relative error 7.5e-5,
// vexp2<4>'s Taylor series 5.6e-5) in one FMA fewer, and no clamp (below
// -126 the scaling gives a subnormal or 0; an infinity would give NaN).
inline vf vexp2_bf16(vf x) {
  const vf r = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = x - r;
  const vf p = ((0.05517146f * f + 0.24261086f) * f + 0.69326099f) * f + 0.99992809f;
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)r);
}
#endif

// 1 / x for x >= 1: with AVX-512 the 14-bit estimate and one Newton step
// (relative error ~2^-27), a quarter of a division's time.
inline vf reciprocal(vf x) {
#if defined(__AVX512F__)
  const vf r = (vf)_mm512_rcp14_ps((__m512)x);
  return r * (2.f - x * r);
#else
  return 1.f / x;
#endif
}

// a * sigmoid(a) = a / (1 + 2^(-a log2 e)), the power clamped to 2^126 (a
// below -87: the product is a * ~1e-38, as the division's would be), on
// vexp2's rounding and scaling instructions and the reciprocal above: fewer
// instructions than vexp's and a division. Alone this measured level; the
// bf16 loads and stores (above) were where a 248-row call's time went
// (silu_mul, elementwise.cpp).
inline vf silu(vf a) {
  const vf e = vexp2<6>(vmin(a * -1.44269504088896341f, splat(126.f)));
  return a * reciprocal(1.f + e);
}

}  // namespace sf
