// Paged attention that reads the KV cache in place: no gather copy, no mask
// tensor. One work item is (sequence, KV head, tile of query rows); the query
// heads that share the KV head (GQA) are processed together, so each K/V row
// is loaded once for all of them. Softmax is online (flash style): running
// max and sum per query vector, one pass over the sequence's blocks.
//
// Two score loops: a decode row (one query token) takes dot products straight
// from the cache rows (with AMX: tile products over those rows); a prefill
// tile (many query vectors) packs each KV tile transposed into a small float
// buffer and multiplies as an outer product, so the inner loop is a vector
// FMA over tokens with no horizontal sums.
// Causality is applied only within the chunk: query row i of a chunk with
// prefix p sees keys [0, p + i].
//
// Where oneDNN's batch-reduce GEMM micro-kernel runs here (ATen's
// cpublas::brgemm: AMX tiles for bf16, AVX-512 or AVX2 FMA for float32), a prefill
// tile's two products (Q K^T and P V) go through it instead: the hand-written
// outer product reached a fraction of the FMA peak (bench.kernels.attention_kernels).
// bf16 without AMX (AVX512-BF16 only: AMD Zen 4) has no oneDNN brgemm in
// ATen; there a tile runs on the dot-product kernel (dot.h), a register
// tile's query vectors at a time (attend_tile_dot).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "dot.h"
#include "parallel.h"
#include "vec.h"

namespace sf {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float MASKED = -1e30f;  // a masked score where the exponential must see finite values (vexp2_bf16)
constexpr int TK = 64;          // KV tokens per packed tile (prefill)
constexpr int TILE_VECS = 96;   // query vectors (rows x group) per prefill work item
constexpr int MB = 8 * W / TK;  // query vectors per score micro-kernel: 8 accumulator registers

struct Cache {
  int64_t block_stride, token_stride;  // elements
  int block_size;
  const int32_t* table;  // this sequence's block ids
  int64_t head_offset;   // kv_head * D

  // Offsets (elements) of the KV rows of tokens [t0, t0 + n), walking the block table.
  void offsets(int t0, int n, int64_t* off) const {
    int b = t0 / block_size, i = t0 % block_size;
    for (int t = 0; t < n; ++t) {
      off[t] = table[b] * block_stride + i * token_stride + head_offset;
      if (++i == block_size) i = 0, ++b;
    }
  }
};

// A thread's decodes read their rows as one stream, item after item: the
// offsets (elements, as Cache::offsets gives them) of that stream's rows
// AHEAD tokens on from a decode's first token, n of them left. Most decodes
// are a tile or two long: asking only for a sequence's own next tile left the
// first tile of each cold; the next sequence's rows now come in while this
// one ends.
constexpr int AHEAD = TK;
struct Ahead {
  const int64_t* off;
  int n;
  bool warm;  // this decode's first tile was asked for by the item before it
};

// The lines of `rows` K rows then the same V rows (offsets in elements),
// `lines` a row, asked for into L2 in order, spread over the `reads` row
// reads of a tile: ask(k) before k of them, all() for whatever is left.
template <typename T>
struct Trickle {
  const T* cache[2];
  const int64_t* off;
  int rows, lines;
  int64_t left = 2LL * rows * lines;
  int per;  // lines a row read
  int c = 0, r = 0, l = 0;

  Trickle(std::array<const T*, 2> caches, const int64_t* offsets, int n, int lines_per_row, int reads)
      : cache{caches[0], caches[1]}, off(offsets), rows(n), lines(lines_per_row),
        per(reads > 0 ? static_cast<int>((left + reads - 1) / reads) : 0) {}
  inline void ask(int calls = 1) {
    for (int k = per * calls; k > 0 && left > 0; --k) one();
  }
  void all() {
    while (left > 0) one();
  }
  inline void one() {
    _mm_prefetch(reinterpret_cast<const char*>(cache[c] + off[r]) + l * 64, _MM_HINT_T1);
    --left;
    if (++l == lines) {
      l = 0;
      if (++r == rows) r = 0, ++c;
    }
  }
};

// Load a byte of each line of [p, p + bytes) (64-byte aligned lines; the
// caller keeps the result live): nothing but loads, so the misses all go out
// at once.
inline uint8_t touch(const void* p, int64_t bytes) {
  const uint8_t* c = static_cast<const uint8_t*>(p);
  uint8_t seen = 0;
  for (int64_t b = 0; b < bytes; b += 64) seen ^= c[b];
  return seen;
}

// Running softmax state of one query vector.
template <int D>
struct Acc {
  float max = NEG_INF, sum = 0.f;
  vf o[D / W] = {};

  // Fold in scores s[0, n) (n a multiple of W; masked scores -inf) of keys
  // whose values are rows v(t); every row v(0..n) must be finite.
  template <typename V>
  void absorb(float* s, int n, V v) {
    vf mv = splat(max);
    for (int t = 0; t < n; t += W) mv = vmax(mv, load(s + t));
    const float m = hmax(mv);
    if (m == NEG_INF) return;
    const float corr = std::exp(max - m);
    max = m;
    vf add{};
    for (int t = 0; t < n; t += W) {
      vf x = load(s + t);
      vf p = x == NEG_INF ? vf{} : vexp(x - m);
      store(s + t, p);
      add += p;
    }
    sum = sum * corr + hsum(add);
    vf acc[D / W];  // in registers for the whole loop, not through memory per token
    for (int i = 0; i < D / W; ++i) acc[i] = o[i] * corr;
    for (int t = 0; t < n; ++t) {
      const vf p = splat(s[t]);
      const auto* row = v(t);
      for (int i = 0; i < D / W; ++i) acc[i] += p * load(row + i * W);
    }
    for (int i = 0; i < D / W; ++i) o[i] = acc[i];
  }

  template <typename T>
  void write(T* out) const {
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int i = 0; i < D / W; ++i) store(out + i * W, o[i] * inv);
  }
};

// A decode's arithmetic on one KV head's rows, for G query vectors, in
// float32 FMAs: rows widened to float32, q pre-scaled.
template <typename T, int D, int G>
struct FmaRows {
  static constexpr bool TILES = false;
  vf qv[G][D / W];

  void query(const T* q, float scale) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / W; ++i) qv[g][i] = load(q + g * D + i * W) * scale;
  }
  // s[g][j0, j0 + W) = q_g . k_j for rows j of W: each loaded once for every g, the
  // lane partials summed by reduce_lanes
  template <typename Row, typename Between>
  void scores(Row row, vf, float (*s)[TK], int j0, Between between) const {
    between(W);
    vf d[G][W];
    for (int j = 0; j < W; ++j) {
      const T* k = row(j);
      vf kr[D / W];
      for (int i = 0; i < D / W; ++i) kr[i] = load(k + i * W);
      for (int g = 0; g < G; ++g) {
        vf x = qv[g][0] * kr[0];
        for (int i = 1; i < D / W; ++i) x += qv[g][i] * kr[i];
        d[g][j] = x;
      }
    }
    for (int g = 0; g < G; ++g) store(s[g] + j0, reduce_lanes(d[g]));
  }
  static constexpr int ROW_READS = 1;  // times scores() asks for each row
  static constexpr float score_scale(float) { return 1.f; }
  // acc[g] += sum over t < n of p[g][t] v_t
  template <typename Row>
  static void values(Row row, int n, const float (*p)[TK], vf (*acc)[D / W]) {
    for (int t = 0; t < n; ++t) {
      const T* v = row(t);
      vf vr[D / W];
      for (int i = 0; i < D / W; ++i) vr[i] = load(v + i * W);
      for (int g = 0; g < G; ++g) {
        const vf pt = splat(p[g][t]);
        for (int i = 0; i < D / W; ++i) acc[g][i] += pt * vr[i];
      }
    }
  }
};

#if defined(__AVX512BF16__)
// The same on AVX512-BF16's dot product, bf16 rows as they are: a score is
// D/32 vdpbf16ps over pairs along d (q unrounded bf16, the scale applied to
// the float32 score); P V takes two tokens at a time, their rows interleaved
// into pairs along the token axis and the two probabilities rounded to bf16
// (as the prefill tiles' P V does). Per row: a third of the FMA path's
// instructions for the scores, half for P V.
template <int D, int G>
struct DotRows {
  static constexpr bool TILES = false;
  __m512bh qb[G][D / 32];

  void query(const c10::BFloat16* q, float) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / 32; ++i) qb[g][i] = (__m512bh)_mm512_loadu_si512(q + g * D + i * 32);
  }
  // s[g][j0, j0 + W) = scale * q_g . k_j for rows j of W, one g at a time: its W partial
  // vectors and their reduce_lanes fit in registers, where all G's at once
  // (48 vectors at G = 3) went through the stack; each row comes from L1
  // again for the next g. With the rows in cache the spilled sums' reduce had
  // been a third of the kernel's perf samples.
  template <typename Row, typename Between>
  void scores(Row row, vf scale, float (*s)[TK], int j0, Between between) const {
    for (int g = 0; g < G; ++g) {
      between(W);  // before this g's W row reads
      vf d[W];
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) {
        const c10::BFloat16* k = row(j);
        __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], (__m512bh)_mm512_loadu_si512(k));
        for (int i = 1; i < D / 32; ++i)
          x = _mm512_dpbf16_ps(x, qb[g][i], (__m512bh)_mm512_loadu_si512(k + i * 32));
        d[j] = (vf)x;
      }
      store(s[g] + j0, reduce_lanes(d) * scale);
    }
  }
  static constexpr int ROW_READS = G;
  static constexpr float score_scale(float scale) { return scale; }
  template <typename Row>
  static void values(Row row, int n, const float (*p)[TK], vf (*acc)[D / W]) {
    // word 2k of a pair vector: row a's d = k, word 2k + 1: row b's (16 d a vector)
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    // the probabilities as bf16 pairs along the tokens, 16 at a time: one broadcast a pair below
    alignas(64) uint32_t pairs[G][TK / 2];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < n; t += W) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(p[g] + t));
        std::memcpy(&pairs[g][t / 2], &b, sizeof(b));
      }
    // the sums in a local array, not through `acc`: a store through a pointer GCC may not
    // separate from the rows' loads went to memory, all of them, every two tokens (perf)
    __m512 sum[G][D / W];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / W; ++i) sum[g][i] = (__m512)acc[g][i];
    for (int t = 0; t < n; t += 2) {  // an odd n pairs its last row with a row whose p is 0 (padded)
      const c10::BFloat16 *a = row(t), *b = row(t + 1);
      __m512bh vp[D / 16];
      for (int i = 0; i < D / 32; ++i) {
        const __m512i x = _mm512_loadu_si512(a + i * 32), y = _mm512_loadu_si512(b + i * 32);
        vp[2 * i] = (__m512bh)_mm512_permutex2var_epi16(x, lo, y);
        vp[2 * i + 1] = (__m512bh)_mm512_permutex2var_epi16(x, hi, y);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][t / 2]));
        for (int i = 0; i < D / W; ++i) sum[g][i] = _mm512_dpbf16_ps(sum[g][i], pp, vp[i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / W; ++i) acc[g][i] = (vf)sum[g][i];
  }
};
#endif

template <typename T, int D, int G>
constexpr bool dot_decode() {
  return DOT && std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
}

// One decode token against its whole sequence, every KV head, tile by tile:
// within a tile the heads go one after the other, so the cache is read in
// address order ([block][token][kv head][D]: a token's heads are adjacent)
// and each line fetched is used whole. A work item per (sequence, KV head)
// read 128 of every 384 bytes per pass and ran at a third of the read
// bandwidth. Scores are dot products straight from the cache rows, W tokens
// at a time, their horizontal sums done together by one transpose-and-add
// (reduce_lanes). G (query heads per slice of a KV head's group) is a
// template argument: each K and V row is loaded once for all G query
// vectors, their accumulators in registers for the tile; between tiles each
// head's softmax state waits in memory. `Rows` is the arithmetic: FmaRows, or
// DotRows for bf16 where the build has AVX512-BF16.
template <typename T, int D, int G, typename Rows>
void attend_decode(const T* q, int group, const T* kc, const T* vc, const Cache& c, int kv_heads, int seq_len,
                   const Ahead& ahead, float scale, T* out) {
  struct State {
    float max[G], sum[G];
    vf o[G][D / W];
  };
  std::vector<State> state(kv_heads);
  for (State& st : state)
    for (int g = 0; g < G; ++g) {
      st.max[g] = NEG_INF, st.sum[g] = 0.f;
      for (int i = 0; i < D / W; ++i) st.o[g][i] = vf{};
    }
  alignas(64) float s[G][TK];
  int64_t off[TK + 1];
  const vf score_scale = splat(Rows::score_scale(scale));
  for (int t0 = 0; t0 < seq_len; t0 += TK) {
    const int n = std::min(TK, seq_len - t0);
    const int padded = (n + W - 1) / W * W;
    c.offsets(t0, n, off);
    std::fill(off + n, off + padded + 1, off[n - 1]);  // valid rows to load; their scores are masked
    // The cache is cold here (the weights streamed through since the last iteration). Each
    // tile asks for the next one's rows in the thread's stream (Ahead) into L2, a few lines
    // between each of its own rows' reads: the memory stays busy while the tile computes. All
    // of them asked for at once, before the tile, filled the core's queue of misses and stalled
    // it until most had come (cold decodes took the time of the reads plus the arithmetic, not
    // the longer of the two: 1.2x slower). A tile nothing asked for (the stream's first, an item
    // taken from another thread) loads its rows first, every head, K then V, in address order,
    // so that their misses go out together.
    const int64_t row_bytes = static_cast<int64_t>(kv_heads) * D * sizeof(T);
    const int rows_ahead = std::max(0, std::min(n, ahead.n - t0));
    const int reads = Rows::TILES ? 0 : (padded * Rows::ROW_READS + n) * kv_heads;  // row reads below
    Trickle<T> next{{kc, vc}, ahead.off ? ahead.off + t0 : nullptr, rows_ahead, static_cast<int>(row_bytes / 64),
                    reads};
    const bool asked = ahead.off && (t0 > 0 || ahead.warm);  // this tile's rows, by the tile before it
    if constexpr (Rows::TILES) next.all();  // AMX's tiles: as measured on the Xeon (all, then every row)
    if (Rows::TILES || !asked) {
      uint8_t seen = 0;
      for (const T* cache : {kc, vc})
        for (int j = 0; j < n; ++j) seen ^= touch(cache + off[j], row_bytes);
      asm volatile("" : : "r"(seen));
    }
    for (int h = 0; h < kv_heads; ++h) {
      const int64_t ho = static_cast<int64_t>(h) * D;
      State& st = state[h];
      Rows rows;
      rows.query(q + h * group * D, scale);
      vf acc[G][D / W];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < D / W; ++i) acc[g][i] = st.o[g][i];
      if constexpr (Rows::TILES) {
        rows.scores(kc + ho, off, padded, c.token_stride, Rows::score_scale(scale), s);
      } else {
        for (int j0 = 0; j0 < padded; j0 += W)
          rows.scores([&](int j) { return kc + off[j0 + j] + ho; }, score_scale, s, j0,
                      [&](int reads) { next.ask(reads); });
      }
      for (int g = 0; g < G; ++g) {  // online softmax: the tile's probabilities, the running sums rescaled
        std::fill(s[g] + n, s[g] + padded, NEG_INF);
        vf mv = splat(st.max[g]);
        for (int t = 0; t < padded; t += W) mv = vmax(mv, load(s[g] + t));
        const float mx = hmax(mv);
        const float corr = std::exp(st.max[g] - mx);
        st.max[g] = mx;
        vf add{};
        for (int t = 0; t < padded; t += W) {
          const vf x = load(s[g] + t);
          const vf e = x == NEG_INF ? vf{} : vexp(x - mx);
          store(s[g] + t, e);
          add += e;
        }
        st.sum[g] = st.sum[g] * corr + hsum(add);
        for (int i = 0; i < D / W; ++i) acc[g][i] *= corr;
      }
      Rows::values([&](int t) { next.ask(); return vc + off[t] + ho; }, n, s, acc);
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < D / W; ++i) st.o[g][i] = acc[g][i];
    }
    next.all();
  }
  for (int h = 0; h < kv_heads; ++h)
    for (int g = 0; g < G; ++g) {
      const float inv = state[h].sum[g] > 0.f ? 1.f / state[h].sum[g] : 0.f;
      for (int i = 0; i < D / W; ++i) store(out + (h * group + g) * D + i * W, state[h].o[g][i] * inv);
    }
}

template <typename T, int D, int G>
void attend_decode(const T* q, int group, const T* kc, const T* vc, const Cache& c, int kv_heads, int seq_len,
                   const Ahead& ahead, float scale, T* out) {
#if defined(__AVX512BF16__)
  if constexpr (dot_decode<T, D, G>())
    return attend_decode<T, D, G, DotRows<D, G>>(q, group, kc, vc, c, kv_heads, seq_len, ahead, scale, out);
#endif
  attend_decode<T, D, G, FmaRows<T, D, G>>(q, group, kc, vc, c, kv_heads, seq_len, ahead, scale, out);
}

// Query heads per KV head (`group`), as a template argument up to 8; wider
// groups in slices of 8 (each slice reads the rows again). q and out: the
// token's [kv_heads * group][D].
template <typename T, int D>
void attend_decode(const T* q, int group, const T* kc, const T* vc, const Cache& c, int kv_heads, int seq_len,
                   const Ahead& ahead, float scale, T* out) {
  for (int g0 = 0; g0 < group; g0 += 8) {
    switch (std::min(8, group - g0)) {
#define SF_GROUP(N)                                                                                  \
  case N:                                                                                            \
    attend_decode<T, D, N>(q + g0 * D, group, kc, vc, c, kv_heads, seq_len, ahead, scale, out + g0 * D); \
    break;
      SF_GROUP(1) SF_GROUP(2) SF_GROUP(3) SF_GROUP(4) SF_GROUP(5) SF_GROUP(6) SF_GROUP(7) SF_GROUP(8)
#undef SF_GROUP
    }
  }
}

// Scores of R query vectors (rows of q, D apart) against a packed, transposed
// KV tile kt[D][TK]: an outer product over d, R x TK/W accumulators in registers.
template <int D, int R>
inline void scores(const float* q, const float (*kt)[TK], vf (*out)[TK / W]) {
  vf acc[R][TK / W] = {};
  for (int d = 0; d < D; ++d) {
    vf k[TK / W];
    for (int j = 0; j < TK / W; ++j) k[j] = load(&kt[d][j * W]);
    for (int r = 0; r < R; ++r) {
      const vf qd = splat(q[r * D + d]);
      for (int j = 0; j < TK / W; ++j) acc[r][j] += qd * k[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TK / W; ++j) out[r][j] = acc[r][j];
}

// A tile of query rows [r0, r1) of one prefill chunk, all G heads of one KV head.
template <typename T, int D>
void attend_tile(const T* q, int64_t q_row_stride, int G, int rows, int first_pos, const T* kc, const T* vc,
                 const Cache& c, float scale, T* out, int64_t out_row_stride) {
  const int M = rows * G;
  std::vector<float> qbuf(static_cast<size_t>(M) * D);
  std::vector<Acc<D>> acc(M);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D / W; ++i)
        store(&qbuf[(r * G + g) * D + i * W], load(q + r * q_row_stride + g * D + i * W) * scale);
  alignas(64) float kt[D][TK];
  alignas(64) float vbuf[TK][D] = {};  // rows past a tile's end stay finite: their p is 0
  alignas(64) float s[MB][TK];
  int64_t off[TK];
  const int kv_end = first_pos + rows;  // keys the last row sees
  for (int t0 = 0; t0 < kv_end; t0 += TK) {
    const int n = std::min(TK, kv_end - t0);
    c.offsets(t0, n, off);
    for (int t = 0; t < n; ++t) {
      const T* k = kc + off[t];
      const T* v = vc + off[t];
      for (int d = 0; d < D; ++d) kt[d][t] = to_float(k[d]);
      for (int i = 0; i < D / W; ++i) store(&vbuf[t][i * W], load(v + i * W));
    }
    for (int t = n; t < TK; ++t)
      for (int d = 0; d < D; ++d) kt[d][t] = 0.f;
    // rows whose position is below t0 see nothing of this tile
    const int r_begin = std::max(0, t0 - first_pos);
    for (int m0 = r_begin * G; m0 < M; m0 += MB) {
      const int mb = std::min(MB, M - m0);
      vf sv[MB][TK / W];
      if (mb == MB) {
        scores<D, MB>(&qbuf[m0 * D], kt, sv);
      } else {
        for (int b = 0; b < mb; ++b) scores<D, 1>(&qbuf[(m0 + b) * D], kt, &sv[b]);
      }
      for (int b = 0; b < mb; ++b) {
        const int m = m0 + b;
        const int limit = std::min(n, first_pos + m / G - t0 + 1);  // causal: keys <= own position
        for (int j = 0; j < TK / W; ++j) store(&s[b][j * W], sv[b][j]);
        std::fill(s[b] + limit, s[b] + TK, NEG_INF);
        acc[m].absorb(s[b], (limit + W - 1) / W * W, [&](int t) { return &vbuf[t][0]; });
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) acc[r * G + g].write(out + r * out_row_stride + g * D);
}

// ---- prefill tiles through cpublas::brgemm ---------------------------------
std::atomic<bool> g_brgemm_enabled{true};

// ATen offers a bf16 brgemm with AMX only; a forced ISA (kernels/cpu_build.py) turns it off
bool amx_brgemm() {
  static const bool available = !std::getenv("STALLFREE_CPU_ISA") && at::native::cpublas::could_pack(at::kBFloat16);
  return available;
}

template <typename T>
bool brgemm_available() {
  if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX2__)
    return true;  // oneDNN's float32 brgemm (ATen runs it from AVX2 up)
#else
    return false;
#endif
  } else {
    return amx_brgemm() || DOT;  // AMX tiles, else the dot-product kernel
  }
}

template <typename T>
bool use_brgemm() {
  static const bool available = brgemm_available<T>();
  return available && g_brgemm_enabled.load(std::memory_order_relaxed);
}

// Measured on a 512-token chunk after 1,500 cached tokens (bench.kernels.attention_kernels,
// alternating builds): larger tiles amortise each KV tile's gather and the brgemm calls
// over more query rows, up to here; more rows per item also compute more masked
// scores on the causal diagonal (a chunk with no prefix), so float32, whose
// products dominate its time, keeps fewer.
constexpr int TKB = 128;  // KV tokens per brgemm tile
template <typename T>
constexpr int TILE_VECS_BRGEMM = std::is_same_v<T, float> ? 192 : 768;  // query vectors (rows x group) per work item

// C[M][N] (+)= A[M][K] B[K][N], A and C row-major; a float32 B row-major
// [K][N], a bf16 B in VNNI pairs [K/2][N][2]: one brgemm call either way.
template <typename T>
void product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, float* C, int64_t ldc, bool add) {
  at::native::cpublas::brgemm(M, N, K, lda, N, ldc, add, A, B, C, !std::is_same_v<T, float>);
}

#if defined(__AVX512F__)
// r[j] = column j of the 16 x 16 matrix of 32-bit words whose rows are r[0..16).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: words 0,1 (lo) and 2,3 (hi) of rows i, i+1
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4g + c], lane L: word 4L + c of rows 4g .. 4g+3
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of u[c], u[4 + c], u[8 + c], u[12 + c] into column 4L + c
    const __m512i p = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), q = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i p2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i q2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(p, p2, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(p, p2, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(q, q2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(q, q2, 0xdd);
  }
}
#endif

// A KV tile's K^T as `product`'s B operand [D][TKB]: the rows of tokens
// [0, n) at `off` (zeros past n), read as 32-bit words (a float32, or a
// bf16 pair along d, which is VNNI's pairing), each word's column of TKB
// tokens contiguous. AVX-512 transposes 16 tokens x 16 words in registers
// (64 shuffles) rather than storing each word alone.
template <typename T, int D>
void gather_k(const T* kc, const int64_t* off, int n, T* out) {
  constexpr int WORDS = D * sizeof(T) / 4;  // per token row
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
#if defined(__AVX512F__)
  if constexpr (WORDS % 16 == 0) {
    for (int t0 = 0; t0 < TKB; t0 += 16) {
      for (int w0 = 0; w0 < WORDS; w0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = t0 + i < n ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(kc + off[t0 + i]) + w0)
                            : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(o + (w0 + j) * TKB + t0, r[j]);
      }
    }
    return;
  }
#endif
  for (int t = 0; t < TKB; ++t) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(kc + off[std::min(t, n - 1)]);
    for (int w = 0; w < WORDS; ++w) o[w * TKB + t] = t < n ? row[w] : 0u;
  }
}

// A KV tile's V as `product`'s B operand [TKB][D]: float32 rows as they are;
// bf16 rows interleaved in pairs of tokens (VNNI), zeros past n.
template <typename T, int D>
void gather_v(const T* vc, const int64_t* off, int n, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int t = 0; t < n; ++t) std::copy_n(vc + off[t], D, out + t * D);
    std::fill(out + n * D, out + TKB * D, 0.f);
  } else {
    const uint16_t zero[D] = {};
    for (int t = 0; t < TKB; t += 2) {
      const uint16_t* a = t < n ? reinterpret_cast<const uint16_t*>(vc + off[t]) : zero;
      const uint16_t* b = t + 1 < n ? reinterpret_cast<const uint16_t*>(vc + off[t + 1]) : zero;
      uint32_t* o = reinterpret_cast<uint32_t*>(out) + (t / 2) * D;
#if defined(__AVX512F__)
      if constexpr (D % 32 == 0) {
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int d = 0; d < D; d += 32) {
          const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
          _mm512_storeu_si512(o + d, _mm512_permutex2var_epi16(x, lo, y));
          _mm512_storeu_si512(o + d + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
        continue;
      }
#endif
      for (int d = 0; d < D; ++d) o[d] = a[d] | static_cast<uint32_t>(b[d]) << 16;
    }
  }
}

// The KV tile of tokens [t0, t0 + n) as both products' operands: K^T into kt, V into vt.
template <typename T, int D>
void gather_tile(const T* kc, const T* vc, const Cache& c, int t0, int n, T* kt, T* vt) {
  int64_t off[TKB];
  c.offsets(t0, n, off);
  gather_k<T, D>(kc, off, n, kt);
  gather_v<T, D>(vc, off, n, vt);
}

// One row of a tile's probabilities, p = 2^(s * log2_scale - hi), stored as
// T; returns their sum. bf16 probabilities keep 8 bits: a shorter polynomial.
template <typename T>
float probability_row(const float* s, float log2_scale, float hi, T* p, int cols) {
  constexpr int DEGREE = std::is_same_v<T, float> ? 6 : 4;
  const vf cv = splat(log2_scale), h = splat(hi);
  vf add{};
  for (int t = 0; t < cols; t += W) {
    const vf e = vexp2<DEGREE>(load(s + t) * cv - h);
    add += e;
    store(p + t, e);
  }
  return hsum(add);
}

#if defined(__AVX512F__)
// The bf16 row with AVX512-BF16's rounding conversion (every CPU with AMX has
// it): one instruction per 16 values instead of five, 7% of a bf16 tile.
__attribute__((target("avx512bf16"))) float probability_row_cvt(const float* s, float log2_scale, float hi,
                                                                c10::BFloat16* p, int cols) {
  const vf cv = splat(log2_scale), h = splat(hi);
  vf add{};
  for (int t = 0; t < cols; t += W) {
    const vf e = vexp2<4>(load(s + t) * cv - h);
    add += e;
    const __m256bh b = _mm512_cvtneps_pbh((__m512)e);
    std::memcpy(p + t, &b, sizeof(b));
  }
  return hsum(add);
}
#endif

template <typename T>
float probabilities(const float* s, float log2_scale, float hi, T* p, int cols = TKB) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, float>) {
    static const bool cvt = __builtin_cpu_supports("avx512bf16");
    if (cvt) return probability_row_cvt(s, log2_scale, hi, p, cols);
  }
#endif
  return probability_row(s, log2_scale, hi, p, cols);
}

// The same tile as attend_tile, its products by brgemm: S = Q K^T over a KV
// tile gathered transposed, online softmax per query vector in float32, then
// O = O * corr + P V. Shapes stay fixed per tile (M x TKB x D and M x D x
// TKB, the last tile zero-padded), so oneDNN generates each micro-kernel once.
template <typename T, int D>
void attend_tile_brgemm(const T* q, int64_t q_row_stride, int G, int rows, int first_pos, const T* kc, const T* vc,
                        const Cache& c, float scale, T* out, int64_t out_row_stride) {
  const int M = rows * G;
  // uninitialised: every element is written before it is read (a vector of bf16 was
  // zero-filled two bytes at a time, a tenth of this function's own samples under perf)
  std::unique_ptr<T[]> qbuf(new T[static_cast<size_t>(M) * D]), pbuf(new T[static_cast<size_t>(M) * TKB]);
  std::vector<float> s(static_cast<size_t>(M) * TKB), o(static_cast<size_t>(M) * D, 0.f), sum(M, 0.f);
  const int MW = (M + W - 1) / W * W;  // per-row state padded to whole vectors
  std::vector<float> mx(MW, NEG_INF), mnew(MW, NEG_INF), corr(MW);
  std::vector<int> limit(M);
  const float log2_scale = scale * 1.44269504088896341f;
  std::unique_ptr<T[]> tiles(new T[2 * D * TKB]);
  T *kt = tiles.get(), *vt = kt + D * TKB;
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) std::copy_n(q + r * q_row_stride + g * D, D, &qbuf[(r * G + g) * D]);
  const int kv_end = first_pos + rows;
  for (int t0 = 0; t0 < kv_end; t0 += TKB) {
    const int n = std::min(TKB, kv_end - t0);
    gather_tile<T, D>(kc, vc, c, t0, n, kt, vt);
    // Rows below r_begin see nothing of this tile (it lies past them on the
    // causal diagonal): the products skip them, from a multiple of 64 rows
    // so that oneDNN sees few distinct shapes (it generates code per shape).
    const int r_begin = std::max(0, t0 - first_pos);
    const int m0 = std::min(r_begin * G, M) / 64 * 64;
    product<T>(M - m0, TKB, D, &qbuf[m0 * D], D, kt, &s[m0 * TKB], TKB, false);
    // Online softmax in log2 units (scores times scale * log2 e), so each
    // probability is one power of two: first every row's new running max,
    // then all rows' rescaling factors at once, then the probabilities.
    for (int m = m0; m < M; ++m) {
      float* sr = &s[static_cast<size_t>(m) * TKB];
      limit[m] = m / G < r_begin ? 0 : std::min(n, first_pos + m / G - t0 + 1);
      if (limit[m] == 0) {
        mnew[m] = mx[m];
        continue;
      }
      std::fill(sr + limit[m], sr + TKB, NEG_INF);  // causal and past the tile's end
      vf mv = splat(NEG_INF);
      for (int t = 0; t < TKB; t += W) mv = vmax(mv, load(sr + t));
      mnew[m] = std::max(mx[m], hmax(mv) * log2_scale);
    }
    for (int m = m0; m < M; m += W) {  // corr = 2^(old max - new max); 0 for the first keys a row sees
      const vf hi = load(&mnew[m]);
      store(&corr[m], vexp2<6>(hi == NEG_INF ? vf{} : load(&mx[m]) - hi));
      store(&mx[m], hi);
    }
    for (int m = m0; m < M; ++m) {
      const float* sr = &s[static_cast<size_t>(m) * TKB];
      T* pr = &pbuf[static_cast<size_t>(m) * TKB];
      if (limit[m] == 0) {
        std::memset(static_cast<void*>(pr), 0, TKB * sizeof(T));  // zero in float32 and bf16
        continue;
      }
      sum[m] = sum[m] * corr[m] + probabilities(sr, log2_scale, mnew[m], pr);
      if (corr[m] != 1.f) {
        float* om = &o[static_cast<size_t>(m) * D];
        const vf k = splat(corr[m]);
        for (int i = 0; i < D; i += W) store(om + i, load(om + i) * k);
      }
    }
    product<T>(M - m0, D, TKB, &pbuf[m0 * TKB], TKB, vt, &o[m0 * D], D, true);
  }
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) {
      const int m = r * G + g;
      const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
      for (int i = 0; i < D; i += W) store(out + r * out_row_stride + g * D + i, load(&o[m * D + i]) * inv);
    }
}

#if defined(__AVX512F__)
// ---- prefill tiles on AMX's own instructions (bf16, heads of 64) -------------
// Through oneDNN's brgemm a bf16 tile's products ran at a fraction of AMX's
// rate: with K = 64 (a head's width) each C tile gets two multiplies per store
// and reload, and a call over 768 query vectors leaves its scores in L2.
// Timed on the 2-core Xeon (2026-12-05): a tile multiply takes ~7 ns and a tile
// store ~8; loading a tile register waits for the multiplies still reading it
// (with each loaded tile feeding one multiply they took ~30 ns each); a tile
// load of lines vector stores just wrote, or vector loads of lines a tile
// store just wrote, cost ~20 ns more. So: KV tile by KV tile (its K^T and V
// stay in L1 for every query block), 32 query vectors (two tiles' rows) at a
// time with each loaded tile feeding two multiplies, and per pair its scores,
// the previous pair's P V, then its softmax, so that neither kind of store is
// read straight back. The softmax is one pass: each vector keeps a reference
// maximum and probabilities are taken against it, until a KV tile's scores
// pass it by 2^8 (FlashAttention-4's conditional rescaling); only then is the
// maximum found first and the outputs rescaled. Probabilities up to 256 lose
// nothing in float32 sums or bf16 products, and the final division by the
// sum, taken against the same reference, cancels it.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// AMX here and granted: Linux hands a process AMX's register state only on
// request (arch_prctl). It follows ATen's bf16 brgemm (off under a forced ISA,
// kernels/cpu_build.py): run() ends each use with ATen's brgemm_release, which
// also makes ATen load its own tile configuration again before its next call.
bool amx_tiles() {
  static const bool ok = [] {
    if (!amx_brgemm() || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

std::atomic<bool> g_amx_enabled{true};  // off: bf16 tiles on oneDNN's brgemm (tests and benchmarks compare)

bool use_amx_tiles() { return amx_tiles() && g_amx_enabled.load(std::memory_order_relaxed); }

constexpr int AMX_ROWS = 16;           // query vectors per block: a tile's rows
constexpr float RESCALE_LOG2 = 8.f;    // a reference maximum stands until scores pass it by this (log2 units)

// s[32][0, cols) = the pair's queries (tiles 0-1: first block's d halves, 2-3:
// second's) x K^T (kt: [32][TKB] words, pairs along d); scores in 4-5, K^T in 6-7.
__attribute__((target("amx-tile,amx-bf16"))) void amx_scores(const uint32_t* kt, int cols, float* s) {
  for (int j = 0; j < cols; j += 16) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(6, kt + j, TKB * 4);
    _tile_loadd(7, kt + 16 * TKB + j, TKB * 4);
    _tile_dpbf16ps(4, 0, 6);
    _tile_dpbf16ps(5, 2, 6);
    _tile_dpbf16ps(4, 1, 7);
    _tile_dpbf16ps(5, 3, 7);
    _tile_stored(4, s + j, TKB * 4);
    _tile_stored(5, s + AMX_ROWS * TKB + j, TKB * 4);
  }
}

// o[32][64] += p[32][0, cols) x V (vt: [TKB/2][64] words, pairs along tokens),
// 32 output columns at a time: outputs in 0-3, probabilities in 4-5, V in 6-7.
__attribute__((target("amx-tile,amx-bf16"))) void amx_values(const c10::BFloat16* p, int cols, const uint32_t* vt,
                                                              float* o) {
  constexpr int D = 64, R = AMX_ROWS;
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_loadd(0, o + d0, D * 4);
    _tile_loadd(1, o + d0 + 16, D * 4);
    _tile_loadd(2, o + R * D + d0, D * 4);
    _tile_loadd(3, o + R * D + d0 + 16, D * 4);
    for (int k = 0; k < cols; k += 32) {
      const uint32_t* v = vt + (k / 2) * D + d0;
      _tile_loadd(4, p + k, TKB * 2);
      _tile_loadd(5, p + R * TKB + k, TKB * 2);
      _tile_loadd(6, v, D * 4);
      _tile_loadd(7, v + 16, D * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + d0, D * 4);
    _tile_stored(1, o + d0 + 16, D * 4);
    _tile_stored(2, o + R * D + d0, D * 4);
    _tile_stored(3, o + R * D + d0 + 16, D * 4);
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_load_queries(const c10::BFloat16* q) {
  _tile_loadd(0, q, 128);
  _tile_loadd(1, q + 32, 128);
  _tile_loadd(2, q + AMX_ROWS * 64, 128);
  _tile_loadd(3, q + AMX_ROWS * 64 + 32, 128);
}

// A row's probabilities against its reference maximum `ref` (log2 units) in
// one pass: p = 2^(s * log2_scale - ref) as bf16, their sum added to `sum`.
// False, p and sum untouched, when a score passes the reference by
// RESCALE_LOG2: the caller then finds the maximum first.
__attribute__((target("avx512bf16"))) bool capped_probabilities(const float* s, int cols, float log2_scale, float ref,
                                                               c10::BFloat16* p, float& sum) {
  const vf cv = splat(log2_scale), h = splat(ref);
  vf add{}, top = splat(NEG_INF);
  for (int t = 0; t < cols; t += W) {
    const vf x = load(s + t);
    top = vmax(top, x);
    const vf e = vexp2_bf16(x * cv - h);
    add += e;
    const __m256bh b = _mm512_cvtneps_pbh((__m512)e);
    std::memcpy(p + t, &b, sizeof(b));
  }
  if (hmax(top) * log2_scale > ref + RESCALE_LOG2) return false;
  sum += hsum(add);
  return true;
}

// One query vector's probabilities for a KV tile: its scores sr[0, cols),
// keys from lim on masked here, in one pass against its reference maximum
// `ref` (log2 units) while no score passes it by RESCALE_LOG2; else the
// maximum first, and the running `sum` and output row `o` (D floats)
// rescaled to the new reference. A vector that has seen no key yet gets zeros.
template <int D>
void softmax_row(float* sr, int lim, int cols, float log2_scale, float& ref, float& sum, c10::BFloat16* pr,
                 float* o) {
  std::fill(sr + lim, sr + cols, MASKED);
  if (ref != NEG_INF && capped_probabilities(sr, cols, log2_scale, ref, pr, sum)) return;
  // the first keys it sees, or scores past its reference: the maximum first
  vf mv = splat(NEG_INF);
  for (int t = 0; t < lim; t += W) mv = vmax(mv, load(sr + t));
  const float hi = hmax(mv) * log2_scale;  // log2 units
  if (hi > ref + RESCALE_LOG2) {
    if (ref != NEG_INF) {
      const float corr = std::exp2(ref - hi);
      sum *= corr;
      for (int x = 0; x < D; x += W) store(o + x, load(o + x) * splat(corr));
    }
    ref = hi;
  }
  if (ref == NEG_INF) {  // sees none of these keys yet
    std::memset(static_cast<void*>(pr), 0, cols * sizeof(c10::BFloat16));
    return;
  }
  capped_probabilities(sr, cols, log2_scale, ref, pr, sum);  // no score passes the reference now
}

#if defined(__AVX512BF16__)
// The same tile on AVX512-BF16's dot product without AMX (AMD Zen 4), a
// register tile's rows (at most DOT_ROWS query vectors) at a time: a block's
// scores, probabilities and share of P V while they are in L1, only the keys
// its last vector sees (in 32s), and the one-pass softmax against a
// reference maximum of attend_tile_amx. Through attend_tile_brgemm's layout
// (every vector's scores for a KV tile, then all probabilities, then P V)
// the scores of 768 vectors went to L2 and back, each row took a pass for
// its maximum first, and the causal diagonal's tiles computed all their keys.
template <int D>
void attend_tile_dot(const c10::BFloat16* q, int64_t q_row_stride, int G, int rows, int first_pos,
                     const c10::BFloat16* kc, const c10::BFloat16* vc, const Cache& c, float scale,
                     c10::BFloat16* out, int64_t out_row_stride) {
  using T = c10::BFloat16;
  // register tiles by rows: Q K^T over a head's D / 2 pairs, P V over 16, 32, 48 or 64 (a tile's keys / 2)
  using Rows = std::make_index_sequence<DOT_ROWS>;
  static constexpr auto score_tiles = dot_tiles<DotF32Fixed<D / 2>::template Tile>(Rows{});
  static constexpr std::array pv_tiles{
      dot_tiles<DotF32Fixed<16>::Tile>(Rows{}), dot_tiles<DotF32Fixed<32>::Tile>(Rows{}),
      dot_tiles<DotF32Fixed<48>::Tile>(Rows{}), dot_tiles<DotF32Fixed<64>::Tile>(Rows{})};
  static_assert(TKB == 4 * DOT_COLS);
  const int M = rows * G;
  std::unique_ptr<T[]> qbuf(new T[static_cast<size_t>(M) * D]);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) std::copy_n(q + r * q_row_stride + g * D, D, &qbuf[(r * G + g) * D]);
  std::vector<float> o(static_cast<size_t>(M) * D, 0.f), ref(M, NEG_INF), sum(M, 0.f);
  auto seen = [&](int m) { return first_pos + m / G + 1; };  // the keys [0, seen) vector m sees
  std::unique_ptr<T[]> kv(new T[2 * D * TKB]);
  T *kt = kv.get(), *vt = kt + D * TKB;
  alignas(64) float s[DOT_ROWS * TKB];
  alignas(64) T p[DOT_ROWS * TKB];
  const auto* qw = reinterpret_cast<const uint16_t*>(qbuf.get());
  const auto* kw = reinterpret_cast<const uint16_t*>(kt);
  const auto* vw = reinterpret_cast<const uint16_t*>(vt);
  const auto* pw = reinterpret_cast<const uint16_t*>(p);
  const float log2_scale = scale * 1.44269504088896341f;
  const int kv_end = first_pos + rows;
  for (int t0 = 0; t0 < kv_end; t0 += TKB) {
    const int n = std::min(TKB, kv_end - t0);
    gather_tile<T, D>(kc, vc, c, t0, n, kt, vt);
    const int m_begin = std::min(std::max(0, t0 - first_pos) * G, M);  // vectors before it see none of this tile
    dot_row_tiles(M - m_begin, [&](int64_t r, int R) {
      const int m0 = m_begin + static_cast<int>(r);
      const int cols = (std::min(n, seen(m0 + R - 1) - t0) + DOT_COLS - 1) / DOT_COLS * DOT_COLS;
      for (int n0 = 0; n0 < cols; n0 += DOT_COLS)
        score_tiles[R - 1](qw + m0 * D, D, kw + 2 * n0, TKB, s + n0, TKB, false);
      for (int i = 0; i < R; ++i) {
        const int m = m0 + i, lim = std::clamp(seen(m) - t0, 0, cols);
        softmax_row<D>(s + i * TKB, lim, cols, log2_scale, ref[m], sum[m], p + i * TKB,
                       &o[static_cast<size_t>(m) * D]);
      }
      const auto& pv = pv_tiles[cols / DOT_COLS - 1];
      for (int d0 = 0; d0 < D; d0 += DOT_COLS)
        pv[R - 1](pw, TKB, vw + 2 * d0, D, &o[static_cast<size_t>(m0) * D + d0], D, true);
    });
  }
  for (int m = 0; m < M; ++m) {
    const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
    T* dst = out + (m / G) * out_row_stride + (m % G) * D;
    for (int x = 0; x < D; x += W) store(dst + x, load(&o[static_cast<size_t>(m) * D + x]) * splat(inv));
  }
}
#endif

// The same tile as attend_tile_brgemm (bf16, D = 64) on AMX, a pair of query
// blocks at a time (padded with copies of the last row's limits).
__attribute__((target("amx-tile,amx-bf16"))) void attend_tile_amx(const c10::BFloat16* q, int64_t q_row_stride,
                                                                   int G, int rows, int first_pos,
                                                                   const c10::BFloat16* kc, const c10::BFloat16* vc,
                                                                   const Cache& c, float scale, c10::BFloat16* out,
                                                                   int64_t out_row_stride) {
  using T = c10::BFloat16;
  constexpr int D = 64, R = 2 * AMX_ROWS;  // a pair of blocks
  const int M = rows * G, MP = (M + R - 1) / R * R;
  std::unique_ptr<T[]> qbuf(new T[static_cast<size_t>(MP) * D]);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) std::copy_n(q + r * q_row_stride + g * D, D, &qbuf[(r * G + g) * D]);
  std::memset(static_cast<void*>(&qbuf[static_cast<size_t>(M) * D]), 0, (MP - M) * D * sizeof(T));
  std::vector<float> o(static_cast<size_t>(MP) * D, 0.f), ref(MP, NEG_INF), sum(MP, 0.f);
  // the keys [0, seen) vector m sees (padding vectors: the last row's)
  auto seen = [&](int m) { return first_pos + std::min(m / G, rows - 1) + 1; };
  std::unique_ptr<T[]> kv(new T[2 * D * TKB]);
  T *kt = kv.get(), *vt = kt + D * TKB;
  alignas(64) float s[R * TKB];
  alignas(64) T p[2][R * TKB];
  const float log2_scale = scale * 1.44269504088896341f;
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.rows[i] = AMX_ROWS, config.colsb[i] = 64;
  _tile_loadconfig(&config);
  const int kv_end = first_pos + rows;
  for (int t0 = 0; t0 < kv_end; t0 += TKB) {
    const int n = std::min(TKB, kv_end - t0);
    gather_tile<T, D>(kc, vc, c, t0, n, kt, vt);
    const int r_begin = std::max(0, t0 - first_pos);  // rows before it see nothing of this tile
    int prev = -1, prev_cols = 0;                       // the previous pair, its probabilities in p[slot ^ 1]
    int slot = 0;
    for (int b = std::min(r_begin * G, M) / R * R; b < M; b += R, slot ^= 1) {
      const int cols = (std::min(n, seen(b + R - 1) - t0) + 31) / 32 * 32;
      amx_load_queries(&qbuf[static_cast<size_t>(b) * D]);
      amx_scores(reinterpret_cast<const uint32_t*>(kt), cols, s);
      if (prev >= 0)
        amx_values(p[slot ^ 1], prev_cols, reinterpret_cast<const uint32_t*>(vt), &o[static_cast<size_t>(prev) * D]);
      for (int i = 0; i < R; ++i) {
        const int m = b + i, lim = std::clamp(seen(m) - t0, 0, cols);
        softmax_row<D>(s + i * TKB, lim, cols, log2_scale, ref[m], sum[m], p[slot] + i * TKB,
                       &o[static_cast<size_t>(m) * D]);
      }
      prev = b, prev_cols = cols;
    }
    if (prev >= 0)
      amx_values(p[slot ^ 1], prev_cols, reinterpret_cast<const uint32_t*>(vt), &o[static_cast<size_t>(prev) * D]);
  }
  for (int m = 0; m < M; ++m) {
    const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
    T* dst = out + (m / G) * out_row_stride + (m % G) * D;
    for (int x = 0; x < D; x += W) store(dst + x, load(&o[static_cast<size_t>(m) * D + x]) * splat(inv));
  }
}

#if defined(__AVX512BF16__)
// ---- decode scores on AMX (bf16, heads of 64) -------------------------------
// A cache block's 16 K rows of one KV head are a tile as they lie in the cache
// (rows a token's stride apart, two tiles for the two 32-wide halves of d), so
// Q K^T needs no packing: times the G query vectors laid out as VNNI pairs
// along d, 16 tokens' scores in two multiplies. The dot-product loop spent
// ~50 cycles a token and KV head there (its horizontal sums and stores), hot
// in cache as much as cold. P V stays on the dot product (DotRows): as a tile
// product V would first have to be interleaved into pairs along the tokens,
// which is most of what that loop does already. Blocks must hold a multiple
// of 16 tokens (each 16-token group of a 64-token tile then lies in one block).
template <int G>
struct TileRows {
  static constexpr bool TILES = true;
  static constexpr int ROW_READS = 0;  // its scores read the rows as tiles, not through a row function
  static constexpr int D = 64;
  alignas(64) uint32_t qt[32][16];  // B: rows are pairs of d, columns query vectors (G of 16 read)

  void query(const c10::BFloat16* q, float) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 32; ++k) qt[k][g] = pairs[g * 32 + k];
  }
  static constexpr float score_scale(float scale) { return scale; }

  // Tiles 0-1 and 5-6: K halves of alternate groups; 2-3: qt's halves; 4 and 7: scores.
  __attribute__((target("amx-tile"))) static void configure() {
    TileConfig config;
    for (int t : {0, 1, 5, 6}) config.rows[t] = 16, config.colsb[t] = 64;
    for (int t : {2, 3, 4, 7}) config.rows[t] = 16, config.colsb[t] = 4 * G;
    asm volatile("" : : "r"(&config) : "memory");  // GCC 12 dropped these stores as dead before ldtilecfg
    _tile_loadconfig(&config);
  }

  // s[g][0, n) = scale * q_g . K rows of tokens off[0, n) (n a multiple of 16; each
  // group of 16 from off[j] on, `stride` elements apart)
  __attribute__((target("amx-tile,amx-bf16"))) void scores(const c10::BFloat16* k, const int64_t* off, int n,
                                                            int64_t stride, float scale, float (*s)[TK]) const {
    alignas(64) float c[TK / 16][16][16];
    const int64_t ld = stride * static_cast<int64_t>(sizeof(c10::BFloat16));
    _tile_loadd(2, qt[0], 64);
    _tile_loadd(3, qt[16], 64);
    for (int j = 0; j < n; j += 32) {  // two groups in turn: a tile is loaded while the other's products run
      _tile_loadd(0, k + off[j], ld);
      _tile_loadd(1, k + off[j] + 32, ld);
      _tile_zero(4);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(4, 1, 3);
      _tile_stored(4, c[j / 16], 64);
      if (j + 16 == n) break;
      _tile_loadd(5, k + off[j + 16], ld);
      _tile_loadd(6, k + off[j + 16] + 32, ld);
      _tile_zero(7);
      _tile_dpbf16ps(7, 5, 2);
      _tile_dpbf16ps(7, 6, 3);
      _tile_stored(7, c[j / 16 + 1], 64);
    }
    const vi column = vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * 16;  // c's column 0, token by token
    const vf sc = splat(scale);
    for (int j = 0; j < n; j += 16)
      for (int g = 0; g < G; ++g)
        store(s[g] + j, (vf)_mm512_i32gather_ps((__m512i)(column + g), &c[j / 16][0][0], 4) * sc);
  }

  template <typename Row>
  static void values(Row row, int n, const float (*p)[TK], vf (*acc)[D / W]) {
    DotRows<D, G>::values(row, n, p, acc);
  }
};

// Whether decodes take TileRows here: AMX granted and blocks of whole 16-token groups.
bool decode_tiles(int block_size) { return use_amx_tiles() && block_size % 16 == 0; }

// attend_decode (bf16, D = 64) on TileRows, query heads per KV head in slices of 8.
void attend_decode_amx(const c10::BFloat16* q, int group, const c10::BFloat16* kc, const c10::BFloat16* vc,
                       const Cache& c, int kv_heads, int seq_len, const Ahead& ahead, float scale,
                       c10::BFloat16* out) {
  using T = c10::BFloat16;
  for (int g0 = 0; g0 < group; g0 += 8) {
    switch (std::min(8, group - g0)) {
#define SF_GROUP(N)                                                                                          \
  case N:                                                                                                    \
    TileRows<N>::configure();                                                                                \
    attend_decode<T, 64, N, TileRows<N>>(q + g0 * 64, group, kc, vc, c, kv_heads, seq_len, ahead, scale,       \
                                         out + g0 * 64);                                                      \
    break;
      SF_GROUP(1) SF_GROUP(2) SF_GROUP(3) SF_GROUP(4) SF_GROUP(5) SF_GROUP(6) SF_GROUP(7) SF_GROUP(8)
#undef SF_GROUP
    }
  }
}
#endif  // __AVX512BF16__
#endif

struct Work {
  int seq, kv_head, row0, rows;
  int heads;    // KV heads it covers from kv_head (a decode's: all of them, or one when split)
  double cost;  // query vectors times the keys they see: what the split balances
};

// The items of one call, dealt to `bins` threads by cost: the costliest first,
// each to the bin with the least so far (LPT). A static split of the item
// list in order gave one thread a chunk's heavy tiles and the other the
// light decodes before them (a mixed iteration ran no faster on 2 threads).
std::vector<std::vector<int>> deal(const std::vector<Work>& work, int bins) {
  std::vector<int> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return work[a].cost > work[b].cost; });
  std::vector<std::vector<int>> dealt(static_cast<size_t>(bins));
  std::vector<double> load(static_cast<size_t>(bins), 0.0);
  for (int i : order) {
    const size_t b = std::min_element(load.begin(), load.end()) - load.begin();
    dealt[b].push_back(i);
    load[b] += work[i].cost;
  }
  for (auto& items : dealt) std::sort(items.begin(), items.end());  // decodes first: their rows prefetch in turn
  return dealt;
}

// Query rows per tile of a chunk of q_len rows: at most `most`, and, on
// several threads, the chunk cut into more tiles until its items (tiles x KV
// heads) deal out evenly or number at least four a thread, down to
// MIN_TILE_ROWS. A 248-token chunk in one tile a KV head made three items:
// on two threads one thread ran two of them while the other waited.
constexpr int MIN_TILE_ROWS = 32;
int chunk_tile_rows(int q_len, int most, int kv_heads, int threads) {
  int tiles = (q_len + most - 1) / most;
  const int cap = std::max(tiles, q_len / MIN_TILE_ROWS);
  while (tiles < cap && (tiles * kv_heads) % threads != 0 && tiles * kv_heads < 4 * threads) ++tiles;
  return (q_len + tiles - 1) / tiles;
}

template <typename T, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const at::Tensor& query_start, double scale, at::Tensor& out) {
  const int S = seq_lens.size(0);
  const int H = q.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  // the dot-product kernel's tiles are 32 columns wide: P V's needs D >= 32
  const bool brgemm = use_brgemm<T>() && (std::is_same_v<T, float> || amx_brgemm() || D % DOT_COLS == 0);
  const int rows_per_tile = std::max(1, (brgemm ? TILE_VECS_BRGEMM<T> : TILE_VECS) / G);
  const int threads = at::get_num_threads();
  int decodes = 0;
  for (int s = 0; s < S; ++s) decodes += qs[s + 1] - qs[s] == 1;
  // a decode is one item, every KV head, unless there are too few to keep the threads busy
  const int decode_heads = decodes >= 2 * threads ? KVH : 1;
  std::vector<Work> work;
  for (int s = 0; s < S; ++s) {
    const int q_len = qs[s + 1] - qs[s];
    if (q_len == 1) {
      for (int h = 0; h < KVH; h += decode_heads)
        work.push_back({s, h, qs[s], 1, decode_heads, static_cast<double>(decode_heads) * G * lens[s]});
      continue;
    }
    const int tile_rows = chunk_tile_rows(q_len, rows_per_tile, KVH, threads);
    for (int r = qs[s]; r < qs[s + 1]; r += tile_rows) {
      const int rows = std::min(tile_rows, qs[s + 1] - r);
      const double keys = lens[s] - q_len + (r - qs[s]) + rows / 2.0;  // the tile's rows see this many, on average
      for (int h = 0; h < KVH; ++h) work.push_back({s, h, r, rows, 1, static_cast<double>(rows) * G * keys});
    }
  }
  const std::vector<std::vector<int>> dealt = deal(work, std::min<int>(threads, static_cast<int>(work.size())));
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int bs = k_cache.size(1);
  const float sc = static_cast<float>(scale);
  auto cache_of = [&](const Work& w) {
    return Cache{k_cache.stride(0), k_cache.stride(1), bs, tables + w.seq * table_stride,
                 static_cast<int64_t>(w.kv_head) * D};
  };
  // the bins one after another, each a thread's share; a bin's decode rows,
  // item after item, are its own thread's stream to read ahead on (Ahead)
  std::vector<int> order;
  std::vector<int64_t> bounds{0}, rows_before;  // rows_before: the bin's decode rows ahead of the item
  for (const std::vector<int>& items : dealt) {
    int64_t rows = 0;
    for (int i : items) {
      order.push_back(i);
      rows_before.push_back(rows);
      if (qs[work[i].seq + 1] - qs[work[i].seq] == 1) rows += lens[work[i].seq];
    }
    bounds.push_back(static_cast<int64_t>(order.size()));
  }
  std::vector<std::vector<int64_t>> streams(dealt.size());
  std::vector<char> streamed(dealt.size(), 0), tiles_used(static_cast<size_t>(threads), 0);
  auto attend = [&](int64_t at, bool own) {
    const Work& w = work[order[at]];
    const Cache c = cache_of(w);
    const int q_len = qs[w.seq + 1] - qs[w.seq];
    Ahead ahead{nullptr, 0, false};  // an item taken from another thread's bin reads nothing ahead
    if (own) {
      const size_t bin = static_cast<size_t>(at::get_thread_num());
      std::vector<int64_t>& stream = streams[bin];
      if (!streamed[bin]) {
        for (int64_t k = bounds[bin]; k < bounds[bin + 1]; ++k) {
          const Work& d = work[order[k]];
          if (qs[d.seq + 1] - qs[d.seq] != 1) continue;
          const size_t from = stream.size();
          stream.resize(from + lens[d.seq]);
          cache_of(d).offsets(0, lens[d.seq], stream.data() + from);
        }
        streamed[bin] = 1;
      }
      const int64_t first = std::min<int64_t>(rows_before[at] + AHEAD, static_cast<int64_t>(stream.size()));
      ahead = Ahead{stream.data() + first, static_cast<int>(static_cast<int64_t>(stream.size()) - first),
                    rows_before[at] > 0};
    }
    char& used = tiles_used[static_cast<size_t>(at::get_thread_num())];
    const int64_t head0 = static_cast<int64_t>(w.kv_head) * G;
    const T* qw = qp + w.row0 * q_row + head0 * q_head;
    T* ow = op + w.row0 * o_row + head0 * D;
    if (q_len == 1) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && D == 64) {
        if (decode_tiles(bs)) {
          attend_decode_amx(qw, G, kc, vc, c, w.heads, lens[w.seq], ahead, sc, ow);
          used = 1;
          return;
        }
      }
#endif
      attend_decode<T, D>(qw, G, kc, vc, c, w.heads, lens[w.seq], ahead, sc, ow);
      return;
    }
    const int first_pos = lens[w.seq] - q_len + (w.row0 - qs[w.seq]);
    if (!brgemm) {
      attend_tile<T, D>(qw, q_row, G, w.rows, first_pos, kc, vc, c, sc, ow, o_row);
      return;
    }
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<T, float> && D == 64) {
      if (use_amx_tiles()) {
        attend_tile_amx(qw, q_row, G, w.rows, first_pos, kc, vc, c, sc, ow, o_row);
        used = 1;
        return;
      }
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (!std::is_same_v<T, float> && D % DOT_COLS == 0) {
      if (!amx_brgemm()) {
        attend_tile_dot<D>(qw, q_row, G, w.rows, first_pos, kc, vc, c, sc, ow, o_row);
        return;
      }
    }
#endif
    attend_tile_brgemm<T, D>(qw, q_row, G, w.rows, first_pos, kc, vc, c, sc, ow, o_row);
    used = 1;
  };
  // AMX tile state; ATen also forgets the tile configuration it last loaded (attend_tile_amx loads its own)
  parallel_shares(bounds, attend, [&] {
    if (tiles_used[static_cast<size_t>(at::get_thread_num())] && (std::is_same_v<T, float> || amx_brgemm()))
      at::native::cpublas::brgemm_release(!std::is_same_v<T, float>);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, heads, dim], rows strided");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k/v caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start.is_contiguous(),
              "metadata must be int32, rows contiguous");
  const int H = q.size(1), KVH = k_cache.size(2), D = q.size(2);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && H / KVH <= 16, "heads must be a multiple (<= 16) of kv_heads");
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());
#define SF_CASE(T, DIM) \
  if (D == DIM) return run<T, DIM>(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, out), out;
#define SF_DIMS(T) SF_CASE(T, 16) SF_CASE(T, 32) SF_CASE(T, 64) SF_CASE(T, 128) SF_CASE(T, 256)
  if (q.scalar_type() == at::kFloat) {
    SF_DIMS(float)
  } else if (q.scalar_type() == at::kBFloat16) {
    SF_DIMS(c10::BFloat16)
  }
#undef SF_DIMS
#undef SF_CASE
  TORCH_CHECK(false, "paged_attention: unsupported dtype/head_dim ", q.scalar_type(), "/", D);
}

}  // namespace
}  // namespace sf

// Whether prefill tiles go through brgemm; `enabled` false forces the
// hand-written tiles (tests and benchmarks compare the two). Returns where
// brgemm runs now: bit 0 float32, bit 1 bf16.
// Whether bf16 prefill tiles run on AMX's own instructions (attend_tile_amx)
// where they can; `enabled` false sends them to oneDNN's brgemm. Returns
// whether they run on AMX now.
bool sf_attention_amx(bool enabled) {
#if defined(__AVX512F__)
  sf::g_amx_enabled.store(enabled);
  return sf::use_amx_tiles();
#else
  return false;
#endif
}

int64_t sf_attention_brgemm(bool enabled) {
  sf::g_brgemm_enabled.store(enabled);
  return (sf::use_brgemm<float>() ? 1 : 0) | (sf::use_brgemm<c10::BFloat16>() ? 2 : 0);
}

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("attention_brgemm(bool enabled) -> int", &sf_attention_brgemm);
  m.def("attention_amx(bool enabled) -> bool", &sf_attention_amx);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &sf::paged_attention);
}
