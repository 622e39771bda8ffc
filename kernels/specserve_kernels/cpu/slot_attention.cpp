// out (B, T, Hq * D): attention of a few new tokens per request over its cached prefix, read in place from its
// slot of the KV cache, followed by the new tokens' own keys and values. Decode and tree verification on a CPU.
//
//   q      (B, T, Hq, D) float32, roped           k_new, v_new  (B, T, Hkv, D) float32, roped k
//   k_cache, v_cache (slots, Hkv, S, D) float32 or bfloat16, entries [0, cache_lens[b]) of slot slots[b] read
//   new_mask (B, T, T) bool: new token t sees new token j where new_mask[b, t, j]
//
// Query head h reads K/V head h / (Hq / Hkv) (grouped-query attention without repeating K/V). Softmax in
// float32 with scale D^-1/2; a token that sees no key gets zeros. Every tensor may have any strides (one whose
// last dimension is not contiguous is copied first); the prefix's rows are read where they lie, not gathered.
//
// A token's output is computed the same way bit for bit whatever else is in the call. Its visible keys are
// taken in order, [prefix | visible new tokens], and every sum runs over that list: each score is one dot
// product with a fixed reduction tree; the softmax's sum accumulates element i into lane i mod 8 and adds the
// lanes with a fixed tree; the output adds p_i v_i in list order. In a tree verification a token's visible new
// tokens are its ancestors, at the positions they take once accepted, so its list is the one a decode of the same
// token meets after they were accepted: verifying a tree computes each token as the decode would.
//
// Work is split per (request, query head) over ATen's threads. AVX2 + FMA (and F16C-free bfloat16 widening).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exp of 8 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), relative error about
// 2e-7; arguments are clamped to [-88.3, 88.3] (exp(-88.3) is below float32's normal range: 0 here).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Lane j of the result: the sum of a[j]'s 8 lanes, by the same tree for every j.
inline __m256 sum_lanes8(const __m256 a[8]) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum_lanes(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows of D elements: row i at base + i * stride.
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  const T* operator[](int64_t i) const { return base + i * stride; }
};

// scores[i] = q . key(i) for the n keys of `keys`, 8 at a time (the last block padded with row 0, not stored):
// 8 independent FMA chains over the columns, then one fixed tree per key.
template <typename T>
void dot_rows(const float* q, Rows<T> keys, int64_t n, int64_t d, float* scores) {
  for (int64_t s0 = 0; s0 < n; s0 += kLanes) {
    const T* k[8];
    for (int64_t j = 0; j < kLanes; ++j) k[j] = keys[s0 + j < n ? s0 + j : 0];
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, load8(k[j] + c), acc[j]);
    }
    float block[8];
    _mm256_storeu_ps(block, sum_lanes8(acc));
    for (int64_t j = 0; j < kLanes && s0 + j < n; ++j) scores[s0 + j] = block[j];
  }
}

// out[c0, c0 + 64) += sum_i p[i] * row(i)[c0, c0 + 64) over the n rows, in order, in registers.
template <typename T, typename RowOf>
inline void add_rows(float* out, const float* p, int64_t n, RowOf row_of, int64_t c0, int64_t width) {
  __m256 acc[8];
  const int64_t chunks = width / kLanes;
  for (int k = 0; k < 8; ++k) acc[k] = k < chunks ? _mm256_loadu_ps(out + c0 + k * kLanes) : _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pv = _mm256_set1_ps(p[i]);
    const T* v = row_of(i) + c0;
    for (int k = 0; k < 8; ++k)
      if (k < chunks) acc[k] = _mm256_fmadd_ps(pv, load8(v + k * kLanes), acc[k]);
  }
  for (int k = 0; k < 8; ++k)
    if (k < chunks) _mm256_storeu_ps(out + c0 + k * kLanes, acc[k]);
}

struct Scratch {
  std::vector<float> q, prefix, list, out;
  std::vector<int64_t> visible;
};

// One request's query head: its T tokens over the prefix (prefix_len rows of kc / vc) and the new tokens.
template <typename CacheT>
void attend_head(const float* q0, int64_t q_stride, Rows<CacheT> kc, Rows<CacheT> vc, int64_t prefix_len,
                 Rows<float> kn, Rows<float> vn, const bool* mask, int64_t mask_t, int64_t mask_j, int64_t t_len,
                 int64_t d, float* out0, int64_t out_stride, Scratch& w) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  w.q.resize(t_len * d);
  w.prefix.resize(t_len * prefix_len);
  w.out.resize(d);
  w.visible.resize(t_len);
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t c = 0; c < d; ++c) w.q[t * d + c] = q0[t * q_stride + c] * scale;
  // the prefix's scores for every token at once: each key row is read from memory once for all T tokens
  for (int64_t s0 = 0; s0 < prefix_len; s0 += 64) {
    const int64_t n = std::min<int64_t>(64, prefix_len - s0);
    Rows<CacheT> block{kc[s0], kc.stride};
    for (int64_t t = 0; t < t_len; ++t) dot_rows(&w.q[t * d], block, n, d, &w.prefix[t * prefix_len + s0]);
  }
  for (int64_t t = 0; t < t_len; ++t) {
    const float* q = &w.q[t * d];
    int64_t n_new = 0;
    for (int64_t j = 0; j < t_len; ++j)
      if (mask[t * mask_t + j * mask_j]) w.visible[n_new++] = j;
    const int64_t n = prefix_len + n_new;
    float* o = out0 + t * out_stride;
    if (n == 0) {
      std::fill(o, o + d, 0.0f);
      continue;
    }
    // the token's list of visible keys' scores, [prefix | visible new tokens]
    w.list.resize(n + kLanes);
    std::copy(&w.prefix[t * prefix_len], &w.prefix[t * prefix_len] + prefix_len, w.list.begin());
    for (int64_t i = 0; i < n_new; ++i) {
      const int64_t j = w.visible[i];
      dot_rows(q, Rows<float>{kn[j], kn.stride}, 1, d, &w.list[prefix_len + i]);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, w.list[i]);
    std::fill(w.list.begin() + n, w.list.end(), -std::numeric_limits<float>::infinity());
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += kLanes) {  // lanes past n hold exp(-inf) = 0
      __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(&w.list[i]), mv));
      p = _mm256_blendv_ps(p, _mm256_setzero_ps(), _mm256_cmp_ps(_mm256_loadu_ps(&w.list[i]), _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
      _mm256_storeu_ps(&w.list[i], p);
      sum = _mm256_add_ps(sum, p);
    }
    std::fill(w.out.begin(), w.out.end(), 0.0f);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {  // the prefix's rows, then the visible new tokens', in list order
      const int64_t width = std::min<int64_t>(64, d - c0);
      add_rows<CacheT>(w.out.data(), w.list.data(), prefix_len, [&](int64_t i) { return vc[i]; }, c0, width);
      add_rows<float>(w.out.data(), w.list.data() + prefix_len, n_new, [&](int64_t i) { return vn[w.visible[i]]; },
                      c0, width);
    }
    const float inv = 1.0f / sum_lanes(sum);
    for (int64_t c = 0; c < d; ++c) o[c] = w.out[c] * inv;
  }
}

// x itself where its last dimension is contiguous, else a contiguous copy.
at::Tensor rows_of(const at::Tensor& x, const char* name, int64_t dims) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == dims, "slot_attention: ", name, " must be a CPU tensor of ", dims,
              " dimensions, got ", x.sizes());
  return x.stride(-1) == 1 ? x : x.contiguous();
}

at::Tensor slot_attention(const at::Tensor& q_in, const at::Tensor& k_new_in, const at::Tensor& v_new_in,
                          const at::Tensor& k_cache_in, const at::Tensor& v_cache_in, const at::Tensor& slots,
                          const at::Tensor& cache_lens, const at::Tensor& new_mask) {
  const at::Tensor q = rows_of(q_in, "q", 4), k_new = rows_of(k_new_in, "k_new", 4);
  const at::Tensor v_new = rows_of(v_new_in, "v_new", 4);
  const at::Tensor k_cache = rows_of(k_cache_in, "k_cache", 4), v_cache = rows_of(v_cache_in, "v_cache", 4);
  const int64_t b = q.size(0), t_len = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t hkv = k_new.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat && v_new.scalar_type() == at::kFloat,
              "slot_attention: q, k_new and v_new must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "slot_attention: the caches must both be float32 or both bfloat16");
  TORCH_CHECK(d % kLanes == 0 && hkv > 0 && hq % hkv == 0, "slot_attention: head_dim ", d,
              " must be a multiple of 8 and Hq ", hq, " a multiple of Hkv ", hkv);
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(0) == b && k_new.size(1) == t_len && k_new.size(3) == d,
              "slot_attention: k_new and v_new must be (B, T, Hkv, D) like q");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == hkv && k_cache.size(3) == d,
              "slot_attention: the caches must be (slots, Hkv, S, D)");
  TORCH_CHECK(new_mask.scalar_type() == at::kBool && new_mask.dim() == 3 && new_mask.size(0) == b &&
                  new_mask.size(1) == t_len && new_mask.size(2) == t_len,
              "slot_attention: new_mask must be bool (B, T, T)");
  const at::Tensor slot = slots.to(at::kLong).contiguous(), lens = cache_lens.to(at::kLong).contiguous();
  TORCH_CHECK(slot.numel() == b && lens.numel() == b, "slot_attention: slots and cache_lens must be (B,)");
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(slot_p[i] >= 0 && slot_p[i] < k_cache.size(0), "slot_attention: slot ", slot_p[i], " out of range");
    TORCH_CHECK(len_p[i] >= 0 && len_p[i] <= k_cache.size(2), "slot_attention: cache length ", len_p[i],
                " out of range");
  }
  at::Tensor out = at::empty({b, t_len, hq * d}, q.options());
  const int64_t group = hq / hkv;
  auto run = [&](auto cache_tag) {
    using CacheT = decltype(cache_tag);
    const CacheT* kc = k_cache.data_ptr<CacheT>();
    const CacheT* vc = v_cache.data_ptr<CacheT>();
    const bool* mask = new_mask.data_ptr<bool>();
    at::parallel_for(0, b * hq, 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch w;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / hq, h = task % hq, g = h / group, sl = slot_p[r];
        attend_head(q.data_ptr<float>() + r * q.stride(0) + h * q.stride(2), q.stride(1),
                    Rows<CacheT>{kc + sl * k_cache.stride(0) + g * k_cache.stride(1), k_cache.stride(2)},
                    Rows<CacheT>{vc + sl * v_cache.stride(0) + g * v_cache.stride(1), v_cache.stride(2)}, len_p[r],
                    Rows<float>{k_new.data_ptr<float>() + r * k_new.stride(0) + g * k_new.stride(2), k_new.stride(1)},
                    Rows<float>{v_new.data_ptr<float>() + r * v_new.stride(0) + g * v_new.stride(2), v_new.stride(1)},
                    mask + r * new_mask.stride(0), new_mask.stride(1), new_mask.stride(2), t_len, d,
                    out.data_ptr<float>() + r * out.stride(0) + h * d, out.stride(1), w);
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("slot_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor cache_lens, Tensor new_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("slot_attention", slot_attention); }
