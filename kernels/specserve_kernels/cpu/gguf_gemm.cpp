// out (M, n) = x (M, K) @ W^T with W kept in a GGUF file's own blocks of 32 weights (Q4_0, Q4_1, Q8_0):
// the 4- or 8-bit codes are widened to float32 in registers, dequantized exactly as GGUF defines them
// (Q4_1: d * q + m; Q4_0: d * (q - 8), stored as m = -8 d; Q8_0: d * q, with d and m float16), and
// multiplied in float32 on AVX2 + FMA + F16C.
//
// W (n, K) is repacked once into column panels of 16: packed (NB, K / 32, bytes), one record per panel
// and block of 32 k steps, the panels' blocks contiguous so that a panel is one stream:
//   Q4_0 / Q4_1: d[16] and m[16] as float16, then 16 pairs of k steps, each 16 bytes: byte c holds
//                column c's code at the even k step in its low nibble and at the odd one in its high.
//   Q8_0:        d[16] as float16, then 32 k steps of 16 signed bytes, byte c column c's code.
// A pass multiplies a panel by up to 4 rows; more rows take further passes over the panel, which is then
// in L1 / L2. Each output element is two FMA chains of exactly dequantized weights, over the even and the
// odd k steps, added at the end: the same operations whatever the rows, so a row's result does not depend
// on how many rows are multiplied with it (a tree verification computes its rows bit for bit as decodes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRowsPerPass = 4;
constexpr int64_t kQ4Bytes = 64 + 256;  // d[16], m[16] float16; 32 x 16 nibbles
constexpr int64_t kQ8Bytes = 32 + 512;  // d[16] float16; 32 x 16 bytes
constexpr int64_t kPrefetchBlocks = 4;  // blocks requested ahead of use

inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void prefetch_record(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
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
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * kQ4Bytes;
    if constexpr (H0 == 0) prefetch_record(rec + kPrefetchBlocks * kQ4Bytes, kQ4Bytes);
    const __m256 d0 = half8(rec + 16 * H0), m0 = half8(rec + 32 + 16 * H0);
    const __m256 d1 = G > 1 ? half8(rec + 16) : z, m1 = G > 1 ? half8(rec + 48) : z;
    const uint8_t* q = rec + 64 + 8 * H0;
    for (int64_t t = 0; t < kBlock / 2; ++t) {
      const int64_t k = b * kBlock + 2 * t;
      const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * t)));
      const __m256 w0e = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, nibble)), d0, m0);
      SPECSERVE_ROWS_FMA(e, 0, k, w0e)
      const __m256 w0o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d0, m0);
      SPECSERVE_ROWS_FMA(o, 0, k + 1, w0o)
      if constexpr (G > 1) {
        const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * t + 8)));
        const __m256 w1e = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, nibble)), d1, m1);
        SPECSERVE_ROWS_FMA(e, 1, k, w1e)
        const __m256 w1o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d1, m1);
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
      const __m128i* qe = reinterpret_cast<const __m128i*>(q + 16 * t);
      const __m128i* qo = reinterpret_cast<const __m128i*>(q + 16 * t + 16);
      const __m256 w0e = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qe))), d0);
      SPECSERVE_ROWS_FMA(e, 0, k, w0e)
      const __m256 w0o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qo))), d0);
      SPECSERVE_ROWS_FMA(o, 0, k + 1, w0o)
      if constexpr (G > 1) {
        const __m128i* qe1 = reinterpret_cast<const __m128i*>(q + 16 * t + 8);
        const __m128i* qo1 = reinterpret_cast<const __m128i*>(q + 16 * t + 24);
        const __m256 w1e = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qe1))), d1);
        SPECSERVE_ROWS_FMA(e, 1, k, w1e)
        const __m256 w1o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(qo1))), d1);
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

void multiply(const TileFn* tiles, int64_t record_bytes, const float* xp, int64_t M, int64_t K, const uint8_t* wp,
              int64_t panels, float* op, int64_t ldo) {
  // rows split evenly over the passes (6 rows: 3 + 3, not 4 + 2): every pass keeps enough FMA chains busy
  const int64_t passes = (M + kMaxRowsPerPass - 1) / kMaxRowsPerPass, per_pass = (M + passes - 1) / passes;
  const int64_t panel_bytes = (K / kBlock) * record_bytes;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* panel = wp + j * panel_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        const int64_t rows = std::min(per_pass, M - m0);
        tiles[rows - 1](xp + m0 * K, K, panel, op + m0 * ldo + j * kPanel, ldo);
      }
    }
  });
}

at::Tensor gguf_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, int64_t qtype) {
  // ggml's type numbers: Q4_0 2, Q4_1 3, Q8_0 8
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "gguf_mm: qtype must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), got ",
              qtype);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "gguf_mm: x must be a 2-D float32 CPU tensor, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t record_bytes = qtype == 8 ? kQ8Bytes : kQ4Bytes;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) * kBlock == x_in.size(1) && packed.size(2) == record_bytes &&
                  n <= packed.size(0) * kPanel,
              "gguf_mm: packed weight ", packed.sizes(), " ", packed.scalar_type(), " does not match x ",
              x_in.sizes(), ", n=", n, " and qtype ", qtype);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), ldo = panels * kPanel;
  at::Tensor out = at::empty({M, ldo}, x.options());
  if (M > 0) {
    multiply(qtype == 8 ? kQ8Tiles : kQ4Tiles, record_bytes, x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(),
             panels, out.data_ptr<float>(), ldo);
  }
  return n == ldo ? out : out.narrow(1, 0, n).contiguous();
}

}  // namespace

// a fragment: the few-row kernel defines the namespace
TORCH_LIBRARY_FRAGMENT(specserve, m) { m.def("gguf_mm(Tensor x, Tensor packed, int n, int qtype) -> Tensor"); }

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("gguf_mm", gguf_mm); }
