// The attention of a decode step (one query position per row) on an x86 CPU, as the operator
// gpt_fast::decode_attention_cpu (built with cpu_gemv.cpp into one library by gpt_fast/kernels/cpu_gemv.py): the
// rotary embedding of the step's query and key, the write of its key and value into the cache, and the attention over
// the positions the query sees, in one call per layer.
//
// The model's compiled code reads the whole cache under an additive mask, every position up to the cache's length;
// this reads the positions up to the query's own (and not older than a sliding window). Each kv head's keys and values
// are read once for the query heads that share them. Sums are float32, as the model's code (attend_one_query) sums
// them; the rotated query and key are rounded to the query's dtype first, as that code rounds them. The cache may
// hold keys and values in a narrower dtype than the query's (a float32 model's float16, bfloat16 or float8_e4m3fn
// cache): the key and value are rounded to it as they are written, as KVCache.update rounds them (float8's clamped
// to its largest, 448), and widened as they are read.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace gpt_fast_cpu {

void share_tasks(int64_t tasks, int64_t wanted, c10::function_ref<void(int64_t)> task);  // cpu_threads.cpp's

// e^x for 8 float32 x <= 0 (scores less their maximum; cpu_layers.cpp's gated activations call it too), to within
// 2 ulp: x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so that r is exact), e^r by its Taylor polynomial
// of degree 7 in Horner form, times 2^k built in the exponent bits; below -87 (2^k underflows) the result is 0
__m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.f);
  const __m256 tiny = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Whether the attention reads a float32 model's cache of `dtype` (with_cache_type's): its own float32, or float16,
// bfloat16 or float8_e4m3fn (cpu_layers.cpp's check_caches asks too)
bool reads_cache_of(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat8_e4m3fn;
}

}  // namespace gpt_fast_cpu

namespace {

using gpt_fast_cpu::exp8;
using gpt_fast_cpu::reads_cache_of;

constexpr int64_t LANES = 8;  // float32 lanes of an AVX2 vector
constexpr int64_t KEYS = 4;   // keys whose scores are summed side by side (dots)
// positions ahead whose keys and values are prefetched while scores are summed, in a paged cache: its blocks are
// short runs at scattered places, which the hardware's prefetchers do not follow (docs/cpu.md, "A narrower KV
// cache"); a static cache's one run per head they follow themselves
constexpr int64_t AHEAD = 16;
// keys and values a thread reads at least (attend_rows): 128 KB, so that a server's 4 rows share both threads from
// position 8 on (the default model's 30 layers, 4 rows at position 135: 1.20 ms a step against one thread's 2.76)
constexpr int64_t THREAD_BYTES = 1 << 17;

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// round a float32 to the dtype T and back, as `.to(dtype)` then `.float()` do
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// a key's or value's element as the cache of dtype C holds it: rounded to C, as KVCache.update rounds it
template <typename C>
inline C to_cache(float x) {
  return static_cast<C>(x);
}

template <>
inline c10::Float8_e4m3fn to_cache(float x) {  // clamped to the largest float8 first, as cache.py's `stored`
  constexpr float LARGEST = 448.f;
  return static_cast<c10::Float8_e4m3fn>(std::clamp(x, -LARGEST, LARGEST));
}

// 8 values from p as float32
inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}

inline __m256 load8(const c10::BFloat16* p) {  // a bfloat16 is a float32's high half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const c10::Half* p) {  // F16C, which every AVX2 CPU has
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// e4m3fn: a sign, 4 exponent bits of bias 7 and 3 of mantissa. Each byte placed in the high half of a 16-bit lane
// and shifted right by one, its sign copied into bit 14, which is cleared: the sign in bit 15 and the exponent and
// mantissa from bit 7, a float16 of bias 15, widened by F16C and times 2^8 for the bias; exact for subnormals too
// (a float16 subnormal widens to a normal float32)
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<int16_t>(0xbfff)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the sums of the 8 lanes of a, b, c and d, in that order
inline __m128 sum_lanes4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // each 128-bit half's sums
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// out[g * stride + j] = the sum over d < D of q[g * D + d] * keys[j][d] for g < HEADS, j < KEYS (D a multiple of
// LANES): HEADS x KEYS chains of fused multiply-adds side by side (one dot product at a time waits on each
// addition's latency), each key's vector loaded (and widened) once for the query heads that share it
template <int64_t HEADS, typename C>
inline void dots(const float* q, const C* const* keys, int64_t D, float* out, int64_t stride) {
  static_assert(KEYS == 4, "sum_lanes4 sums four keys' lanes");
  __m256 sums[HEADS][KEYS];
  for (auto& head : sums) std::fill(head, head + KEYS, _mm256_setzero_ps());
  for (int64_t d = 0; d < D; d += LANES) {
    __m256 key[KEYS];
    for (int64_t j = 0; j < KEYS; ++j) key[j] = load8(keys[j] + d);
    for (int64_t g = 0; g < HEADS; ++g) {
      const __m256 x = _mm256_loadu_ps(q + g * D + d);
      for (int64_t j = 0; j < KEYS; ++j) sums[g][j] = _mm256_fmadd_ps(x, key[j], sums[g][j]);
    }
  }
  for (int64_t g = 0; g < HEADS; ++g) {
    _mm_storeu_ps(out + g * stride, sum_lanes4(sums[g][0], sums[g][1], sums[g][2], sums[g][3]));
  }
}

// dots for G query heads: three at a time (12 of AVX2's 16 registers hold their sums), then two or one
template <typename C>
inline void dots_of_heads(const float* q, const C* const* keys, int64_t G, int64_t D, float* out, int64_t stride) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) dots<3>(q + g * D, keys, D, out + g * stride, stride);
  if (g + 2 <= G) {
    dots<2>(q + g * D, keys, D, out + g * stride, stride);
  } else if (g < G) {
    dots<1>(q + g * D, keys, D, out + g * stride, stride);
  }
}

// out[g * out_stride + d] = (the sum over p < n of w[g * w_stride + p] * values[p][d]) / totals[g] for g < heads
// (at most HEADS) and the VECTORS x LANES columns from d0, rounded to T: the sums in registers, p after p (the
// model's order), each value's vectors loaded (and widened) once for the query heads, where a sum kept in memory is
// a load and a store for every position
template <int64_t VECTORS, int64_t HEADS, typename C, typename T>
inline void weighted_columns(const float* w, int64_t w_stride, const C* const* values, int64_t n, int64_t d0,
                             int64_t heads, const float* totals, T* out, int64_t out_stride) {
  __m256 acc[HEADS][VECTORS];
  for (auto& head : acc) std::fill(head, head + VECTORS, _mm256_setzero_ps());
  for (int64_t p = 0; p < n; ++p) {
    __m256 value[VECTORS];
    for (int64_t c = 0; c < VECTORS; ++c) value[c] = load8(values[p] + d0 + c * LANES);
    for (int64_t g = 0; g < HEADS && g < heads; ++g) {
      const __m256 weight = _mm256_set1_ps(w[g * w_stride + p]);
      for (int64_t c = 0; c < VECTORS; ++c) acc[g][c] = _mm256_fmadd_ps(weight, value[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    alignas(32) float sums[VECTORS * LANES];
    for (int64_t c = 0; c < VECTORS; ++c) _mm256_store_ps(sums + c * LANES, acc[g][c]);
    for (int64_t d = 0; d < VECTORS * LANES; ++d) out[g * out_stride + d0 + d] = static_cast<T>(sums[d] / totals[g]);
  }
}

// weighted_columns over all D columns (a multiple of LANES) and G query heads: 32 columns of 3 heads at a time (12
// of AVX2's 16 registers hold the sums), the last columns a vector at a time
template <typename C, typename T>
inline void weighted_sums(const float* w, int64_t w_stride, const C* const* values, int64_t n, int64_t G, int64_t D,
                          const float* totals, T* out, int64_t out_stride) {
  constexpr int64_t VECTORS = 4, HEADS = 3;
  for (int64_t g = 0; g < G; g += HEADS) {
    const int64_t heads = std::min(HEADS, G - g);
    const float* weights = w + g * w_stride;
    T* to = out + g * out_stride;
    int64_t d0 = 0;
    for (; d0 + VECTORS * LANES <= D; d0 += VECTORS * LANES) {
      weighted_columns<VECTORS, HEADS>(weights, w_stride, values, n, d0, heads, totals + g, to, out_stride);
    }
    for (; d0 < D; d0 += LANES) {
      weighted_columns<1, HEADS>(weights, w_stride, values, n, d0, heads, totals + g, to, out_stride);
    }
  }
}

// `out` [D] = x [D] rotated by the position whose tables are cos, sin [D/2] (the halves rotated together, as
// apply_rope does), rounded to T
template <typename T>
inline void rotate(const T* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[i + half]);
    out[i] = round_to<T>(x1 * cos[i] - x2 * sin[i]);
    out[i + half] = round_to<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

// Where a row's keys and values are: static cache [2, R, H_kv, S, D], or paged [2, N, block_size, H_kv, D] with the
// block table [R, W]; read through the tensor's strides (a paged cache's heads may come first in memory: a view
// [2, N, block_size, H_kv, D] of [2, N, H_kv, block_size, D]), each head's D values contiguous.
template <typename T>
struct Cache {
  T* base;
  int64_t half_stride;  // from the keys to the values
  const int64_t* table;  // null: static
  int64_t table_stride, block_size;
  int64_t row_stride, head_stride, pos_stride;  // static: per row; paged: per block (row_stride), per offset

  T* at(int64_t row, int64_t head, int64_t pos) const {
    if (table == nullptr) return base + row * row_stride + head * head_stride + pos * pos_stride;
    const int64_t block = table[row * table_stride + pos / block_size];
    return base + block * row_stride + (pos % block_size) * pos_stride + head * head_stride;
  }

  // out[p] = at(row, head, lo + p) for p < n, one table lookup per block (a division each)
  void positions(int64_t row, int64_t head, int64_t lo, int64_t n, const T** out) const {
    for (int64_t p = 0; p < n;) {
      const int64_t run = table == nullptr ? n - p : std::min(n - p, block_size - (lo + p) % block_size);
      T* first = at(row, head, lo + p);
      for (int64_t i = 0; i < run; ++i) out[p + i] = first + i * pos_stride;
      p += run;
    }
  }

  // The cache kv, static, or paged with the block table `table` (row stride table_stride) where it is not null
  static Cache of(const at::Tensor& kv, const int64_t* table, int64_t table_stride) {
    const bool paged = table != nullptr;
    return {kv.data_ptr<T>(), kv.stride(0), table, table_stride, paged ? kv.size(2) : 0, kv.stride(1),
            paged ? kv.stride(3) : kv.stride(2), paged ? kv.stride(2) : kv.stride(3)};
  }
};

// f(C{}) for a float32 model's cache of `dtype`: float16, bfloat16, float8_e4m3fn, else float32
template <typename F>
inline void with_cache_type(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(c10::Half{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else if (dtype == at::kFloat8_e4m3fn) {
    f(c10::Float8_e4m3fn{});
  } else {
    f(float{});
  }
}

// the cache lines of one position's key and value (D values of C each) into the first-level cache
template <typename C>
inline void prefetch_head(const C* key, const C* value, int64_t D) {
  constexpr int64_t LINE = 64;
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(C)); b += LINE) {
    _mm_prefetch(reinterpret_cast<const char*>(key) + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(value) + b, _MM_HINT_T0);
  }
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// s [whole]: n scores times `scale` (then soft-capped), the rest -inf (e^-inf: 0); returns their largest. A vector
// at a time: one maximum at a time waits on the last one's latency
inline float scale_scores(float* s, int64_t n, int64_t whole, float scale, std::optional<double> softcap) {
  float factor = scale;
  if (softcap) {
    const float cap = static_cast<float>(*softcap);
    for (int64_t p = 0; p < n; ++p) s[p] = std::tanh(s[p] * scale / cap) * cap;
    factor = 1.f;
  }
  std::fill(s + n, s + whole, -INFINITY);
  const __m256 by = _mm256_set1_ps(factor);
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t p = 0; p < whole; p += LANES) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + p), by);
    _mm256_storeu_ps(s + p, x);
    top = _mm256_max_ps(top, x);
  }
  return max_lanes(top);
}

// One row's kv head `h`, its key and value at `pos` stored already: its G query heads `q` [G, D] (rotated) over
// positions lo .. pos, writing `out` [G, D]; the scores and sums in buffers of the calling thread kept from call to
// call (a decode step makes one call per row, kv head and layer); the cache's dtype C, the output's T
template <typename C, typename T>
void attend_head(const Cache<C>& cache, int64_t row, int64_t h, int64_t lo, int64_t pos, const float* q, int64_t G,
                 int64_t D, float scale, std::optional<double> softcap, T* out, int64_t out_head_stride) {
  const int64_t n = pos - lo + 1;
  const int64_t whole = (n + LANES - 1) / LANES * LANES;
  const int64_t padded = whole + KEYS;  // whole vectors, and room for the last KEYS scores
  thread_local std::vector<float> scores;
  thread_local std::vector<const C*> keys, values;
  scores.resize(G * padded);  // [G, n], each head's padded to whole vectors
  keys.resize(n);
  values.resize(n);
  cache.positions(row, h, lo, n, keys.data());
  for (int64_t p = 0; p < n; ++p) values[p] = keys[p] + cache.half_stride;
  const bool paged = cache.table != nullptr;  // a static cache's one run per head the hardware prefetches itself
  for (int64_t p0 = 0; p0 < n; p0 += KEYS) {
    const int64_t m = std::min(KEYS, n - p0);
    const int64_t ahead = paged ? std::min(p0 + AHEAD + KEYS, n) : 0;
    for (int64_t j = p0 + AHEAD; j < ahead; ++j) prefetch_head(keys[j], values[j], D);
    const C* some[KEYS];
    for (int64_t j = 0; j < KEYS; ++j) some[j] = keys[p0 + std::min(j, m - 1)];
    dots_of_heads(q, some, G, D, scores.data() + p0, padded);
  }
  thread_local std::vector<float> totals;
  totals.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * padded;
    const __m256 top = _mm256_set1_ps(scale_scores(s, n, whole, scale, softcap));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t p = 0; p < whole; p += LANES) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), top));
      _mm256_storeu_ps(s + p, e);
      sum = _mm256_add_ps(sum, e);
    }
    totals[g] = sum_lanes(sum);
  }
  weighted_sums(scores.data(), padded, values.data(), n, G, D, totals.data(), out, out_head_stride);
}

// One row's kv head `h` of a step at `pos` (attending from `lo`): its G query heads `q` [G, D] (head stride
// q_stride) and its key `k` and value `v` [D] rotated by the position's tables cos, sin [D/2], the key and value
// written into the cache, then the attention, into `out` [G, D] (head stride out_stride); the rotated query and key
// in buffers of the calling thread; the cache's dtype C, the query's T
template <typename C, typename T>
void attend_kv_head(const Cache<C>& cache, int64_t row, int64_t h, int64_t lo, int64_t pos, const T* q,
                    int64_t q_stride, const T* k, const T* v, const float* c, const float* s, int64_t G, int64_t D,
                    float scale, std::optional<double> softcap, T* out, int64_t out_stride) {
  thread_local std::vector<float> rotated, key;
  rotated.resize(G * D);
  key.resize(D);
  for (int64_t g = 0; g < G; ++g) rotate(q + g * q_stride, c, s, D, rotated.data() + g * D);
  rotate(k, c, s, D, key.data());
  C* key_slot = cache.at(row, h, pos);
  for (int64_t d = 0; d < D; ++d) {
    key_slot[d] = to_cache<C>(key[d]);
    key_slot[cache.half_stride + d] = to_cache<C>(widen(v[d]));
  }
  attend_head(cache, row, h, lo, pos, rotated.data(), G, D, scale, softcap, out, out_stride);
}

template <typename T, typename C>
void decode_attention_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor& kv, const at::Tensor& input_pos, int64_t first_row,
                            double scale, std::optional<double> softcap, std::optional<int64_t> window,
                            const std::optional<at::Tensor>& table, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3), H_kv = k.size(2), G = H / H_kv;
  const Cache<C> cache = table.has_value() ? Cache<C>::of(kv, table->data_ptr<int64_t>(), table->stride(0))
                                           : Cache<C>::of(kv, nullptr, 0);
  const int64_t* positions = input_pos.data_ptr<int64_t>();
  const float* cos_rows = cos.data_ptr<float>();
  const float* sin_rows = sin.data_ptr<float>();
  const bool shared_pos = input_pos.numel() == 1, shared_rope = cos.numel() == D / 2;
  const T *qs = q.data_ptr<T>(), *ks = k.data_ptr<T>(), *vs = v.data_ptr<T>();
  T* outs = out.data_ptr<T>();
  gpt_fast_cpu::share_tasks(B * H_kv, B * H_kv, [&](int64_t task) {
    const int64_t b = task / H_kv, h = task % H_kv;
    const int64_t pos = positions[shared_pos ? 0 : b];
    const int64_t lo = window ? std::max<int64_t>(0, pos - *window + 1) : 0;
    const int64_t rope = (shared_rope ? 0 : b) * (D / 2);
    attend_kv_head(cache, first_row + b, h, lo, pos, qs + b * q.stride(0) + h * G * q.stride(2), q.stride(2),
                   ks + b * k.stride(0) + h * k.stride(2), vs + b * v.stride(0) + h * v.stride(2), cos_rows + rope,
                   sin_rows + rope, G, D, static_cast<float>(scale), softcap,
                   outs + b * out.stride(0) + h * G * out.stride(2), out.stride(2));
  });
}

// q [B, 1, H, D], k and v [B, 1, H_kv, D] (the last dimension contiguous), cos and sin [1, D/2] or [B, 1, D/2]
// float32, input_pos [1] or [B, 1] int64; kv (q's dtype, or float16 or bfloat16 for a float32 q) and table (int64) as
// Cache says. Returns [B, 1, H, D] in q's dtype.
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& kv, const at::Tensor& input_pos, int64_t first_row,
                                double scale, std::optional<double> softcap, std::optional<int64_t> window,
                                const std::optional<at::Tensor>& table) {
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1 && k.dim() == 4 && v.dim() == 4, "decode_attention_cpu: one position");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention_cpu: heads contiguous");
  TORCH_CHECK(q.size(3) % LANES == 0 && q.size(2) % k.size(2) == 0, "decode_attention_cpu: head shapes");
  const at::ScalarType cached = kv.scalar_type();
  const bool narrower = q.scalar_type() == at::kFloat && reads_cache_of(cached);
  TORCH_CHECK(kv.dim() == 5 && kv.stride(4) == 1 && (cached == q.scalar_type() || narrower), "decode_attention_cpu: kv");
  TORCH_CHECK(input_pos.scalar_type() == at::kLong, "decode_attention_cpu: int64 positions");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "decode_attention_cpu: float32 rope");
  TORCH_CHECK(cos.numel() == sin.numel() && cos.numel() % (q.size(3) / 2) == 0, "decode_attention_cpu: rope shapes");
  // the step's own small tensors, contiguous already in a compiled step: no copy there
  const at::Tensor c = cos.is_contiguous() ? cos : cos.contiguous();
  const at::Tensor s = sin.is_contiguous() ? sin : sin.contiguous();
  const at::Tensor pos = input_pos.is_contiguous() ? input_pos : input_pos.contiguous();
  std::optional<at::Tensor> blocks;
  if (table.has_value()) {
    TORCH_CHECK(table->scalar_type() == at::kLong, "decode_attention_cpu: an int64 block table");
    blocks = table->is_contiguous() ? *table : table->contiguous();
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const auto typed = [&](auto query, auto cache) {
    using T = decltype(query);
    using C = decltype(cache);
    decode_attention_typed<T, C>(q, k, v, c, s, kv, pos, first_row, scale, softcap, window, blocks, out);
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      with_cache_type(cached, [&](auto cache) { typed(float{}, cache); });
      break;
    case at::kBFloat16:
      typed(c10::BFloat16{}, c10::BFloat16{});
      break;
    case at::kHalf:
      typed(c10::Half{}, c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "decode_attention_cpu: float32, bfloat16 or float16");
  }
  return out;
}

// attend_rows in a cache of the dtype C
template <typename C>
void attend_rows_in(const Cache<C>& cache, const float* qkv, int64_t R, int64_t H, int64_t H_kv, int64_t D,
                    const float* cos, const float* sin, int64_t first_row, const int64_t* positions, bool shared,
                    float scale, std::optional<double> softcap, float* out) {
  const int64_t G = H / H_kv, width = (H + 2 * H_kv) * D;
  int64_t seen = 0;  // positions the rows attend to
  for (int64_t r = 0; r < R; ++r) seen += positions[shared ? 0 : r] + 1;
  const int64_t bytes = 2 * seen * H_kv * D * static_cast<int64_t>(sizeof(C));
  gpt_fast_cpu::share_tasks(R * H_kv, std::max<int64_t>(1, bytes / THREAD_BYTES), [&](int64_t task) {
    const int64_t r = task / H_kv, h = task % H_kv, pos = positions[shared ? 0 : r];
    const float* row = qkv + r * width;
    const float *keys = row + H * D, *values = keys + H_kv * D;
    attend_kv_head(cache, first_row + r, h, 0, pos, row + h * G * D, D, keys + h * D, values + h * D,
                   cos + pos * (D / 2), sin + pos * (D / 2), G, D, scale, softcap, out + r * H * D + h * G * D, D);
  });
}

}  // namespace

namespace gpt_fast_cpu {

// The attention of decode_layers_cpu (cpu_layers.cpp): one token in each of R rows, row r at positions[r] (or all at
// positions[0], `shared`) of the cache row first_row + r of a cache kv (float32, float16 or bfloat16: keys and
// values rounded to it as they are written), static [2, rows, H_kv, S, D] or paged
// [2, N, block_size, H_kv, D] with the block table `table` [rows, W] (row stride table_stride; null: static). Row r's
// query, key and value are the H + 2 H_kv heads of qkv [R, (H + 2 H_kv) D], rotated by the rows of the rotary tables
// cos, sin [positions, D / 2] at its position; its output [H D] goes to out [R, H D]. A second thread takes (row, kv
// head) tasks only where each thread reads THREAD_BYTES of keys and values: waking one costs more than a short
// cache's heads take (and, beside a busy process, waits for a core)
void attend_rows(const float* qkv, int64_t R, int64_t H, int64_t H_kv, int64_t D, const float* cos, const float* sin,
                 const at::Tensor& kv, const int64_t* table, int64_t table_stride, int64_t first_row,
                 const int64_t* positions, bool shared, float scale, std::optional<double> softcap, float* out) {
  with_cache_type(kv.scalar_type(), [&](auto element) {
    attend_rows_in(Cache<decltype(element)>::of(kv, table, table_stride), qkv, R, H, H_kv, D, cos, sin, first_row,
                   positions, shared, scale, softcap, out);
  });
}

}  // namespace gpt_fast_cpu

TORCH_LIBRARY_FRAGMENT(gpt_fast, m) {
  m.def(
      "decode_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor input_pos, "
      "int first_row, float scale, float? softcap, int? window, Tensor? table=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) {
  m.impl("decode_attention_cpu", &decode_attention_cpu);
}
