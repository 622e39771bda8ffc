// out (M, n) = x (M, K) @ W^T for a few rows M (1-16 in a decode or tree-verification step): float32
// arithmetic on AVX2 + FMA, the weight stored in float32 or, where every value is a bf16 number (a
// bf16 checkpoint served in float32), in bf16: half the bytes to stream, the same products.
//
// W (n, K) is packed once into column panels of 16: packed (NB, K, 16), panel j holding output columns
// 16j..16j+15 with K contiguous. A panel is streamed from memory once and multiplied by up to 6 rows held
// in 12 accumulator registers; more rows take further passes over the same panel, which is then in L2,
// while those passes prefetch the next panel. Up to 6 rows the weight stream bounds the product; from 8
// rows the FMA units do (two 256-bit FMAs a cycle need 8 independent chains: a pass keeps 8-12).
// A bf16 panel row is stored [c0, c8, c1, c9, ..., c7, c15]: each 32-bit lane holds column i in its low
// half and i + 8 in its high half, so one shift and one mask widen it to float32 exactly.
// Each output element is one sequential FMA chain over k, so a row's result does not depend on how many
// rows are multiplied with it (a tree verification computes its rows bit for bit as decodes), nor on
// the weight's storage.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kMaxRowsPerPass = 6;
constexpr int64_t kPrefetchAhead = 16;  // k steps requested ahead of use (1 KiB of float32, 512 B of bf16)

// One k step of a panel, columns 0-7 and 8-15 as float32.
inline void load_panel_row(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

inline void load_panel_row(const at::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One row's step of the tile: broadcast x[m, k], two FMAs into that row's accumulators. The accumulators
// are named variables, not arrays: GCC keeps an accumulator array on the stack and stores every register
// back to it on every k step, which made the kernel store-bound at half its arithmetic speed.
#define SPECSERVE_ROW_FMA(m)                                        \
  if constexpr (MR > m) {                                           \
    const __m256 xb = _mm256_broadcast_ss(xk + m * K);              \
    lo##m = _mm256_fmadd_ps(xb, w_lo, lo##m);                       \
    hi##m = _mm256_fmadd_ps(xb, w_hi, hi##m);                       \
  }
#define SPECSERVE_ROW_STORE(m)                                      \
  if constexpr (MR > m) {                                           \
    _mm256_storeu_ps(out + m * ldo, lo##m);                         \
    _mm256_storeu_ps(out + m * ldo + 8, hi##m);                     \
  }

// x (MR, K) rows times one panel w (K, 16) -> out (MR, 16), leading dimension ldo. Each k step also
// prefetches `ahead + k * 16` (a stream over K panel rows: this panel further on, or the next panel).
template <int MR, _mm_hint kHint, typename W>
inline void panel_tile(const float* x, int64_t K, const W* w, float* out, int64_t ldo, const W* ahead) {
  static_assert(MR >= 1 && MR <= kMaxRowsPerPass);
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0;
  __m256 lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), kHint);
    __m256 w_lo, w_hi;
    load_panel_row(w + k * kPanel, w_lo, w_hi);
    const float* xk = x + k;
    SPECSERVE_ROW_FMA(0) SPECSERVE_ROW_FMA(1) SPECSERVE_ROW_FMA(2)
    SPECSERVE_ROW_FMA(3) SPECSERVE_ROW_FMA(4) SPECSERVE_ROW_FMA(5)
  }
  SPECSERVE_ROW_STORE(0) SPECSERVE_ROW_STORE(1) SPECSERVE_ROW_STORE(2)
  SPECSERVE_ROW_STORE(3) SPECSERVE_ROW_STORE(4) SPECSERVE_ROW_STORE(5)
}

#undef SPECSERVE_ROW_FMA
#undef SPECSERVE_ROW_STORE

template <_mm_hint kHint, typename W>
inline void tile(int64_t rows, const float* x, int64_t K, const W* w, float* out, int64_t ldo, const W* ahead) {
  switch (rows) {
    case 1: return panel_tile<1, kHint>(x, K, w, out, ldo, ahead);
    case 2: return panel_tile<2, kHint>(x, K, w, out, ldo, ahead);
    case 3: return panel_tile<3, kHint>(x, K, w, out, ldo, ahead);
    case 4: return panel_tile<4, kHint>(x, K, w, out, ldo, ahead);
    case 5: return panel_tile<5, kHint>(x, K, w, out, ldo, ahead);
    default: return panel_tile<6, kHint>(x, K, w, out, ldo, ahead);
  }
}

template <typename W>
void multiply(const float* xp, int64_t M, int64_t K, const W* wp, int64_t panels, float* op, int64_t ldo) {
  // rows split evenly over the passes (8 rows: 4 + 4, not 6 + 2): every pass keeps enough FMA chains busy
  const int64_t passes = (M + kMaxRowsPerPass - 1) / kMaxRowsPerPass, per_pass = (M + passes - 1) / passes;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const W* panel = wp + j * K * kPanel;
      // the first pass streams the panel from memory, prefetching into L1 a little ahead of use (at the
      // panel's end that runs on into the next one); further passes read it from L2 and meanwhile
      // prefetch the next panel into L2, so the memory stream overlaps their arithmetic
      tile<_MM_HINT_T0>(std::min(per_pass, M), xp, K, panel, op + j * kPanel, ldo, panel + kPrefetchAhead * kPanel);
      for (int64_t m0 = per_pass; m0 < M; m0 += per_pass) {
        tile<_MM_HINT_T1>(std::min(per_pass, M - m0), xp + m0 * K, K, panel, op + m0 * ldo + j * kPanel, ldo,
                          panel + K * kPanel);
      }
    }
  });
}

at::Tensor few_row_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "few_row_mm: x must be a 2-D float32 CPU tensor, got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x_in.size(1) &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous() && n <= packed.size(0) * kPanel,
              "few_row_mm: packed weight ", packed.sizes(), " ", packed.scalar_type(), " does not match x ",
              x_in.sizes(), " and n=", n, " (float32 or bf16 panels of 16 expected)");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), ldo = panels * kPanel;
  at::Tensor out = at::empty({M, ldo}, x.options());
  if (M == 0) return out.narrow(1, 0, n);
  if (packed.scalar_type() == at::kBFloat16) {
    multiply(x.data_ptr<float>(), M, K, packed.data_ptr<at::BFloat16>(), panels, out.data_ptr<float>(), ldo);
  } else {
    multiply(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), panels, out.data_ptr<float>(), ldo);
  }
  return n == ldo ? out : out.narrow(1, 0, n).contiguous();
}

}  // namespace

TORCH_LIBRARY(specserve, m) { m.def("few_row_mm(Tensor x, Tensor packed, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("few_row_mm", few_row_mm); }
