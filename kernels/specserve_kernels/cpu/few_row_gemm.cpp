// out (M, n) = x (M, K) @ W^T for a few rows M (1-16 in a decode or tree-verify step), float32, AVX2 + FMA.
//
// W (n, K) is packed once into column panels of 16: packed (NB, K, 16), panel j holding output columns
// 16j..16j+15 with K contiguous. A panel is streamed from memory once and multiplied by up to 6 rows held
// in 12 accumulator registers; more rows take further passes over the same panel, which is then in L2.
// At one row the weight stream bounds the step; on a 2-core AVX2 CPU arithmetic does from about 4 rows.
// Each output element is one sequential FMA chain over k, so a row's result does not depend
// on how many rows are multiplied with it (a tree verification computes its rows bit for bit as decodes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kMaxRowsPerPass = 6;
constexpr int64_t kPrefetchAhead = 16;  // k steps (1 KiB of the panel) requested ahead of use

template <int MR>
inline void panel_tile(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  __m256 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchAhead) * kPanel), _MM_HINT_T0);
    const __m256 w_lo = _mm256_loadu_ps(w + k * kPanel), w_hi = _mm256_loadu_ps(w + k * kPanel + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      lo[m] = _mm256_fmadd_ps(xb, w_lo, lo[m]);
      hi[m] = _mm256_fmadd_ps(xb, w_hi, hi[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ldo, lo[m]);
    _mm256_storeu_ps(out + m * ldo + 8, hi[m]);
  }
}

inline void tile(int64_t rows, const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return panel_tile<1>(x, K, w, out, ldo);
    case 2: return panel_tile<2>(x, K, w, out, ldo);
    case 3: return panel_tile<3>(x, K, w, out, ldo);
    case 4: return panel_tile<4>(x, K, w, out, ldo);
    case 5: return panel_tile<5>(x, K, w, out, ldo);
    default: return panel_tile<6>(x, K, w, out, ldo);
  }
}

at::Tensor few_row_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "few_row_mm: x must be a 2-D float32 CPU tensor, got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x_in.size(1) &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous() && n <= packed.size(0) * kPanel,
              "few_row_mm: packed weight ", packed.sizes(), " does not match x ", x_in.sizes(), " and n=", n);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), ldo = panels * kPanel;
  at::Tensor out = at::empty({M, ldo}, x.options());
  if (M == 0) return out.narrow(1, 0, n);
  // rows split evenly over the passes (8 rows: 4 + 4, not 6 + 2): every pass keeps enough FMA chains busy
  const int64_t passes = (M + kMaxRowsPerPass - 1) / kMaxRowsPerPass, per_pass = (M + passes - 1) / passes;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
        tile(std::min(per_pass, M - m0), xp + m0 * K, K, wp + j * K * kPanel, op + m0 * ldo + j * kPanel, ldo);
      }
    }
  });
  return n == ldo ? out : out.narrow(1, 0, n).contiguous();
}

}  // namespace

TORCH_LIBRARY(specserve, m) { m.def("few_row_mm(Tensor x, Tensor packed, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("few_row_mm", few_row_mm); }
