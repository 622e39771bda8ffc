// out (M, n) = x (M, K) @ W^T with W kept in a GGUF file's own blocks of 32 weights (Q4_0, Q4_1, Q8_0; float16
// d and m per block), in one of two packed layouts. The float layout (0) runs on AVX2 + FMA + F16C; the integer
// layout (1) on AVX-512 VNNI, and for Q4_0 / Q4_1 on plain AVX2 too.
//
// Float layout: the 4- or 8-bit codes are widened to float32 in registers, dequantized exactly as GGUF defines
// them (Q4_1: d * q + m; Q4_0: d * (q - 8), stored as m = -8 d; Q8_0: d * q) and multiplied in float32.
// W (n, K) is repacked once into column panels of 16: packed (NB, K / 32, bytes), one record per panel and block
// of 32 k steps, the panels' blocks contiguous so that a panel is one stream:
//   Q4_0 / Q4_1: d[16] and m[16] as float16, then 16 pairs of k steps, each 16 bytes: byte c holds
//                column c's code at the even k step in its low nibble and at the odd one in its high.
//   Q8_0:        d[16] as float16, then 32 k steps of 16 signed bytes, byte c column c's code.
// Each output element is two FMA chains of exactly dequantized weights, over the even and the odd k steps,
// added at the end.
//
// Integer layout: each row's activations are split once per call, per block b of 32, into three signed int8
// digits: s = max |x| / 127, a0 = round(x / s), a1 = round(254 (x / s - a0)), a2 = round(254 (254 (x / s - a0)
// - a1)) (each in [-127, 127]), so that x = s (a0 + a1 / 254 + a2 / 254^2) within s / 2 / 254^2, about 6e-8 of
// the block's largest |x| (float32's own rounding of that largest element); a block's smaller elements keep
// that absolute error, not a relative one. Then per column and block the three sums A_j = sum_k q_k a_j,k are
// exact int32 dot products of unsigned codes and signed digits (vpdpbusd; on AVX2, vpmaddubsw + vpmaddwd, whose
// int16 pairs 2 * 15 * 127 cannot saturate) and the block adds
//   d * s * (A0 + (A1 + A2 / 254) / 254) [+ m * sum_k x_k for Q4_1]
// to the column's float32 sum. Q4_0's codes (q - 8) and Q8_0's (stored q + 128, unsigned) are offset exactly
// in the integers: A_j starts at -offset * sum_k a_j,k. sum_k x_k (float32) and the digit sums are computed once
// per call per row and block. Records, one per (panel, block), the panel's blocks contiguous as above:
//   Q4_0: d[16] float16, then 4 chunks of 64 bytes; Q4_1: d[16], m[16] float16, then the same chunks.
//         Byte 4 c + i (c the column, i < 4) of chunk j holds column c's code at k = 8 j + i in its low nibble
//         and at k = 8 j + 4 + i in its high one: one AND, one shift and AND give two vectors in which each
//         32-bit lane holds 4 consecutive k steps of one column, what vpdpbusd multiplies with 4 digits.
//   Q8_0: d[16] float16, then 8 chunks of 64 bytes, byte 4 c + i of chunk j column c's code + 128 at k = 4 j + i.
// Q8_0 has no AVX2 integer kernel (2 * 255 * 127 saturates vpmaddubsw's int16): there it keeps the float layout.
// The integer layout loses what the digits do not represent and rounds each block's term once more. The caller may
// keep fewer digits (`digits`, D): D = 1 is llama.cpp's int8 rounding of the activations (s = max |x| / 127, within
// s / 2 of each x, about 2^-8 of the block's largest), D = 2 within s / 2 / 254 (about 2^-16); each digit kept is
// the same as with three, and the combination uses the kept sums only. A pass then multiplies up to 12 rows with
// one digit on the 32-register kernels (a third of the integer work per row frees the registers: 12 sums and 12
// accumulators), else up to 4.
//
// Both layouts: a pass multiplies a panel by up to 4 rows (12 in the integer layout with one digit); more rows take
// further passes over the panel, which is then in L1 / L2. The float layout dequantizes a panel in registers for up
// to 4 rows; from 5 rows it dequantizes the panel once into a float32 scratch panel (the same values) and multiplies
// it by up to 3 rows a pass, all 16 columns at once, so a verification or a prompt pays the dequantization once
// instead of once a pass. Every output element goes through the same operations whatever the rows multiplied with
// it, so a row's result does not depend on how many rows are multiplied with it (a tree verification computes its
// rows bit for bit as decodes).
// AVX-512 code is compiled only into functions that carry the target and run where the CPU has avx512f, bw, vl
// and vnni (checked at run time; SPECSERVE_GGUF_ISA=avx2 or avx512-256 in the environment picks a narrower
// kernel, for comparisons and tests).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRowsPerPass = 4;
constexpr int64_t kQ4Bytes = 64 + 256;  // d[16], m[16] float16; 32 x 16 nibbles
constexpr int64_t kQ8Bytes = 32 + 512;  // d[16] float16; 32 x 16 bytes
constexpr int64_t kPrefetchBlocks = 4;  // blocks requested ahead of use
constexpr int64_t kIntPrefetchBlocks = 12;  // the integer kernel consumes a block in fewer cycles

inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void prefetch_record(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// Dequantized weights as GGUF defines them, one helper per form, so that the register tiles and the scratch
// panels compute every weight with the same instructions (the same bits). v: 8 codes widened to int32.
inline __m256i q4_codes(const uint8_t* p) {  // 8 bytes, each holding two 4-bit codes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 q4_low(__m256i v, __m256 d, __m256 m) {  // the even k step's codes: d * q + m
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF))), d, m);
}
inline __m256 q4_high(__m256i v, __m256 d, __m256 m) {  // the odd k step's
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
}
inline __m256 q8_weights(const uint8_t* p, __m256 d) {  // 8 signed codes: d * q
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
                       d);
}

// Accumulators: row m, column group g (8 columns), even (e) or odd (o) k steps; named variables, not an
// array (GCC keeps an array on the stack and stores it back on every step). Only those a tile uses exist
// after compilation.
#define SPECSERVE_ACCS(p) __m256 p##00 = z, p##01 = z, p##10 = z, p##11 = z, p##20 = z, p##21 = z, p##30 = z, p##31 = z;
// k step `k` of column group g for every row of the tile: broadcast x[m, k], one FMA into acc p, row m, group g
#define SPECSERVE_ROW_FMA(p, m, g, k, w) \
  if constexpr (MR > m) p##m##g = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + (k)), w, p##m##g);
#define SPECSERVE_ROWS_FMA(p, g, k, w)                                                     \
  SPECSERVE_ROW_FMA(p, 0, g, k, w) SPECSERVE_ROW_FMA(p, 1, g, k, w) SPECSERVE_ROW_FMA(p, 2, g, k, w) \
  SPECSERVE_ROW_FMA(p, 3, g, k, w)
#define SPECSERVE_ROW_STORE(m, g) \
  if constexpr (MR > m && G > g) _mm256_storeu_ps(out + m * ldo + 8 * g, _mm256_add_ps(e##m##g, o##m##g));
#define SPECSERVE_ROWS_STORE                                                                  \
  SPECSERVE_ROW_STORE(0, 0) SPECSERVE_ROW_STORE(1, 0) SPECSERVE_ROW_STORE(2, 0) SPECSERVE_ROW_STORE(3, 0) \
  SPECSERVE_ROW_STORE(0, 1) SPECSERVE_ROW_STORE(1, 1) SPECSERVE_ROW_STORE(2, 1) SPECSERVE_ROW_STORE(3, 1)

// x (MR, K) times G groups of 8 columns of a Q4 panel, from group H0 on -> out (MR, 8 G), leading dimension
// ldo. Each output is two FMA chains, over the even and the odd k steps, added at the end: whatever MR and
// G, the same operations in the same order (rows are independent), and a decode (MR 1, G 2) keeps four
// chains in flight, enough to hide the FMA's latency.
template <int MR, int G, int H0>
void q4_tile(const float* x, int64_t K, const uint8_t* panel, float* out, int64_t ldo) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerPass && G >= 1 && G + H0 <= 2);
  const __m256 z = _mm256_setzero_ps();
  SPECSERVE_ACCS(e) SPECSERVE_ACCS(o)
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * kQ4Bytes;
    if constexpr (H0 == 0) prefetch_record(rec + kPrefetchBlocks * kQ4Bytes, kQ4Bytes);
    const __m256 d0 = half8(rec + 16 * H0), m0 = half8(rec + 32 + 16 * H0);
    const __m256 d1 = G > 1 ? half8(rec + 16) : z, m1 = G > 1 ? half8(rec + 48) : z;
    const uint8_t* q = rec + 64 + 8 * H0;
    for (int64_t t = 0; t < kBlock / 2; ++t) {
      const int64_t k = b * kBlock + 2 * t;
      const __m256i v0 = q4_codes(q + 16 * t);
      const __m256 w0e = q4_low(v0, d0, m0);
      SPECSERVE_ROWS_FMA(e, 0, k, w0e)
      const __m256 w0o = q4_high(v0, d0, m0);
      SPECSERVE_ROWS_FMA(o, 0, k + 1, w0o)
      if constexpr (G > 1) {
        const __m256i v1 = q4_codes(q + 16 * t + 8);
        const __m256 w1e = q4_low(v1, d1, m1);
        SPECSERVE_ROWS_FMA(e, 1, k, w1e)
        const __m256 w1o = q4_high(v1, d1, m1);
        SPECSERVE_ROWS_FMA(o, 1, k + 1, w1o)
      }
    }
  }
  SPECSERVE_ROWS_STORE
}

// x (MR, K) times G groups of 8 columns of a Q8_0 panel, from group H0 on -> out (MR, 8 G); chains as q4_tile's.
template <int MR, int G, int H0>
void q8_tile(const float* x, int64_t K, const uint8_t* panel, float* out, int64_t ldo) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerPass && G >= 1 && G + H0 <= 2);
  const __m256 z = _mm256_setzero_ps();
  SPECSERVE_ACCS(e) SPECSERVE_ACCS(o)
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * kQ8Bytes;
    if constexpr (H0 == 0) prefetch_record(rec + kPrefetchBlocks * kQ8Bytes, kQ8Bytes);
    const __m256 d0 = half8(rec + 16 * H0), d1 = G > 1 ? half8(rec + 16) : z;
    const uint8_t* q = rec + 32 + 8 * H0;
    for (int64_t t = 0; t < kBlock; t += 2) {
      const int64_t k = b * kBlock + t;
      const __m256 w0e = q8_weights(q + 16 * t, d0);
      SPECSERVE_ROWS_FMA(e, 0, k, w0e)
      const __m256 w0o = q8_weights(q + 16 * t + 16, d0);
      SPECSERVE_ROWS_FMA(o, 0, k + 1, w0o)
      if constexpr (G > 1) {
        const __m256 w1e = q8_weights(q + 16 * t + 8, d1);
        SPECSERVE_ROWS_FMA(e, 1, k, w1e)
        const __m256 w1o = q8_weights(q + 16 * t + 24, d1);
        SPECSERVE_ROWS_FMA(o, 1, k + 1, w1o)
      }
    }
  }
  SPECSERVE_ROWS_STORE
}

#undef SPECSERVE_ACCS
#undef SPECSERVE_ROW_FMA
#undef SPECSERVE_ROWS_FMA
#undef SPECSERVE_ROW_STORE
#undef SPECSERVE_ROWS_STORE

using TileFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t);

// Up to 2 rows: the whole panel at once (4 or 8 accumulators); 3-4 rows: one half after the other (6 or 8
// each), the second half reading the panel again from L1.
template <template <int, int, int> class T, int MR>
void entry(const float* x, int64_t K, const uint8_t* p, float* o, int64_t ldo) {
  if constexpr (MR <= 2) {
    T<MR, 2, 0>::run(x, K, p, o, ldo);
  } else {
    T<MR, 1, 0>::run(x, K, p, o, ldo);
    T<MR, 1, 1>::run(x, K, p, o + 8, ldo);
  }
}
template <int MR, int G, int H0>
struct Q4 { static void run(const float* x, int64_t K, const uint8_t* p, float* o, int64_t l) { q4_tile<MR, G, H0>(x, K, p, o, l); } };
template <int MR, int G, int H0>
struct Q8 { static void run(const float* x, int64_t K, const uint8_t* p, float* o, int64_t l) { q8_tile<MR, G, H0>(x, K, p, o, l); } };

constexpr TileFn kQ4Tiles[] = {entry<Q4, 1>, entry<Q4, 2>, entry<Q4, 3>, entry<Q4, 4>};
constexpr TileFn kQ8Tiles[] = {entry<Q8, 1>, entry<Q8, 2>, entry<Q8, 3>, entry<Q8, 4>};

// ---- float layout, from kScratchFromRows rows: the panel dequantized once ----

constexpr int64_t kScratchFromRows = kMaxRowsPerPass + 1;  // fewer rows: one pass of the tiles above
constexpr int64_t kMaxRowsPerScratchPass = 3;  // 12 accumulators, two weights and a broadcast: 15 registers

// panel -> w (K, 16) float32: each weight through the tiles' helpers (same instructions, same values)
void dequantize_q4_panel(const uint8_t* panel, int64_t K, float* w) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* rec = panel + b * kQ4Bytes;
    prefetch_record(rec + kPrefetchBlocks * kQ4Bytes, kQ4Bytes);
    const __m256 d0 = half8(rec), m0 = half8(rec + 32), d1 = half8(rec + 16), m1 = half8(rec + 48);
    const uint8_t* q = rec + 64;
    for (int64_t t = 0; t < kBlock / 2; ++t) {
      float* we = w + (b * kBlock + 2 * t) * kPanel;
      const __m256i v0 = q4_codes(q + 16 * t), v1 = q4_codes(q + 16 * t + 8);
      _mm256_storeu_ps(we, q4_low(v0, d0, m0));
      _mm256_storeu_ps(we + 8, q4_low(v1, d1, m1));
      _mm256_storeu_ps(we + kPanel, q4_high(v0, d0, m0));
      _mm256_storeu_ps(we + kPanel + 8, q4_high(v1, d1, m1));
    }
  }
}

void dequantize_q8_panel(const uint8_t* panel, int64_t K, float* w) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* rec = panel + b * kQ8Bytes;
    prefetch_record(rec + kPrefetchBlocks * kQ8Bytes, kQ8Bytes);
    const __m256 d0 = half8(rec), d1 = half8(rec + 16);
    const uint8_t* q = rec + 32;
    for (int64_t t = 0; t < kBlock; ++t) {
      float* wk = w + (b * kBlock + t) * kPanel;
      _mm256_storeu_ps(wk, q8_weights(q + 16 * t, d0));
      _mm256_storeu_ps(wk + 8, q8_weights(q + 16 * t + 8, d1));
    }
  }
}

#define SPECSERVE_ACCS3(p) __m256 p##0a = z, p##0b = z, p##1a = z, p##1b = z, p##2a = z, p##2b = z;
// k step `k` of row m: broadcast x[m, k], one FMA into each half's accumulator (columns 0-7: a, 8-15: b)
#define SPECSERVE_PANEL_FMA(p, m, k, wa, wb)                          \
  if constexpr (MR > m) {                                            \
    const __m256 xb = _mm256_broadcast_ss(x + m * K + (k));          \
    p##m##a = _mm256_fmadd_ps(xb, wa, p##m##a);                      \
    p##m##b = _mm256_fmadd_ps(xb, wb, p##m##b);                      \
  }
#define SPECSERVE_PANEL_FMAS(p, k, wa, wb) \
  SPECSERVE_PANEL_FMA(p, 0, k, wa, wb) SPECSERVE_PANEL_FMA(p, 1, k, wa, wb) SPECSERVE_PANEL_FMA(p, 2, k, wa, wb)
#define SPECSERVE_PANEL_STORE(m)                                          \
  if constexpr (MR > m) {                                                \
    _mm256_storeu_ps(out + m * ldo, _mm256_add_ps(e##m##a, o##m##a));     \
    _mm256_storeu_ps(out + m * ldo + 8, _mm256_add_ps(e##m##b, o##m##b)); \
  }

// x (MR, K) times a dequantized panel w (K, 16) -> out (MR, 16): the tiles' chains (even and odd k steps, added
// at the end) over the same weights, so the same bits; one broadcast of x feeds both halves.
template <int MR>
void scratch_tile(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerScratchPass);
  const __m256 z = _mm256_setzero_ps();
  SPECSERVE_ACCS3(e) SPECSERVE_ACCS3(o)
  for (int64_t k = 0; k < K; k += 2) {
    const float* we = w + k * kPanel;
    const __m256 wea = _mm256_loadu_ps(we), web = _mm256_loadu_ps(we + 8);
    SPECSERVE_PANEL_FMAS(e, k, wea, web)
    const __m256 woa = _mm256_loadu_ps(we + kPanel), wob = _mm256_loadu_ps(we + kPanel + 8);
    SPECSERVE_PANEL_FMAS(o, k + 1, woa, wob)
  }
  SPECSERVE_PANEL_STORE(0) SPECSERVE_PANEL_STORE(1) SPECSERVE_PANEL_STORE(2)
}

#undef SPECSERVE_ACCS3
#undef SPECSERVE_PANEL_FMA
#undef SPECSERVE_PANEL_FMAS
#undef SPECSERVE_PANEL_STORE

using ScratchFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr ScratchFn kScratchTiles[] = {scratch_tile<1>, scratch_tile<2>, scratch_tile<3>};

// rows split evenly over the passes (6 rows: 3 + 3, not 4 + 2): every pass keeps enough FMA chains busy
inline int64_t rows_per_pass(int64_t M, int64_t most) {
  const int64_t passes = (M + most - 1) / most;
  return (M + passes - 1) / passes;
}

void multiply(bool q8, const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t panels, float* op,
              int64_t ldo) {
  const int64_t panel_bytes = (K / kBlock) * (q8 ? kQ8Bytes : kQ4Bytes);
  if (M < kScratchFromRows) {  // one pass of a register tile: M <= kMaxRowsPerPass
    const TileFn tile = (q8 ? kQ8Tiles : kQ4Tiles)[M - 1];
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) tile(xp, K, wp + j * panel_bytes, op + j * kPanel, ldo);
    });
    return;
  }
  const int64_t per_pass = rows_per_pass(M, kMaxRowsPerScratchPass);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(K * kPanel));  // K x 16: 36 KB at K 576, in L1 / L2
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* panel = wp + j * panel_bytes;
      if (q8) {
        dequantize_q8_panel(panel, K, w.data());
      } else {
        dequantize_q4_panel(panel, K, w.data());
      }
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
        kScratchTiles[rows - 1](xp + m0 * K, K, w.data(), op + m0 * ldo + j * kPanel, ldo);
      }
    }
  });
}

// ---- integer layout ----

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int kMaxDigits = 3;
// per row and block: a0[32], a1[32], a2[32] (the first D of them)
constexpr int64_t digit_bytes(int D) { return D * kBlock; }

constexpr int64_t int_record_bytes(int64_t qtype) {
  return qtype == kQ8_0 ? 32 + 512 : qtype == kQ4_1 ? 64 + 256 : 32 + 256;
}

// Per row and block, computed once per call.
struct BlockTerms {
  float s;          // the digits' scale
  float sum;        // sum_k x_k in float32 (Q4_1's m multiplies it)
  int32_t init[3];  // digit j's accumulator start: -offset * sum_k a_j,k (offset 8 for Q4_0, 128 for Q8_0, else 0)
  int32_t pad[3];
};

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum8(__m256 v) {  // a fixed order: (lanes i + i+4), then (0+2, 1+3), then 0+1
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

// x (M, K) float32 -> digits (M, K / 32, D, 32) int8 (the first D of the three) and terms (M, K / 32): the digit
// split the header describes, in float64 (x / s, the residuals and their products by 254 are exact or within
// 2^-53), each row and block on its own.
// D is a template argument so that the digits not kept are never computed (one digit: a third of the work).
constexpr int64_t kSplitGrain = 32;  // blocks a thread splits at least: fewer are not worth waking a thread for
template <int D>
void split_digits(const float* x, int64_t M, int64_t K, int32_t offset, int8_t* digits, BlockTerms* terms) {
  const int64_t blocks = M * (K / kBlock);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256d base = _mm256_set1_pd(254.0), hi = _mm256_set1_pd(127.0), lo = _mm256_set1_pd(-127.0);
  at::parallel_for(0, blocks, kSplitGrain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xb = x + r * kBlock;  // x is (M, K) contiguous and K is whole blocks: block r of the whole
      int8_t* out = digits + r * digit_bytes(D);
      const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                   v3 = _mm256_loadu_ps(xb + 24);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      const float big = hmax8(mx);
      BlockTerms& t = terms[r];
      t.sum = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
      t.init[0] = t.init[1] = t.init[2] = 0;
      float s = big / 127.0f;
      if (!(s > 0.0f) || !std::isfinite(s)) {  // all zeros; or an infinity or NaN, which the output then carries
        std::fill(out, out + digit_bytes(D), 0);
        const bool finite = std::isfinite(t.sum) && std::isfinite(big);
        t.s = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      while (static_cast<double>(big) > 127.0 * static_cast<double>(s)) s = std::nextafter(s, INFINITY);
      t.s = s;
      const __m256d inv = _mm256_set1_pd(1.0 / static_cast<double>(s));
      __m128i d[D][8];
      __m128i sums[D];
      for (int j = 0; j < D; ++j) sums[j] = _mm_setzero_si128();
      for (int g = 0; g < 8; ++g) {
        const __m256d y = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(xb + 4 * g)), inv);
        const __m256d a0 = _mm256_max_pd(
            _mm256_min_pd(_mm256_round_pd(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), hi), lo);
        d[0][g] = _mm256_cvtpd_epi32(a0);
        if constexpr (D > 1) {
          const __m256d r1 = _mm256_mul_pd(_mm256_sub_pd(y, a0), base);
          const __m256d a1 = _mm256_max_pd(
              _mm256_min_pd(_mm256_round_pd(r1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), hi), lo);
          d[1][g] = _mm256_cvtpd_epi32(a1);
          if constexpr (D > 2) {
            const __m256d r2 = _mm256_mul_pd(_mm256_sub_pd(r1, a1), base);
            d[2][g] = _mm256_cvtpd_epi32(_mm256_max_pd(
                _mm256_min_pd(_mm256_round_pd(r2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), hi), lo));
          }
        }
        for (int j = 0; j < D; ++j) sums[j] = _mm_add_epi32(sums[j], d[j][g]);
      }
      for (int j = 0; j < D; ++j) {
        const __m128i w0 = _mm_packs_epi32(d[j][0], d[j][1]), w1 = _mm_packs_epi32(d[j][2], d[j][3]);
        const __m128i w2 = _mm_packs_epi32(d[j][4], d[j][5]), w3 = _mm_packs_epi32(d[j][6], d[j][7]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * j), _mm_packs_epi16(w0, w1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * j + 16), _mm_packs_epi16(w2, w3));
        t.init[j] = -offset * hsum4(sums[j]);
      }
    }
  });
}

// One tile of the integer layout, written once for every vector width V: x's digits (MR rows) times G groups of
// V::kCols columns of a panel, from group H0 on -> out (MR, G * V::kCols), leading dimension ldo. V's members
// carry no target of their own use: the entry points below, compiled for their instruction set, inline all of
// it (flatten), so AVX-512 instructions exist only in functions that run where the CPU has them. Every loop over
// the rows unrolls whole (16 >= kMaxIntRowsPerPass): a row loop left rolled keeps acc and sum on the stack.
template <class V, int D, int MR, int Q, int G, int H0>
inline void int_tile(const int8_t* digits, const BlockTerms* terms, int64_t blocks, const uint8_t* panel, float* out,
                     int64_t ldo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t R = int_record_bytes(Q), kCodes = Q == kQ4_1 ? 64 : 32;
  constexpr int kChunks = Q == kQ8_0 ? 8 : 4, kQuads = Q == kQ8_0 ? 1 : 2, kSpan = 4 * V::kCols;
  constexpr bool kSplit = MR == 1 && kQuads == 2;
  const int64_t row_digits = blocks * digit_bytes(D);
  F acc[MR][G];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) acc[m][g] = V::zero();
  const F inv = V::splat(1.0f / 254.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * R;
    if constexpr (H0 == 0) prefetch_record(rec + kIntPrefetchBlocks * R, R);
    const int8_t* a = digits + b * digit_bytes(D);
    I sum[D][MR][G];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
      for (int j = 0; j < D; ++j)
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) sum[j][m][g] = V::splat_int(terms[m * blocks + b].init[j]);
    // one row: the high quads of a chunk go to a second set of sums, two dependency chains per digit
    I odd[D][G];
    if constexpr (kSplit) {
#pragma GCC unroll 3
      for (int j = 0; j < D; ++j)
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) odd[j][g] = V::splat_int(0);
    }
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      I w[G][kQuads];
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        const I v = V::load(rec + kCodes + 64 * c + kSpan * (H0 + g));
        if constexpr (Q == kQ8_0) {
          w[g][0] = v;
        } else {
          w[g][0] = V::low_nibbles(v);
          w[g][kQuads - 1] = V::high_nibbles(v);
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < kQuads; ++h)
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
          for (int j = 0; j < D; ++j) {
            const I x4 = V::broadcast4(a + m * row_digits + 32 * j + 4 * (kQuads * c + h));
#pragma GCC unroll 2
            for (int g = 0; g < G; ++g) {
              if (kSplit && h == 1) {
                odd[j][g] = V::dot(odd[j][g], w[g][h], x4);
              } else {
                sum[j][m][g] = V::dot(sum[j][m][g], w[g][h], x4);
              }
            }
          }
    }
    if constexpr (kSplit) {
#pragma GCC unroll 3
      for (int j = 0; j < D; ++j)
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) sum[j][0][g] = V::add_int(sum[j][0][g], odd[j][g]);
    }
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      const F d = V::halves(rec + 2 * V::kCols * (H0 + g));
      const F mq = Q == kQ4_1 ? V::halves(rec + 32 + 2 * V::kCols * (H0 + g)) : d;
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const BlockTerms& t = terms[m * blocks + b];
        F v = V::to_float(sum[D - 1][m][g]);
#pragma GCC unroll 2
        for (int j = D - 2; j >= 0; --j) v = V::fma(v, inv, V::to_float(sum[j][m][g]));
        acc[m][g] = V::fma(v, V::mul(d, V::splat(t.s)), acc[m][g]);
        if constexpr (Q == kQ4_1) acc[m][g] = V::fma(mq, V::splat(t.sum), acc[m][g]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) V::store(out + m * ldo + V::kCols * g, acc[m][g]);
}

// AVX2: 8 columns a vector; a dot product of 4 u8 codes (<= 15) and 4 s8 digits as vpmaddubsw (two pairs, int16,
// at most 2 * 15 * 127) and vpmaddwd by ones (int32).
struct Avx2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kCols = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I splat_int(int32_t v) { return _mm256_set1_epi32(v); }
  static I add_int(I a, I b) { return _mm256_add_epi32(a, b); }
  static I dot(I acc, I w, I x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F halves(const uint8_t* p) { return half8(p); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

using IntTileFn = void (*)(const int8_t*, const BlockTerms*, int64_t, const uint8_t*, float*, int64_t);

// AVX2 has 16 vector registers: one row takes the whole panel at once, more rows one half after the other.
template <int D, int MR, int Q>
__attribute__((flatten)) void avx2_entry(const int8_t* a, const BlockTerms* t, int64_t blocks, const uint8_t* p,
                                         float* o, int64_t ldo) {
  if constexpr (MR == 1) {
    int_tile<Avx2, D, MR, Q, 2, 0>(a, t, blocks, p, o, ldo);
  } else {
    int_tile<Avx2, D, MR, Q, 1, 0>(a, t, blocks, p, o, ldo);
    int_tile<Avx2, D, MR, Q, 1, 1>(a, t, blocks, p, o + 8, ldo);
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// AVX-512 VNNI on 256-bit vectors (EVEX, 32 registers): 8 columns a vector, vpdpbusd.
struct Vnni256 : Avx2 {
  static I dot(I acc, I w, I x) { return _mm256_dpbusd_epi32(acc, w, x); }
};

// AVX-512 VNNI on 512-bit vectors: the 16 columns of a panel in one vector.
struct Vnni512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kCols = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I splat_int(int32_t v) { return _mm512_set1_epi32(v); }
  static I add_int(I a, I b) { return _mm512_add_epi32(a, b); }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

// 32 registers: up to 2 rows the whole panel at once, 3-4 rows one half after the other.
template <int D, int MR, int Q>
__attribute__((flatten)) void vnni256_entry(const int8_t* a, const BlockTerms* t, int64_t blocks, const uint8_t* p,
                                            float* o, int64_t ldo) {
  if constexpr (MR <= 2) {
    int_tile<Vnni256, D, MR, Q, 2, 0>(a, t, blocks, p, o, ldo);
  } else {
    int_tile<Vnni256, D, MR, Q, 1, 0>(a, t, blocks, p, o, ldo);
    int_tile<Vnni256, D, MR, Q, 1, 1>(a, t, blocks, p, o + 8, ldo);
  }
}

template <int D, int MR, int Q>
__attribute__((flatten)) void vnni512_entry(const int8_t* a, const BlockTerms* t, int64_t blocks, const uint8_t* p,
                                            float* o, int64_t ldo) {
  int_tile<Vnni512, D, MR, Q, 1, 0>(a, t, blocks, p, o, ldo);
}

#pragma GCC pop_options

// The integer kernels this CPU runs: 0 none (Q8_0 too on AVX2 only: see the header), 1 AVX2, 2 VNNI on 256-bit
// vectors, 3 VNNI on 512-bit vectors; SPECSERVE_GGUF_ISA (avx2, avx512-256) caps it.
int int_isa() {
  static const int isa = [] {
    __builtin_cpu_init();
    int best = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
    if (best && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      best = 3;  // on Zen 4, as fast as 256-bit vectors at 1-2 rows and faster from 4 on
    const char* cap = std::getenv("SPECSERVE_GGUF_ISA");
    if (cap && std::strcmp(cap, "avx2") == 0) best = std::min(best, 1);
    if (cap && std::strcmp(cap, "avx512-256") == 0) best = std::min(best, 2);
    return best;
  }();
  return isa;
}

// Rows a pass of the integer kernel multiplies: with one digit, 12 on the 32-register kernels (12 sums and 12
// accumulators; a tree of 9-12 rows in one pass over the weights, not two), else 4.
constexpr int64_t kMaxIntRowsPerPass = 12;
inline int64_t int_rows_per_pass(int isa, int D) { return D == 1 && isa >= 2 ? kMaxIntRowsPerPass : kMaxRowsPerPass; }

template <int D, int Q, template <int, int, int> class E, size_t... R>
constexpr std::array<IntTileFn, kMaxIntRowsPerPass> tile_table(std::index_sequence<R...>) {
  return {E<D, static_cast<int>(R) + 1, Q>::fn...};
}
template <int D, int MR, int Q> struct Avx2E { static constexpr IntTileFn fn = avx2_entry<D, std::min(MR, 4), Q>; };
template <int D, int MR, int Q> struct V256E {
  static constexpr IntTileFn fn = vnni256_entry<D, D == 1 ? MR : std::min(MR, 4), Q>;
};
template <int D, int MR, int Q> struct V512E {
  static constexpr IntTileFn fn = vnni512_entry<D, D == 1 ? MR : std::min(MR, 4), Q>;
};

template <int D, int Q>
const IntTileFn* int_tiles_for(int isa) {
  using Rows = std::make_index_sequence<kMaxIntRowsPerPass>;
  static constexpr auto avx2 = tile_table<D, Q, Avx2E>(Rows{});
  static constexpr auto v256 = tile_table<D, Q, V256E>(Rows{});
  static constexpr auto v512 = tile_table<D, Q, V512E>(Rows{});
  return isa >= 3 ? v512.data() : isa == 2 ? v256.data() : avx2.data();
}

template <int Q>
const IntTileFn* int_tiles(int isa, int D) {
  return D == 1 ? int_tiles_for<1, Q>(isa) : D == 2 ? int_tiles_for<2, Q>(isa) : int_tiles_for<3, Q>(isa);
}

void int_multiply(const IntTileFn* tiles, int64_t max_rows, int D, int64_t record_bytes, const int8_t* digits,
                  const BlockTerms* terms, int64_t M, int64_t K, const uint8_t* wp, int64_t panels, float* op,
                  int64_t ldo) {
  const int64_t per_pass = rows_per_pass(M, max_rows);
  const int64_t blocks = K / kBlock, panel_bytes = blocks * record_bytes;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* panel = wp + j * panel_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
        tiles[rows - 1](digits + m0 * blocks * digit_bytes(D), terms + m0 * blocks, blocks, panel,
                        op + m0 * ldo + j * kPanel, ldo);
      }
    }
  });
}

at::Tensor gguf_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, int64_t qtype, int64_t layout,
                   int64_t digits_kept) {
  // ggml's type numbers: Q4_0 2, Q4_1 3, Q8_0 8
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "gguf_mm: qtype must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  TORCH_CHECK(layout == 0 || layout == 1, "gguf_mm: layout must be 0 (float) or 1 (integer), got ", layout);
  TORCH_CHECK(digits_kept >= 1 && digits_kept <= kMaxDigits, "gguf_mm: digits must be 1, 2 or 3, got ", digits_kept);
  const int D = static_cast<int>(digits_kept);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "gguf_mm: x must be a 2-D float32 CPU tensor, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t record_bytes = layout == 1 ? int_record_bytes(qtype) : qtype == kQ8_0 ? kQ8Bytes : kQ4Bytes;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) * kBlock == x_in.size(1) && packed.size(2) == record_bytes &&
                  n <= packed.size(0) * kPanel,
              "gguf_mm: packed weight ", packed.sizes(), " ", packed.scalar_type(), " does not match x ",
              x_in.sizes(), ", n=", n, ", qtype ", qtype, " and layout ", layout);
  const int isa = layout == 1 ? int_isa() : 0;
  TORCH_CHECK(layout == 0 || isa >= 2 || (isa == 1 && qtype != kQ8_0),
              "gguf_mm: this CPU has no integer kernel for qtype ", qtype,
              " (Q4_0 / Q4_1 need AVX2, Q8_0 AVX-512 VNNI); pack it in the float layout");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), ldo = panels * kPanel;
  at::Tensor out = at::empty({M, ldo}, x.options());
  if (M > 0 && layout == 0) {
    multiply(qtype == kQ8_0, x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), panels, out.data_ptr<float>(),
             ldo);
  } else if (M > 0) {
    const int64_t blocks = M * (K / kBlock);
    at::Tensor scratch =
        at::empty({blocks * (digit_bytes(D) + static_cast<int64_t>(sizeof(BlockTerms)))}, x.options().dtype(at::kByte));
    auto* terms = reinterpret_cast<BlockTerms*>(scratch.data_ptr<uint8_t>());  // first: 4-byte aligned
    auto* digits = reinterpret_cast<int8_t*>(scratch.data_ptr<uint8_t>() + blocks * sizeof(BlockTerms));
    const int32_t offset = qtype == kQ8_0 ? 128 : qtype == kQ4_0 ? 8 : 0;
    (D == 1 ? split_digits<1> : D == 2 ? split_digits<2> : split_digits<3>)(x.data_ptr<float>(), M, K, offset, digits,
                                                                           terms);
    const IntTileFn* tiles = qtype == kQ8_0   ? int_tiles<kQ8_0>(isa, D)
                             : qtype == kQ4_1 ? int_tiles<kQ4_1>(isa, D)
                                              : int_tiles<kQ4_0>(isa, D);
    int_multiply(tiles, int_rows_per_pass(isa, D), D, record_bytes, digits, terms, M, K, packed.data_ptr<uint8_t>(),
                 panels, out.data_ptr<float>(), ldo);
  }
  return n == ldo ? out : out.narrow(1, 0, n).contiguous();
}

// What the integer layout runs on this CPU: "avx512" (512-bit vectors), "avx512-256", "avx2" or "none".
std::string gguf_int_kernel() {
  static const char* names[] = {"none", "avx2", "avx512-256", "avx512"};
  return names[int_isa()];
}

}  // namespace

// a fragment: the few-row kernel defines the namespace
TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("gguf_mm(Tensor x, Tensor packed, int n, int qtype, int layout, int digits=3) -> Tensor");
  m.def("gguf_int_kernel() -> str", &gguf_int_kernel);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("gguf_mm", gguf_mm); }
