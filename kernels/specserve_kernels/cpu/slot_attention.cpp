// out (B, T, Hq * D): attention of a few new tokens per request over its cached prefix, read in place from its
// slot of the KV cache, followed by the new tokens' own keys and values. Decode and tree verification on a CPU.
//
//   q      (B, T, Hq, D) float32, roped           k_new, v_new  (B, T, Hkv, D) float32, roped k
//   k_cache, v_cache (slots, Hkv, S, D) float32, bfloat16 or float16, entries [0, cache_lens[b]) of slot slots[b] read
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
// token meets after they were accepted: verifying a tree computes each token as the decode would. Where the cache
// is bfloat16 or float16 the new tokens' K/V are first rounded to it (to nearest, ties to even, as torch writes
// them there), so they are the numbers a later decode reads back from the cache.
//
// Work is split over ATen's threads per request, K/V head and a few of that head's (query head, token) pairs (up to
// three with 512-bit vectors, whose 32 registers hold three pairs' sums): each key and value row of the prefix is
// loaded once for all of a task's pairs, and every pair's sums run as they would alone. 512-bit vectors where the
// CPU has AVX-512 (only functions that carry the target hold its instructions; SPECSERVE_ATTENTION_ISA=avx2 picks
// 256-bit ones), else AVX2 + FMA. The vector width is part of how a result is computed: the two instruction sets
// round differently.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline __m256 widen8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 widen8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Lane j of the result: the sum of a[j]'s 8 lanes, by the same tree for every j.
inline __m256 sum_lanes8(const __m256* a) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum_lanes(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The vector operations, once per instruction set. exp is Cephes' expf (x = n ln2 + r, a degree-6 polynomial in
// r, times 2^n; relative error about 2e-7) for x <= 0, clamped below at -87 (exp(-87) ~ 1.6e-38, float32's
// smallest normal order): the callers' arguments are scores minus their maximum.
struct Avx2 {
  using F = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kPairs = 1;       // (query head, token) pairs sharing a task's rows (16 registers)
  static constexpr int kRowVectors = 8;  // vectors of a value row summed at once
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const at::BFloat16* p) { return widen8(p); }
  static F load(const at::Half* p) { return widen8(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F floor(F a) { return _mm256_floor_ps(a); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F pow2(F n) {  // 2^n for integral n in [-126, 0]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F zero_where_minus_inf(F p, F x) {
    return _mm256_blendv_ps(p, zero(), _mm256_cmp_ps(x, splat(-INFINITY), _CMP_EQ_OQ));
  }
  static __m256 fold(F a) { return a; }  // to 8 lanes: lane j gathers lanes j, j + 8, ...
  static float max_lanes(F a) {
    float v[8];
    store(v, a);
    return *std::max_element(v, v + 8);
  }
};

template <class V>
inline typename V::F exp_nonpositive(typename V::F x) {
  x = V::max(x, V::splat(-87.0f));
  const auto n = V::floor(V::fma(x, V::splat(1.44269504088896341f), V::splat(0.5f)));
  x = V::fnma(n, V::splat(0.693359375f), x);
  x = V::fnma(n, V::splat(-2.12194440e-4f), x);
  auto y = V::splat(1.9875691500e-4f);
  y = V::fma(y, x, V::splat(1.3981999507e-3f));
  y = V::fma(y, x, V::splat(8.3334519073e-3f));
  y = V::fma(y, x, V::splat(4.1665795894e-2f));
  y = V::fma(y, x, V::splat(1.6666665459e-1f));
  y = V::fma(y, x, V::splat(5.0000001201e-1f));
  y = V::add(V::fma(y, V::mul(x, x), x), V::splat(1.0f));
  return V::mul(y, V::pow2(n));
}

// Rows of D elements: row i at base + i * stride.
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  const T* operator[](int64_t i) const { return base + i * stride; }
};

// scores[i * ldq + s] = q_i . key(s) for the nq <= NP queries at q + i * d and the n keys of `keys`, 8 keys at a
// time (the last block padded with row 0, not stored), each key's columns loaded once for every query: per
// (query, key) one FMA chain over the columns, folded to 8 lanes, then one fixed tree (`sum_lanes8`, lane by
// lane the same whichever 8 chains it sums). D: the head size when it is 64 or 128 (loops unrolled), else 0
// and d says it.
template <class V, int NP, int D, typename T>
inline void dot_rows(const float* q, int64_t nq, int64_t ldq, Rows<T> keys, int64_t n, int64_t d, float* scores) {
  const int64_t dd = D ? D : d;
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const T* k[8];
    for (int64_t j = 0; j < 8; ++j) k[j] = keys[s0 + j < n ? s0 + j : 0];
    typename V::F acc[NP][8];
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[i][j] = V::zero();
#pragma GCC unroll 16
    for (int64_t c = 0; c < dd; c += V::kWidth) {
      typename V::F qc[NP];
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i) qc[i] = V::load(q + (i < nq ? i : 0) * d + c);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const auto kj = V::load(k[j] + c);
#pragma GCC unroll 4
        for (int i = 0; i < NP; ++i) acc[i][j] = V::fma(qc[i], kj, acc[i][j]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      if (i >= nq) break;
      __m256 folded[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) folded[j] = V::fold(acc[i][j]);
      float block[8];
      _mm256_storeu_ps(block, sum_lanes8(folded));
      for (int64_t j = 0; j < 8 && s0 + j < n; ++j) scores[i * ldq + s0 + j] = block[j];
    }
  }
}

// Columns [c0, c0 + kChunk W) of sum_i p[i] row(i) for up to NP lists p at once, kept in registers: rows at even
// list indices into one set of accumulators and rows at odd ones into another (two FMA chains per vector, enough
// to hide the FMA's latency), each in list order, the two added at the end. A row shared by the lists (the
// prefix) is loaded once for all of them.
template <class V, int NP>
struct RowSum {
  static constexpr int kChunk = V::kRowVectors;  // vectors of columns at once
  using F = typename V::F;
  F even[NP][kChunk], odd[NP][kChunk];
  int64_t vectors;  // in this chunk

  explicit RowSum(int64_t vectors_) : vectors(vectors_) {
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q)
#pragma GCC unroll 8
      for (int k = 0; k < kChunk; ++k) even[q][k] = odd[q][k] = V::zero();
  }

  // Rows 0, 1, ..., n - 1 of the list (list indices 0, 1, ...: even, odd, ...), the same rows for the nq lists p[q]:
  // each row's vectors loaded once into registers for all of them (with one list, straight from memory).
  template <typename T, typename RowOf>
  inline void add_shared(const float* const* p, int64_t nq, int64_t n, RowOf row_of) {
    if constexpr (NP == 1) {
      add<0, T>(p[0], n, 0, row_of);
    } else {
      int64_t i = 0;
      for (; i + 1 < n; i += 2) {
        shared_row(even, p, nq, i, row_of(i));
        shared_row(odd, p, nq, i + 1, row_of(i + 1));
      }
      if (i < n) shared_row(even, p, nq, i, row_of(i));
    }
  }

  // List Q's rows at list indices first, first + 1, ...: p[i] times row_of(i).
  template <int Q, typename T, typename RowOf>
  inline void add(const float* p, int64_t n, int64_t first, RowOf row_of) {
    int64_t i = 0;
    if (n > 0 && first % 2) fma_row(odd[Q], p[0], row_of(0)), i = 1;
    for (; i + 1 < n; i += 2) {
      fma_row(even[Q], p[i], row_of(i));
      fma_row(odd[Q], p[i + 1], row_of(i + 1));
    }
    if (i < n) fma_row(even[Q], p[i], row_of(i));
  }

  template <typename T>
  inline void shared_row(F (*acc)[kChunk], const float* const* p, int64_t nq, int64_t i, const T* row) {
    F v[kChunk];
#pragma GCC unroll 8
    for (int k = 0; k < kChunk; ++k)
      if (k < vectors) v[k] = V::load(row + k * V::kWidth);
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) {
      if (q >= nq) break;
      const auto pv = V::splat(p[q][i]);
#pragma GCC unroll 8
      for (int k = 0; k < kChunk; ++k)
        if (k < vectors) acc[q][k] = V::fma(pv, v[k], acc[q][k]);
    }
  }

  template <typename T>
  inline void fma_row(F* acc, float p, const T* row) {
    const auto pv = V::splat(p);
#pragma GCC unroll 8
    for (int k = 0; k < kChunk; ++k)
      if (k < vectors) acc[k] = V::fma(pv, V::load(row + k * V::kWidth), acc[k]);
  }

  template <int Q>
  inline void store(float* out, float scale) const {
#pragma GCC unroll 8
    for (int k = 0; k < kChunk; ++k)
      if (k < vectors) V::store(out + k * V::kWidth, V::mul(V::add(even[Q][k], odd[Q][k]), V::splat(scale)));
  }
};

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}): a loop whose index is a
// constant in each copy of the body (register arrays stay in registers).
template <int N, typename Fn, int... I>
inline void unrolled(Fn&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename Fn>
inline void unrolled(Fn&& f) {
  unrolled<N>(f, std::make_integer_sequence<int, N>{});
}

struct Scratch {
  std::vector<float> q, prefix, lists;
  std::vector<int64_t> visible;
};

struct Job {  // one call's tensors, as raw pointers and strides
  const float *q, *k_new, *v_new;
  const void *k_cache, *v_cache;
  const bool* mask;
  const int64_t *slot, *len;
  float* out;
  int64_t q_s[3], kn_s[3], vn_s[3], kc_s[3], vc_s[3], mask_s[3], out_s[2];
  int64_t hq, group, t_len, d;
  int64_t pairs;   // (query head, token) pairs a task, at most V::kPairs (`pairs_per_task`)
  int64_t chunks;  // tasks per (request, K/V head): its group x T pairs, `pairs` a task
};

// One request's K/V head g, for nq <= NP of its (query head, token) pairs, from pair p0 on (pair p: token
// p / group, query head g * group + p % group): every pair's scores over the prefix, each key row loaded once for
// all of them; per pair its list of visible keys' scores, [prefix | visible new tokens], and its softmax; then
// the weighted sums of the value rows, each prefix row loaded once for all of them.
template <class V, int NP, int D, typename CacheT>
inline void attend_pairs(const Job& j, int64_t r, int64_t g, int64_t p0, int64_t nq, Scratch& w) {
  constexpr int64_t W = V::kWidth;
  const int64_t d = j.d, t_len = j.t_len, sl = j.slot[r], prefix_len = j.len[r];
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const Rows<CacheT> kc{static_cast<const CacheT*>(j.k_cache) + sl * j.kc_s[0] + g * j.kc_s[1], j.kc_s[2]};
  const Rows<CacheT> vc{static_cast<const CacheT*>(j.v_cache) + sl * j.vc_s[0] + g * j.vc_s[1], j.vc_s[2]};
  const Rows<float> kn{j.k_new + r * j.kn_s[0] + g * j.kn_s[2], j.kn_s[1]};
  const Rows<float> vn{j.v_new + r * j.vn_s[0] + g * j.vn_s[2], j.vn_s[1]};
  const bool* mask = j.mask + r * j.mask_s[0];
  int64_t tok[NP], head[NP], n_new[NP], n[NP];
  for (int64_t i = 0; i < nq; ++i) tok[i] = (p0 + i) / j.group, head[i] = g * j.group + (p0 + i) % j.group;
  w.q.resize(NP * d);
  for (int64_t i = 0; i < nq; ++i) {
    const float* qi = j.q + r * j.q_s[0] + tok[i] * j.q_s[1] + head[i] * j.q_s[2];
    for (int64_t c = 0; c < d; ++c) w.q[i * d + c] = qi[c] * scale;
  }
  // the prefix's scores, each block of key rows read from memory once for every pair
  w.prefix.resize(NP * prefix_len);
  for (int64_t s0 = 0; s0 < prefix_len; s0 += 64)
    dot_rows<V, NP, D>(w.q.data(), nq, prefix_len, Rows<CacheT>{kc[s0], kc.stride},
                       std::min<int64_t>(64, prefix_len - s0), d, &w.prefix[s0]);
  const int64_t padded = (prefix_len + t_len + W - 1) / W * W;
  w.lists.resize(NP * padded);
  w.visible.resize(NP * t_len);
  float inv[NP];
  const float* p[NP];
  for (int64_t i = 0; i < nq; ++i) {
    float* list = &w.lists[i * padded];
    int64_t* visible = &w.visible[i * t_len];
    n_new[i] = 0;
    for (int64_t k = 0; k < t_len; ++k)
      if (mask[tok[i] * j.mask_s[1] + k * j.mask_s[2]]) visible[n_new[i]++] = k;
    n[i] = prefix_len + n_new[i];
    p[i] = list;
    inv[i] = 0.0f;
    if (n[i] == 0) continue;
    // the token's list of visible keys' scores, [prefix | visible new tokens], padded with -inf to whole vectors
    const int64_t end = (n[i] + W - 1) / W * W;
    std::copy(&w.prefix[i * prefix_len], &w.prefix[i * prefix_len] + prefix_len, list);
    for (int64_t k = 0; k < n_new[i]; ++k)
      dot_rows<V, 1, D>(&w.q[i * d], 1, 1, Rows<float>{kn[visible[k]], kn.stride}, 1, d, &list[prefix_len + k]);
    std::fill(list + n[i], list + end, -std::numeric_limits<float>::infinity());
    auto mv = V::splat(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < end; k += W) mv = V::max(mv, V::load(&list[k]));
    const auto neg_max = V::splat(-V::max_lanes(mv));
    auto sum = V::zero();
    for (int64_t k = 0; k < end; k += W) {  // element k into lane k mod W
      const auto x = V::load(&list[k]);
      const auto e = V::zero_where_minus_inf(exp_nonpositive<V>(V::add(x, neg_max)), x);
      V::store(&list[k], e);
      sum = V::add(sum, e);
    }
    inv[i] = 1.0f / sum_lanes(V::fold(sum));
  }
  const int64_t dd = D ? D : d;
  for (int64_t c0 = 0; c0 < dd; c0 += RowSum<V, NP>::kChunk * W) {  // the prefix's rows, then each pair's new tokens'
    RowSum<V, NP> acc(D ? RowSum<V, NP>::kChunk : std::min<int64_t>(RowSum<V, NP>::kChunk, (dd - c0) / W));
    acc.template add_shared<CacheT>(p, nq, prefix_len, [&](int64_t i) { return vc[i] + c0; });
    unrolled<NP>([&](auto q) {
      constexpr int i = decltype(q)::value;
      if (i >= nq) return;
      const int64_t* visible = &w.visible[i * t_len];
      acc.template add<i, float>(p[i] + prefix_len, n_new[i], prefix_len,
                                 [&](int64_t k) { return vn[visible[k]] + c0; });
      float* o = j.out + r * j.out_s[0] + tok[i] * j.out_s[1] + head[i] * d;
      if (n[i] == 0)
        std::fill(o + c0, o + c0 + acc.vectors * W, 0.0f);
      else
        acc.template store<i>(o + c0, inv[i]);
    });
  }
}

// `attend_pairs` compiled for exactly nq <= NP pairs: a task's last chunk of fewer pairs computes no padding pairs.
template <class V, int NP, int D, typename CacheT>
inline void attend_fewer(const Job& j, int64_t r, int64_t g, int64_t p0, int64_t nq, Scratch& w) {
  if constexpr (NP > 1) {
    if (nq < NP) return attend_fewer<V, NP - 1, D, CacheT>(j, r, g, p0, nq, w);
  }
  attend_pairs<V, NP, D, CacheT>(j, r, g, p0, nq, w);
}

// Tasks [begin, end): task = (request * Hkv + K/V head) * chunks + chunk, NP pairs a task.
template <class V, int NP, int D, typename CacheT>
inline void run_pairs(const Job& j, int64_t begin, int64_t end) {
  thread_local Scratch w;
  const int64_t hkv = j.hq / j.group, pairs = j.group * j.t_len;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t c = task % j.chunks, rg = task / j.chunks, r = rg / hkv, g = rg % hkv;
    attend_fewer<V, NP, D, CacheT>(j, r, g, c * NP, std::min<int64_t>(NP, pairs - c * NP), w);
  }
}

template <class V, int D, typename CacheT>
inline void run_tasks(const Job& j, int64_t begin, int64_t end) {
  if constexpr (V::kPairs >= 3) {
    if (j.pairs == 3) return run_pairs<V, 3, D, CacheT>(j, begin, end);
    if (j.pairs == 2) return run_pairs<V, 2, D, CacheT>(j, begin, end);
  }
  run_pairs<V, 1, D, CacheT>(j, begin, end);
}

// Pairs a task (at most `most`): the most whose tasks split evenly over the threads, or that give every thread
// four tasks or more, so sharing key and value rows between pairs does not leave a thread idle (a decode of one
// request with 3 K/V heads on 2 threads: 6 tasks of 2 and 1 pairs, not 3 of 3).
int64_t pairs_per_task(int64_t most, int64_t requests_kv_heads, int64_t pairs_per_group, int64_t threads) {
  for (int64_t np = most; np > 1; --np) {
    const int64_t tasks = requests_kv_heads * ((pairs_per_group + np - 1) / np);
    if (tasks % threads == 0 || tasks >= 4 * threads) return np;
  }
  return 1;
}

template <class V, typename CacheT>
__attribute__((flatten)) void avx2_tasks(const Job& j, int64_t begin, int64_t end) {
  if (j.d == 64) return run_tasks<V, 64, CacheT>(j, begin, end);
  if (j.d == 128) return run_tasks<V, 128, CacheT>(j, begin, end);
  run_tasks<V, 0, CacheT>(j, begin, end);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// 512-bit vectors: 16 lanes (head sizes a multiple of 16).
struct Avx512 {
  using F = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kPairs = 3;       // (query head, token) pairs sharing a task's rows (32 registers)
  static constexpr int kRowVectors = 4;  // vectors of a value row summed at once
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const at::BFloat16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F pow2(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static F zero_where_minus_inf(F p, F x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, splat(-INFINITY), _CMP_NEQ_UQ), p);
  }
  static __m256 fold(F a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
  static float max_lanes(F a) { return _mm512_reduce_max_ps(a); }
};

template <typename CacheT>
__attribute__((flatten)) void avx512_tasks(const Job& j, int64_t begin, int64_t end) {
  if (j.d == 64) return run_tasks<Avx512, 64, CacheT>(j, begin, end);
  if (j.d == 128) return run_tasks<Avx512, 128, CacheT>(j, begin, end);
  run_tasks<Avx512, 0, CacheT>(j, begin, end);
}

#pragma GCC pop_options

// 512-bit vectors where the CPU has AVX-512 (F, BW, VL, DQ) and SPECSERVE_ATTENTION_ISA is not "avx2".
bool use_avx512() {
  static const bool yes = [] {
    const char* cap = std::getenv("SPECSERVE_ATTENTION_ISA");
    return !(cap && std::string(cap) == "avx2") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

std::string slot_attention_isa() { return use_avx512() ? "avx512" : "avx2"; }

// x (float32) as a cache of `cache_type` keeps it, in float32: x itself for a float32 cache, else a rounded copy
// (to nearest, ties to even, as torch's conversions round; NaN stays NaN).
at::Tensor as_cached(const at::Tensor& x, at::ScalarType cache_type) {
  if (cache_type == at::kFloat) return x;
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options());
  const float* s = src.data_ptr<float>();
  float* d = out.data_ptr<float>();
  const int64_t n = src.numel();
  int64_t i = 0;
  if (cache_type == at::kHalf) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; ++i) d[i] = static_cast<float>(static_cast<at::Half>(s[i]));
  } else {
    const __m256i round = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(s + i);
      const __m256i u = _mm256_castps_si256(v);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(round, odd)), high));
      _mm256_storeu_ps(d + i, _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    for (; i < n; ++i) d[i] = static_cast<float>(static_cast<at::BFloat16>(s[i]));
  }
  return out;
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
  const at::Tensor q = rows_of(q_in, "q", 4), k_cache = rows_of(k_cache_in, "k_cache", 4);
  const at::Tensor v_cache = rows_of(v_cache_in, "v_cache", 4);
  at::Tensor k_new = rows_of(k_new_in, "k_new", 4), v_new = rows_of(v_new_in, "v_new", 4);
  const int64_t b = q.size(0), t_len = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t hkv = k_new.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat && v_new.scalar_type() == at::kFloat,
              "slot_attention: q, k_new and v_new must be float32");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == v_cache.scalar_type() &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
              "slot_attention: the caches must both be float32, both bfloat16 or both float16");
  k_new = as_cached(k_new, cache_type), v_new = as_cached(v_new, cache_type);
  TORCH_CHECK(d % 8 == 0 && hkv > 0 && hq % hkv == 0, "slot_attention: head_dim ", d,
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
  Job j{q.data_ptr<float>(), k_new.data_ptr<float>(), v_new.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
        new_mask.data_ptr<bool>(), slot_p, len_p, out.data_ptr<float>(),
        {q.stride(0), q.stride(1), q.stride(2)}, {k_new.stride(0), k_new.stride(1), k_new.stride(2)},
        {v_new.stride(0), v_new.stride(1), v_new.stride(2)}, {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
        {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
        {new_mask.stride(0), new_mask.stride(1), new_mask.stride(2)}, {out.stride(0), out.stride(1)},
        hq, hq / hkv, t_len, d, 1, 1};
  const bool wide = use_avx512() && d % 16 == 0;
  j.pairs = pairs_per_task(wide ? Avx512::kPairs : Avx2::kPairs, b * hkv, j.group * t_len, at::get_num_threads());
  j.chunks = (j.group * t_len + j.pairs - 1) / j.pairs;
  at::parallel_for(0, b * hkv * j.chunks, 1, [&](int64_t begin, int64_t end) {
    switch (cache_type) {
      case at::kBFloat16:
        return wide ? avx512_tasks<at::BFloat16>(j, begin, end) : avx2_tasks<Avx2, at::BFloat16>(j, begin, end);
      case at::kHalf:
        return wide ? avx512_tasks<at::Half>(j, begin, end) : avx2_tasks<Avx2, at::Half>(j, begin, end);
      default:
        return wide ? avx512_tasks<float>(j, begin, end) : avx2_tasks<Avx2, float>(j, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("slot_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor cache_lens, Tensor new_mask) -> Tensor");
  m.def("slot_attention_isa() -> str", &slot_attention_isa);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("slot_attention", slot_attention); }
