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
// A pass multiplies a panel by up to 6 rows, 8 columns at a time (6 accumulator registers: the
// dequantized codes, scales and rows' broadcasts fit beside them in AVX2's 16); more rows take further
// passes over the panel, which is then in L1 / L2. Each output element is one sequential FMA chain over k of
// exactly dequantized weights, so a row's result does not depend on how many rows are multiplied with it
// (a tree verification computes its rows bit for bit as decodes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRowsPerPass = 6;
constexpr int64_t kQ4Bytes = 64 + 256;  // d[16], m[16] float16; 32 x 16 nibbles
constexpr int64_t kQ8Bytes = 32 + 512;  // d[16] float16; 32 x 16 bytes
constexpr int64_t kPrefetchBlocks = 4;  // blocks requested ahead of use

inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void prefetch_record(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// One k step for every row of the pass: broadcast x[m, k], one FMA into that row's accumulator (named
// variables, not an array: GCC keeps an array on the stack and stores it back on every step).
#define SPECSERVE_ROW_FMA(m, k)                                     \
  if constexpr (MR > m) acc##m = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + (k)), w, acc##m);
#define SPECSERVE_ROWS_FMA(k)                                                             \
  SPECSERVE_ROW_FMA(0, k) SPECSERVE_ROW_FMA(1, k) SPECSERVE_ROW_FMA(2, k) SPECSERVE_ROW_FMA(3, k) \
  SPECSERVE_ROW_FMA(4, k) SPECSERVE_ROW_FMA(5, k)
#define SPECSERVE_ROW_STORE(m) \
  if constexpr (MR > m) _mm256_storeu_ps(out + m * ldo, acc##m);
#define SPECSERVE_ROWS_STORE                                                                  \
  SPECSERVE_ROW_STORE(0) SPECSERVE_ROW_STORE(1) SPECSERVE_ROW_STORE(2) SPECSERVE_ROW_STORE(3) \
  SPECSERVE_ROW_STORE(4) SPECSERVE_ROW_STORE(5)

// x (MR, K) times 8 columns (half H of a Q4 panel, its `blocks` records) -> out (MR, 8), leading
// dimension ldo. The first half streams the panel from memory; the second reads it again from L1 / L2.
template <int MR, int H>
void q4_tile(const float* x, int64_t K, const uint8_t* panel, float* out, int64_t ldo) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerPass);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * kQ4Bytes;
    if constexpr (H == 0) prefetch_record(rec + kPrefetchBlocks * kQ4Bytes, kQ4Bytes);
    const __m256 d = half8(rec + 16 * H), m = half8(rec + 32 + 16 * H);
    const uint8_t* q = rec + 64 + 8 * H;
    for (int64_t t = 0; t < kBlock / 2; ++t) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * t)));
      const int64_t k = b * kBlock + 2 * t;
      {
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), d, m);
        SPECSERVE_ROWS_FMA(k)
      }
      {
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
        SPECSERVE_ROWS_FMA(k + 1)
      }
    }
  }
  SPECSERVE_ROWS_STORE
}

// x (MR, K) times 8 columns (half H of a Q8_0 panel) -> out (MR, 8).
template <int MR, int H>
void q8_tile(const float* x, int64_t K, const uint8_t* panel, float* out, int64_t ldo) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerPass);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0;
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * kQ8Bytes;
    if constexpr (H == 0) prefetch_record(rec + kPrefetchBlocks * kQ8Bytes, kQ8Bytes);
    const __m256 d = half8(rec + 16 * H);
    const uint8_t* q = rec + 32 + 8 * H;
    for (int64_t t = 0; t < kBlock; ++t) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * t)));
      const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
      SPECSERVE_ROWS_FMA(b * kBlock + t)
    }
  }
  SPECSERVE_ROWS_STORE
}

#undef SPECSERVE_ROW_FMA
#undef SPECSERVE_ROWS_FMA
#undef SPECSERVE_ROW_STORE
#undef SPECSERVE_ROWS_STORE

using TileFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t);

// a panel's two halves, one after the other
template <int MR>
void q4_entry(const float* x, int64_t K, const uint8_t* p, float* o, int64_t ldo) {
  q4_tile<MR, 0>(x, K, p, o, ldo);
  q4_tile<MR, 1>(x, K, p, o + 8, ldo);
}
template <int MR>
void q8_entry(const float* x, int64_t K, const uint8_t* p, float* o, int64_t ldo) {
  q8_tile<MR, 0>(x, K, p, o, ldo);
  q8_tile<MR, 1>(x, K, p, o + 8, ldo);
}

constexpr TileFn kQ4Tiles[] = {q4_entry<1>, q4_entry<2>, q4_entry<3>, q4_entry<4>, q4_entry<5>, q4_entry<6>};
constexpr TileFn kQ8Tiles[] = {q8_entry<1>, q8_entry<2>, q8_entry<3>, q8_entry<4>, q8_entry<5>, q8_entry<6>};

void multiply(const TileFn* tiles, int64_t record_bytes, const float* xp, int64_t M, int64_t K, const uint8_t* wp,
              int64_t panels, float* op, int64_t ldo) {
  // rows split evenly over the passes (8 rows: 4 + 4, not 6 + 2): every pass keeps enough FMA chains busy
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
