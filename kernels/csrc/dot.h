// The bf16 micro-kernel of AVX512-BF16's dot-product instruction, shared by
// the linear layers (dot_gemm.cpp) and the prefill attention tiles
// (attention.cpp). `vdpbf16ps` multiplies 16 pairs of bf16 and adds both
// products to 16 float32 sums: twice a float32 FMA's arithmetic, neither
// operand widened. A bf16 product is exact in float32, so only the order of
// the sums differs from a float32 GEMM of the same values.
//
// B is in pairs along K ("VNNI"): element (k, n) at [k / 2][n][k % 2], rows
// of pairs `ldb` columns wide. A register tile is R rows x 32 columns
// (R <= 14: 28 accumulators, two B vectors, one broadcast pair of A).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace sf {

#if defined(__AVX512BF16__)
constexpr bool DOT = true;
#else
constexpr bool DOT = false;
#endif

constexpr int DOT_COLS = 32;  // columns of a register tile (two vectors)
constexpr int DOT_ROWS = 14;  // most rows of a register tile

// Lines [0, lines) of the weight block after this one, which a register tile
// asks for into L2 while it runs, `per` of them a k pair (dot_row_tiles_ahead).
struct NextBlock {
  const char* p = nullptr;
  int64_t lines = 0;
  int per = 0;
};

#if defined(__AVX512BF16__)
// acc[r] += A[r][2kp..2kp+1] . B[kp][0..32) for one k pair: rows of A `lda`
// apart, rows of B pairs `ldb` columns wide.
template <int R>
inline void dot_step(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t kp, __m512 (*acc)[2]) {
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + kp * 2 * ldb);
  const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + kp * 2 * ldb + 32);
  for (int r = 0; r < R; ++r) {
    int32_t pair;
    std::memcpy(&pair, a + r * lda + 2 * kp, sizeof(pair));
    const __m512bh ab = (__m512bh)_mm512_set1_epi32(pair);
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ab, b0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ab, b1);
  }
}

// acc[r] = sum over k pairs of A[r][2kp..2kp+1] . B[kp][0..32).
template <int R>
inline void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t k_pairs,
                     __m512 (*acc)[2], const NextBlock& next) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    for (int j = 0; j < next.per; ++j)
      if (kp * next.per + j < next.lines) _mm_prefetch(next.p + (kp * next.per + j) * 64, _MM_HINT_T1);
    dot_step<R>(a, lda, b, ldb, kp, acc);
  }
}

// acc[r] (+)= into C's float32 rows `ldc` apart.
template <int R>
inline void store_tile(__m512 (*acc)[2], float* c, int64_t ldc, bool add) {
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (add) acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(cr));
    if (add) acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(cr + 16));
    _mm512_storeu_ps(cr, acc[r][0]), _mm512_storeu_ps(cr + 16, acc[r][1]);
  }
}

// C[R rows][32] (+)= A B for one register tile, C float32 rows `ldc` apart.
template <int R>
void dot_tile_f32(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t k_pairs, float* c,
                  int64_t ldc, bool add, const NextBlock& next) {
  __m512 acc[R][2];
  dot_tile<R>(a, lda, b, ldb, k_pairs, acc, next);
  store_tile<R>(acc, c, ldc, add);
}

template <template <int> class F, size_t... R>
constexpr auto dot_tiles(std::index_sequence<R...>) {
  return std::array{&F<R + 1>::run...};
}

// Calls tiles[n - 1](row0, n) for M rows in tiles of at most DOT_ROWS, as
// equal as can be: a short tile costs nearly as much as a full one.
template <typename Fn>
inline void dot_row_tiles(int64_t M, Fn&& fn) {
  const int64_t count = (M + DOT_ROWS - 1) / DOT_ROWS;
  for (int64_t t = 0, r = 0; t < count; ++t) {
    const int64_t n = (M - r + count - t - 1) / (count - t);
    fn(r, static_cast<int>(n));
    r += n;
  }
}

// dot_row_tiles over one weight block of k_pairs pairs (a register tile
// reads it whole), with `next` the block the caller takes after it (null:
// none): fn(row0, n, share) where share is the part of `next` that tile asks
// for. The first tile reads this block from memory; the others read it from
// cache, and the memory would idle meanwhile: they ask for the next block,
// split among them, so the next first tile finds it in L2. 32 decode rows'
// GEMMs over cold weights ran at 75 % of the peak on 2 threads, over weights
// in L3 at 87 %; the first tile of each block waited on memory.
template <typename Fn>
inline void dot_row_tiles_ahead(int64_t M, int64_t k_pairs, const void* next, Fn&& fn) {
  const int64_t tiles = (M + DOT_ROWS - 1) / DOT_ROWS, lines = k_pairs * DOT_COLS * 2 * 2 / 64;
  const int64_t share = tiles > 1 ? (lines + tiles - 2) / (tiles - 1) : 0;  // lines a later tile asks for
  int64_t t = 0;
  dot_row_tiles(M, [&](int64_t r, int n) {
    NextBlock ahead;
    if (next && t > 0 && (t - 1) * share < lines)
      ahead = {static_cast<const char*>(next) + (t - 1) * share * 64, std::min(share, lines - (t - 1) * share),
               static_cast<int>((share + k_pairs - 1) / k_pairs)};
    fn(r, n, ahead);
    ++t;
  });
}

template <int R>
struct DotF32 {
  static void run(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t k_pairs, float* c,
                  int64_t ldc, bool add, const NextBlock& next) {
    dot_tile_f32<R>(a, lda, b, ldb, k_pairs, c, ldc, add, next);
  }
};

// The same tile over KP pairs known when compiled (the prefill attention's:
// a head's width, a KV tile's tokens), its loop unrolled by 8. Such short
// loops ran well below the peak with their count at run time: two 14 x 32
// tiles in a row, hot in L1 on the Zen 4, at 16 and 32 pairs 149-169 and
// 185-197 GFLOP/s against 200-204 and 212-218 unrolled (peak ~230; at 288
// pairs, the linear layers' K, the loop reaches 228).
template <int KP>
struct DotF32Fixed {
  template <int R>
  struct Tile {
    static void run(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                    bool add) {
      __m512 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int kp = 0; kp < KP; ++kp) dot_step<R>(a, lda, b, ldb, kp, acc);
      store_tile<R>(acc, c, ldc, add);
    }
  };
};

// C[M][N] (+)= A[M][K] B[K][N] with A bf16 row-major, B bf16 in pairs along
// K ([K/2][ldb][2], the first N columns used), C float32 row-major; N a
// multiple of 32, K even. A B of one block (N = ldb = 32) may name the block
// the caller takes next (dot_row_tiles_ahead).
inline void dot_gemm_f32(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, bool add, const uint16_t* next = nullptr) {
  static constexpr auto tiles = dot_tiles<DotF32>(std::make_index_sequence<DOT_ROWS>{});
  if (N == DOT_COLS && ldb == DOT_COLS) {
    dot_row_tiles_ahead(M, K / 2, next, [&](int64_t r, int n, const NextBlock& ahead) {
      tiles[n - 1](a + r * lda, lda, b, ldb, K / 2, c + r * ldc, ldc, add, ahead);
    });
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += DOT_COLS)
    dot_row_tiles(M, [&](int64_t r, int n) {
      tiles[n - 1](a + r * lda, lda, b + 2 * n0, ldb, K / 2, c + r * ldc + n0, ldc, add, NextBlock{});
    });
}
#endif

}  // namespace sf
