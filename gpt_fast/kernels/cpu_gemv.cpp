// The products of float32 activations with int8 or int4 weights on an x86 CPU with AVX2 and FMA: a decode step's few
// rows as the operators gpt_fast::int8_gemv_cpu (a scale per row), gpt_fast::int8_group_gemv_cpu (a scale per group
// of columns) and gpt_fast::int4_gemv_cpu; a prompt's many as gpt_fast::int8_matmul_cpu and int4_matmul_cpu (see "a
// prompt's many rows" below); and gpt_fast::int4_dequantize_cpu for longer prompts (built by
// gpt_fast/kernels/cpu_gemv.py).
//
// Each weight is widened to float32 and multiplied by the activation in float32, as the dequantized reference does:
// the results differ from it by the order of the float32 sums only. The operators int8_q8_gemv_cpu and
// int4_q8_gemv_cpu round the activations to int8 instead, as llama.cpp does, on weights
// packed for them at load, for any number of rows (see "activations rounded to int8" below).
// Output rows are shared among the calling thread and our helper threads (cpu_threads.cpp) in tasks of whole GRAINs
// of rows that each thread takes in turn (over_tasks); each reads its rows of weights once for all the activation
// rows, and widens each weight once for every ROWS of them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/FunctionRef.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace gpt_fast_cpu {  // cpu_threads.cpp's, which says what it does
void share_tasks(int64_t tasks, int64_t wanted, c10::function_ref<void(int64_t)> task);
}  // namespace gpt_fast_cpu

namespace {

constexpr int64_t INT8_STEP = 16;   // int8 columns per step: two vectors of 8
constexpr int64_t INT4_BLOCK = 64;  // int4 columns per step: 32 bytes read as 8 words of 8 nibbles
constexpr int64_t MIN_GROUP = 32;   // the smallest int4 group: a block holds one or two groups
constexpr float MID = 8.f;          // the int4 level whose value is the group's zero
constexpr int64_t GRAIN = 16;       // output rows that a kernel computes together (over_tasks)
constexpr int64_t TASKS_PER_THREAD = 4;  // tasks of a product per thread taking part (over_tasks)
constexpr int ROWS = 4;             // activation rows that share each widened weight
// Weight bytes (times passes) per thread, at least: the default model's eager decode with two threads and waits
// that sleep made 34.4 tok/s when every product took both, 40.2 with this (docs/bench/HISTORY.md, 2026-11-30b); with
// our own helpers, 64 KB made it faster idle and slower beside a busy process (BENCHMARKS.md, 2026-11-30h)
constexpr int64_t THREAD_WORK = 1 << 20;

// f(n0, n1) for the output rows n0 .. n1 - 1 of N in GRAINs of rows (n1 - n0 <= GRAIN), TASKS_PER_THREAD tasks of
// whole GRAINs for each thread taking part, which the calling thread and our helper threads take one after another
// until none is left (gpt_fast_cpu::share_tasks): a thread that another process keeps off its core takes fewer of
// them, where an even split would make the whole product wait for its share. A task is claimed by an atomic operation
// on a cache line that both cores write: tasks of one GRAIN each cost as much to claim as to compute in a 4-row
// product, and a second thread gave nothing (a 4-row `cpp-q8` w13 product of the default model, 118 against 109 µs;
// 78 µs with these tasks: docs/cpu.md, "Threads"). `work` is the weight bytes times the passes over them (one per ROWS
// activation rows); a product takes one thread per THREAD_WORK of it at most, since waking a thread costs more than a
// small product saves.
template <typename F>
inline void over_tasks(int64_t N, int64_t work, F&& f) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, work / THREAD_WORK), at::get_num_threads());
  const int64_t grains = (N + GRAIN - 1) / GRAIN;
  const int64_t per = std::max<int64_t>(1, grains / (threads * TASKS_PER_THREAD));  // grains per task
  gpt_fast_cpu::share_tasks((grains + per - 1) / per, threads, [&](int64_t t) {
    for (int64_t g = t * per; g < std::min(grains, (t + 1) * per); ++g) f(g * GRAIN, std::min(N, (g + 1) * GRAIN));
  });
}

// f(n) for the output rows n of N, shared among threads as over_tasks shares them
template <typename F>
inline void over_rows(int64_t N, int64_t work, F&& f) {
  over_tasks(N, work, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) f(n);
  });
}

// the passes over a product's weights for M activation rows (by_rows)
inline int64_t passes(int64_t M) {
  return (M + ROWS - 1) / ROWS;
}

// f(std::integral_constant<int, R>, m) for the activation rows m .. m + R - 1 of M, R = ROWS but at the end
template <typename F>
inline void by_rows(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + ROWS <= M; m += ROWS) f(std::integral_constant<int, ROWS>{}, m);
  switch (M - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

constexpr int64_t PREFETCH = 4096;  // bytes of weights ahead of those read that are asked for (prefetch)
constexpr int64_t LINE = 64;        // bytes of a cache line

// Asks for the cache line PREFETCH bytes past p: a row's weights, read a block at a time, come from memory faster
// with this (the 28 MB output projection of the SmolLM2 shape, one thread: cpp-q8 1.0-1.1 ms against 1.2-1.4, cpp
// 1.82-1.92 against 2.01-2.42), where the hardware's own prefetching leaves the memory idle between blocks. The
// kernels ask once per cache line; the int8 rows kernel does without: alternating with and without, a step's 120
// products were no faster (docs/bench/2026-11-30g_cpu_layers.txt)
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
}

// the 8 signed bytes at p as floats
inline __m256 int8_floats(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// the low nibble of each of the 8 words v as floats
inline __m256 low_nibbles(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
}

// levels[i]: nibble i of each of the 8 words v, as floats
inline void nibble_floats(__m256i v, __m256* levels) {
  levels[0] = low_nibbles(v);
  levels[1] = low_nibbles(_mm256_srli_epi32(v, 4));
  levels[2] = low_nibbles(_mm256_srli_epi32(v, 8));
  levels[3] = low_nibbles(_mm256_srli_epi32(v, 12));
  levels[4] = low_nibbles(_mm256_srli_epi32(v, 16));
  levels[5] = low_nibbles(_mm256_srli_epi32(v, 20));
  levels[6] = low_nibbles(_mm256_srli_epi32(v, 24));
  levels[7] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// acc[r * S + v] += x[r] . w over the 8 V columns from k, one vector of 8 columns to each of V accumulators of a
// row (S accumulators per row), so that a row's sums are V chains of fused multiply-adds that run side by side
template <int R, int V, int S = V>
inline void int8_step(const float* x, int64_t K, const int8_t* w, int64_t k, __m256* acc) {
  __m256 wv[V];
  for (int v = 0; v < V; ++v) wv[v] = int8_floats(w + k + 8 * v);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r * S + v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * v), wv[v], acc[r * S + v]);
}
#endif

// out[r * N] = x[r] . w * scale for the R rows x [R, K] (K a multiple of INT8_STEP) and the int8 weight row w [K].
// A fused multiply-add waits for the one before it on its accumulator (4 cycles on current x86 cores): one or two
// rows keep 4 accumulators each (32 columns a step), more rows 2.
template <int R>
inline void int8_rows(const float* x, int64_t K, const int8_t* w, float scale, float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int V = R <= 2 ? 4 : 2;
  __m256 acc[R * V];
  for (int i = 0; i < R * V; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * V <= K; k += 8 * V) int8_step<R, V>(x, K, w, k, acc);
  if (k < K) int8_step<R, 2, V>(x, K, w, k, acc);  // V = 4: the last 16 columns, on a row's first 2 accumulators
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r * V];
    for (int v = 1; v < V; ++v) sum = _mm256_add_ps(sum, acc[r * V + v]);
    out[r * N] = sum_lanes(sum) * scale;
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * static_cast<float>(w[k]);
    out[r * N] = acc * scale;
  }
#endif
}

// out[r * N] for the R rows x [R, K] and the int8 weight row w [K] in groups of `group` columns (a multiple of
// INT8_STEP dividing K) with scales [K / group]: the sum over groups g of scale[g] * (w . x over the group)
template <int R>
inline void int8_group_rows(const float* x, int64_t K, const int8_t* w, const float* scales, int64_t group,
                            float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t start = 0, g = 0; start < K; start += group, ++g) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = start; k < start + group; k += INT8_STEP) {
      if (k % LINE == 0) prefetch(w + k);
      const __m256 w0 = int8_floats(w + k), w1 = int8_floats(w + k + 8);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, hi[r]);
      }
    }
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(_mm256_add_ps(lo[r], hi[r]), s, total[r]);
  }
  for (int r = 0; r < R; ++r) out[r * N] = sum_lanes(total[r]);
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t start = 0, g = 0; start < K; start += group, ++g) {
      float part = 0.f;
      for (int64_t k = start; k < start + group; ++k) part += x[r * K + k] * static_cast<float>(w[k]);
      acc += part * scales[g];
    }
    out[r * N] = acc;
  }
#endif
}

// x [K] with each block of 64 columns transposed, out[64 b + 8 i + j] = x[64 b + 8 j + i]: nibble i of word j of
// a block's bytes is its column 8 j + i (column 2 t in the low nibble of byte t), so that nibble i of the block's
// 8 words meets 8 consecutive floats
void transpose_blocks(const float* x, float* out, int64_t K) {
  for (int64_t b = 0; b < K; b += INT4_BLOCK)
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 8; ++j) out[b + 8 * i + j] = x[b + 8 * j + i];
}

#if defined(__AVX2__) && defined(__FMA__)
// the scale of each lane of block b (columns 64 b + 8 j ... + 7): groups of 32 change half way
inline __m256 block_scales(const float* scales, int64_t b, int64_t group) {
  if (group == MIN_GROUP) return _mm256_set_m128(_mm_set1_ps(scales[2 * b + 1]), _mm_set1_ps(scales[2 * b]));
  return _mm256_set1_ps(scales[b * INT4_BLOCK / group]);
}
#endif

// out[r * N] for the R rows of xt [R, K] (x transposed by transpose_blocks, K a multiple of INT4_BLOCK) and one
// row of int4 weights w [K / 2]: the sum over groups g of scale[g] * (levels . x over the group) plus
// (zero[g] - 8 scale[g]) * xsums[r, g], the sum of x over the group
template <int R>
inline void int4_rows(const float* xt, const float* xsums, int64_t K, int64_t G, const uint8_t* w,
                      const float* scales, const float* zeros, int64_t group, float* out, int64_t N) {
  float acc[R] = {};
  int64_t g0 = 0;  // the groups before g0 are summed in vectors of 8 below
#if defined(__AVX2__) && defined(__FMA__)
  __m256 shift[R];
  for (int r = 0; r < R; ++r) shift[r] = _mm256_setzero_ps();
  for (; g0 + 8 <= G; g0 += 8) {
    const __m256 c = _mm256_fnmadd_ps(_mm256_set1_ps(MID), _mm256_loadu_ps(scales + g0), _mm256_loadu_ps(zeros + g0));
    for (int r = 0; r < R; ++r) shift[r] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xsums + r * G + g0), shift[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = sum_lanes(shift[r]);
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t g = g0; g < G; ++g) acc[r] += (zeros[g] - MID * scales[g]) * xsums[r * G + g];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / INT4_BLOCK; ++b) {
    if (b % 2 == 0) prefetch(w + b * INT4_BLOCK / 2);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * INT4_BLOCK / 2));
    __m256 levels[8];
    nibble_floats(v, levels);
    const __m256 s = block_scales(scales, b, group);
    for (int r = 0; r < R; ++r) {
      const float* xb = xt + r * K + b * INT4_BLOCK;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(xb), levels[0]);
      __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), levels[1]);
      for (int i = 2; i < 8; i += 2) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * i), levels[i], a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * i + 8), levels[i + 1], a1);
      }
      total[r] = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), s, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = acc[r] + sum_lanes(total[r]);
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t b = 0; b < K; b += INT4_BLOCK)
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t i = 0; i < 8; ++i) {
          int64_t col = b + 8 * j + i;
          acc[r] += scales[col / group] * xt[r * K + b + 8 * i + j] * ((w[col / 2] >> (4 * (col % 2))) & 0xF);
        }
    out[r * N] = acc[r];
  }
#endif
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, int64_t packing) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) * packing == x.size(1), "weight must be [N, K / ", packing, "]");
}

// x [M, K] float32 times the int8 weight [N, K] with scales [N] float32: [M, N]; K a multiple of 16
at::Tensor int8_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  check_rows(x, weight, 1);
  TORCH_CHECK(weight.scalar_type() == at::kChar && x.size(1) % INT8_STEP == 0, "int8 weight with K % 16 == 0");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "scales must be [N] float32");
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(N, N * K * passes(M), [&](int64_t n) {
    by_rows(M, [&](auto rows, int64_t m) {
      int8_rows<decltype(rows)::value>(xp + m * K, K, wp + n * K, sp[n], op + m * N + n, N);
    });
  });
  return out;
}

// x [M, K] float32 times the int8 weight [N, K] with scales [N, K / group] float32, one per group of `group`
// columns: [M, N]; group a multiple of 16 dividing K
at::Tensor int8_group_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                               int64_t group) {
  check_rows(x, weight, 1);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kChar && group > 0 && group % INT8_STEP == 0 && K % group == 0,
              "int8 weight with group_size % 16 == 0 and K % group_size == 0");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == K / group,
              "scales must be [N, K / group_size] float32");
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous();
  auto out = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = K / group;
  over_rows(N, N * K * passes(M), [&](int64_t n) {
    by_rows(M, [&](auto rows, int64_t m) {
      int8_group_rows<decltype(rows)::value>(xp + m * K, K, wp + n * K, sp + n * G, group, op + m * N + n, N);
    });
  });
  return out;
}

// The checks of an int4 product's operands (int4_gemv_cpu, int4_q8_gemv_cpu); its groups
int64_t check_int4(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros,
                   int64_t group) {
  check_rows(x, weight, 2);
  const int64_t N = weight.size(0), K = x.size(1), G = (K + group - 1) / group;
  TORCH_CHECK(weight.scalar_type() == at::kByte && K % INT4_BLOCK == 0 && group >= MIN_GROUP &&
                  (group & (group - 1)) == 0,
              "uint8 weight with K % 64 == 0 and group_size a power of two from 32");
  for (const auto& t : {scales, zeros})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == N && t.size(1) == G,
                "scales and zeros must be [N, groups] float32");
  return G;
}

// the sums of x [M, K] over each group of columns: [M, G]
at::Tensor group_sums(const float* x, int64_t M, int64_t K, int64_t G, int64_t group) {
  auto sums = at::zeros({M, G}, at::kFloat);
  float* s = sums.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) s[m * G + k / group] += x[m * K + k];
  return sums;
}

#if defined(__AVX2__) && defined(__FMA__)
#define AVX512_TARGET __attribute__((target("avx2,fma,avx512f")))

// whether the kernels take their AVX-512 code: the CPU has it, unless tests turned it off (set_avx512)
std::atomic<bool> avx512{__builtin_cpu_supports("avx512f")};

bool avx512_usable() {
  return avx512.load(std::memory_order_relaxed);
}
#endif

// Lets the kernels take their AVX-512 code (where the CPU has it) or not, as on a CPU without it; the setting in force
bool set_avx512(bool enabled) {
#if defined(__AVX2__) && defined(__FMA__)
  avx512.store(enabled && __builtin_cpu_supports("avx512f"));
  return avx512_usable();
#else
  return false;
#endif
}

constexpr int64_t PAIRED = 32;  // columns whose even ones int4_level_pairs writes first, then the odd ones

// x [M, K] (K a multiple of PAIRED) with the columns of each PAIRED in the order that int4_level_pairs writes a row's
// weights, the 16 even columns, then the 16 odd ones, in a buffer of the calling thread kept from call to call
const float* pair_columns(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<float> paired;
  paired.resize(M * K);
  for (int64_t c = 0; c < M * K; c += PAIRED)
    for (int64_t i = 0; i < PAIRED / 2; ++i) {
      paired[c + i] = x[c + 2 * i];
      paired[c + PAIRED / 2 + i] = x[c + 2 * i + 1];
    }
  return paired.data();
}

#if defined(__AVX2__) && defined(__FMA__)
// the 16 numbers (level - 8) * scale + zero of a group, as the reference rounds them (a product, then a sum)
AVX512_TARGET inline __m512 group_numbers(float scale, float zero) {
  const __m512 levels = _mm512_sub_ps(
      _mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), _mm512_set1_ps(MID));
  return _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale)), _mm512_set1_ps(zero));
}

// the numbers of the 32 int4 weights in the 16 bytes at w (their group's `table`, group_numbers): the low nibbles'
// in `low`, the high nibbles' in `high`, looked up by vpermps, which reads the low 4 bits of each index
AVX512_TARGET inline void lookup_nibbles(const uint8_t* w, __m512 table, __m512& low, __m512& high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  low = _mm512_permutexvar_ps(bytes, table);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// int4_rows on a CPU with AVX-512, for the R rows xp [R, K] in pair_columns' order: each weight looked up among its
// group's 16 numbers by its nibble (lookup_nibbles), 16 weights an instruction, and multiplied by its activation, where the 8-wide code widens, shifts and masks each nibble. The
// products are the dequantized reference's; a row's sums run on two accumulators
template <int R>
AVX512_TARGET void int4_lookup_rows(const float* xp, int64_t K, const uint8_t* w, const float* scales,
                                    const float* zeros, int64_t group, float* out, int64_t N) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g * group < K; ++g) {
    const __m512 table = group_numbers(scales[g], zeros[g]);
    for (int64_t c = g * group; c < std::min(K, (g + 1) * group); c += PAIRED) {
      if (c / 2 % LINE == 0) prefetch(w + c / 2);
      __m512 low, high;
      lookup_nibbles(w + c / 2, table, low, high);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r * K + c), low, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r * K + c + PAIRED / 2), high, odd[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}
#endif

// x [M, K] float32 times the int4 weight [N, K / 2] (column 2 t in the low nibble of byte t) with scales and zeros
// [N, groups] float32 (a level q stands for (q - 8) * scale + zero): [M, N]; K a multiple of 64, group_size of 32
// or more (a power of two). With AVX-512, int4_lookup_rows (docs/bench/2026-11-30f_cpu_tile_kernels.txt: a step's
// int4 products of one row 8.2-10.9 ms against 10.2-10.3 with the 8-wide code)
at::Tensor int4_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                         const at::Tensor& zeros, int64_t group) {
  const int64_t G = check_int4(x, weight, scales, zeros, group);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous(), zc = zeros.contiguous();
  const float* xd = xc.data_ptr<float>();
  auto out = at::empty({M, N}, x.options());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float *sp = sc.data_ptr<float>(), *zp = zc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t work = N * K / 2 * passes(M);
#if defined(__AVX2__) && defined(__FMA__)
  if (avx512_usable()) {
    const float* paired = pair_columns(xd, M, K);
    over_rows(N, work, [&](int64_t n) {
      by_rows(M, [&](auto rows, int64_t m) {
        int4_lookup_rows<decltype(rows)::value>(paired + m * K, K, wp + n * K / 2, sp + n * G, zp + n * G, group,
                                                op + m * N + n, N);
      });
    });
    return out;
  }
#endif
  auto xt = at::empty({M, K}, x.options());
  float* xtp = xt.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) transpose_blocks(xd + m * K, xtp + m * K, K);
  auto xsums = group_sums(xd, M, K, G, group);
  const float* xs = xsums.data_ptr<float>();
  over_rows(N, work, [&](int64_t n) {
    by_rows(M, [&](auto rows, int64_t m) {
      int4_rows<decltype(rows)::value>(xtp + m * K, xs + m * G, K, G, wp + n * K / 2, sp + n * G, zp + n * G, group,
                                       op + m * N + n, N);
    });
  });
  return out;
}

// out[c] = (level c - 8) * scale + zero for the columns c from `first` to `last` (both even) of a row of int4
// weights w, as int4_dequantize_cpu says: a product rounded, then a sum
inline void dequantize_group(const uint8_t* w, int64_t first, int64_t last, float scale, float zero, float* out) {
  int64_t c = first;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero), mid = _mm256_set1_ps(MID);
  for (; c + 16 <= last; c += 16) {  // 8 bytes
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 2)));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    // the pairs (low, high) of bytes 0, 1, 4, 5 in a, of bytes 2, 3, 6, 7 in b
    const __m256 a = _mm256_unpacklo_ps(low, high), b = _mm256_unpackhi_ps(low, high);
    for (int half = 0; half < 2; ++half) {
      const __m256 levels = half ? _mm256_permute2f128_ps(a, b, 0x31) : _mm256_permute2f128_ps(a, b, 0x20);
      _mm256_storeu_ps(out + c + 8 * half, _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(levels, mid), s), z));
    }
  }
#endif
  for (; c < last; c += 2) {
    out[c] = (static_cast<float>(w[c / 2] & 0xF) - MID) * scale + zero;
    out[c + 1] = (static_cast<float>(w[c / 2] >> 4) - MID) * scale + zero;
  }
}

// The int4 weight [N, K / 2] with scales and zeros [N, groups] float32 as the float32 matrix [N, K], each level q
// as (q - 8) * scale + zero, rounded after the product and after the sum as PyTorch's dequantization rounds it (the
// library is built without contracting them into one fused multiply-add): the weights of a prefill's many rows,
// which torch's own matrix product then multiplies faster than int4_gemv_cpu widens them a few rows at a time
at::Tensor int4_dequantize_cpu(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& zeros,
                               int64_t group) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "weight must be [N, K / 2] uint8");
  const int64_t N = weight.size(0), K = weight.size(1) * 2, G = (K + group - 1) / group;
  TORCH_CHECK(group > 0 && group % 2 == 0, "group_size must be even");
  for (const auto& t : {scales, zeros})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == N && t.size(1) == G,
                "scales and zeros must be [N, groups] float32");
  auto wc = weight.contiguous(), sc = scales.contiguous(), zc = zeros.contiguous();
  auto out = at::empty({N, K}, scales.options());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float *sp = sc.data_ptr<float>(), *zp = zc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(N, N * K, [&](int64_t n) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t last = std::min(K, (g + 1) * group);  // a shorter last group ends with the row
      dequantize_group(wp + n * K / 2, g * group, last, sp[n * G + g], zp[n * G + g], op + n * K);
    }
  });
  return out;
}

// ---- a prompt's many rows: weights dequantized a task at a time (int8_matmul_cpu, int4_matmul_cpu) ----
//
// A prompt's product of M rows is bound by its multiply-adds, not by reading the weights: each task dequantizes its
// GRAIN weight rows once into a float buffer of the thread and multiplies it by all the activation rows in blocks of
// TILE_ROWS x TILE_COLUMNS outputs, each output a chain of 8-wide fused multiply-adds along K: 12 chains run side by
// side, and each vector loaded serves 3 or 4 of them. Where torch's matrix product of the dequantized weights writes
// and reads back a float copy of the whole matrix, this reads the weights' own bytes once. The dequantized numbers
// are the reference's (int4_dequantize_cpu's; an int8 weight times its group's scale, or widened, its row's scale
// multiplying the sum): the results differ from it by the order of the float32 sums only. On a CPU with AVX-512 the
// dequantization itself takes 16 weights an instruction (int4: a lookup of the group's 16 numbers).

constexpr int TILE_ROWS = 3;        // activation rows of a block
constexpr int TILE_COLUMNS = 4;     // weight rows (outputs) of a block
constexpr int64_t CHUNK_ROWS = 48;  // activation rows that meet a task's weights before the next ones
constexpr int WIDE_ROWS = 4;        // activation rows of a block in the AVX-512 code

// out[r * N + c] = x[r] . w[c] for the R rows x [R, K] and the C float weight rows w [C, K] (K a multiple of 8)
template <int R, int C>
inline void float_block(const float* x, const float* w, int64_t K, float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm256_fmadd_ps(xv, wv[c], acc[r * C + c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {  // the 4 sums at once: lane c of the halves' sum is acc[r * 4 + c]'s
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[r * 4], acc[r * 4 + 1]),
                                          _mm256_hadd_ps(acc[r * 4 + 2], acc[r * 4 + 3]));
      _mm_storeu_ps(out + r * N, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
    } else {
      for (int c = 0; c < C; ++c) out[r * N + c] = sum_lanes(acc[r * C + c]);
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * w[c * K + k];
      out[r * N + c] = acc;
    }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// float_block on a CPU with AVX-512 (K a multiple of 16): 16 columns a step, and 32 registers hold WIDE_ROWS x 4
// accumulators. Where a core has two 512-bit multiply-add units (Intel's servers), that is twice the 8-wide code's
// multiply-adds a cycle; where 512-bit instructions take two halves (Zen 4), the same.
template <int R, int C>
AVX512_TARGET void float_block_wide(const float* x, const float* w, int64_t K, float* out, int64_t N) {
  __m512 acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_fmadd_ps(xv, wv[c], acc[r * C + c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = _mm512_reduce_add_ps(acc[r * C + c]);
}
#endif

// float_block<R, C> (WIDE: float_block_wide) for C (1 to TILE_COLUMNS) weight rows
template <int R, bool WIDE>
inline void columns_block(int64_t C, const float* x, const float* w, int64_t K, float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (WIDE) {
    switch (C) {
      case 4: return float_block_wide<R, 4>(x, w, K, out, N);
      case 3: return float_block_wide<R, 3>(x, w, K, out, N);
      case 2: return float_block_wide<R, 2>(x, w, K, out, N);
      default: return float_block_wide<R, 1>(x, w, K, out, N);
    }
  }
#endif
  switch (C) {
    case 4: float_block<R, 4>(x, w, K, out, N); break;
    case 3: float_block<R, 3>(x, w, K, out, N); break;
    case 2: float_block<R, 2>(x, w, K, out, N); break;
    default: float_block<R, 1>(x, w, K, out, N); break;
  }
}

// out [M, N] from column 0 to C - 1: x [M, K] times the float weight rows w [C, K], CHUNK_ROWS activation rows
// at a time (so that they stay in the core's cache while each block of weight rows meets them), in blocks of R rows
template <int R, bool WIDE>
void float_tile(const float* x, int64_t M, int64_t K, const float* w, int64_t C, float* out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
    const int64_t m1 = std::min(M, m0 + CHUNK_ROWS);
    for (int64_t c = 0; c < C; c += TILE_COLUMNS) {
      const int64_t columns = std::min<int64_t>(TILE_COLUMNS, C - c);
      int64_t m = m0;
      for (; m + R <= m1; m += R) columns_block<R, WIDE>(columns, x + m * K, w + c * K, K, out + m * N + c, N);
      for (; m < m1; ++m) columns_block<1, WIDE>(columns, x + m * K, w + c * K, K, out + m * N + c, N);
    }
  }
}

// float_tile in the AVX-512 code where the CPU has it (and K is a multiple of 16), else the 8-wide one
void float_tile(const float* x, int64_t M, int64_t K, const float* w, int64_t C, float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if (avx512_usable() && K % 16 == 0) return float_tile<WIDE_ROWS, true>(x, M, K, w, C, out, N);
#endif
  float_tile<TILE_ROWS, false>(x, M, K, w, C, out, N);
}

// Multiply-adds of a tile kernel that count as one byte of THREAD_WORK: a thread reads weights at about 17 GB/s and
// multiplies at about 42 G multiply-adds a second (85 GFLOPS, a Zen 4 core in float32), so a megabyte of reading
// takes as long as 2.5 million multiply-adds; the tile kernels count 2, so that a 37-row product of the default
// model's 576 x 576 output projection (6 million units) takes both threads of a 2-core machine
constexpr int64_t MULTIPLY_ADDS_PER_BYTE = 2;

// out [M, N] = x [M, K] times the weights [N, K] that row(n, buffer) writes as K floats, a task at a time; each
// output column n then times column_scales[n] where there are such scales
template <typename Row>
void dequantized_product(const float* x, int64_t M, int64_t K, int64_t N, float* out, Row&& row,
                         const float* column_scales = nullptr) {
  over_tasks(N, N * K * M / MULTIPLY_ADDS_PER_BYTE, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> tile;
    tile.resize(GRAIN * K);
    for (int64_t n = n0; n < n1; ++n) row(n, tile.data() + (n - n0) * K);
    float_tile(x, M, K, tile.data(), n1 - n0, out + n0, N);
    for (int64_t m = 0; column_scales && m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) out[m * N + n] *= column_scales[n];
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// A row of int4_level_pairs on a CPU with AVX-512: each group's 16 numbers computed once (group_numbers) and each
// weight looked up among them by its nibble (lookup_nibbles), 16 weights an instruction
AVX512_TARGET void int4_lookup_row(const uint8_t* w, int64_t K, int64_t group, const float* scales,
                                   const float* zeros, float* out) {
  for (int64_t g = 0; g * group < K; ++g) {
    const __m512 table = group_numbers(scales[g], zeros[g]);
    for (int64_t c = g * group; c < std::min(K, (g + 1) * group); c += PAIRED) {
      __m512 low, high;
      lookup_nibbles(w + c / 2, table, low, high);
      _mm512_storeu_ps(out + c, low);
      _mm512_storeu_ps(out + c + PAIRED / 2, high);
    }
  }
}
#endif

// out[j] = (level - 8) * scale + zero for the columns from `first` to `last` (multiples of PAIRED) of a row of int4
// weights w, in pair_columns' order: per PAIRED columns (16 bytes), the low nibbles' 16, then the high nibbles' 16. A
// product rounded, then a sum, as int4_dequantize_cpu's numbers
inline void int4_level_pairs(const uint8_t* w, int64_t first, int64_t last, float scale, float zero, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
  const __m256i mid = _mm256_set1_epi32(static_cast<int>(MID)), nibble = _mm256_set1_epi32(0xF);
  for (int64_t c = first; c < last; c += PAIRED / 2) {  // 8 bytes: columns 8 h .. 8 h + 7 of each half h
    const int64_t half = (c - first) % PAIRED / 2, base = c - (c - first) % PAIRED;
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 2)));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, nibble), mid));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), mid));
    _mm256_storeu_ps(out + base + half, _mm256_add_ps(_mm256_mul_ps(low, s), z));
    _mm256_storeu_ps(out + base + PAIRED / 2 + half, _mm256_add_ps(_mm256_mul_ps(high, s), z));
  }
#else
  for (int64_t c = first; c < last; c += PAIRED)
    for (int64_t i = 0; i < PAIRED / 2; ++i) {
      out[c + i] = (static_cast<float>(w[c / 2 + i] & 0xF) - MID) * scale + zero;
      out[c + PAIRED / 2 + i] = (static_cast<float>(w[c / 2 + i] >> 4) - MID) * scale + zero;
    }
#endif
}

// x [M, K] float32 times the int4 weight [N, K / 2] with scales and zeros [N, groups] float32 (as int4_gemv_cpu):
// [M, N], the weights dequantized a task at a time; K a multiple of 64
at::Tensor int4_matmul_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                           const at::Tensor& zeros, int64_t group) {
  const int64_t G = check_int4(x, weight, scales, zeros, group);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous(), zc = zeros.contiguous();
  auto out = at::empty({M, N}, x.options());
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float *sp = sc.data_ptr<float>(), *zp = zc.data_ptr<float>();
  const auto row = [&](int64_t n, float* out_row) {
#if defined(__AVX2__) && defined(__FMA__)
    if (avx512_usable()) return int4_lookup_row(wp + n * K / 2, K, group, sp + n * G, zp + n * G, out_row);
#endif
    for (int64_t g = 0; g < G; ++g)
      int4_level_pairs(wp + n * K / 2, g * group, std::min(K, (g + 1) * group), sp[n * G + g], zp[n * G + g], out_row);
  };
  const float* paired = pair_columns(xc.data_ptr<float>(), M, K);
  dequantized_product(paired, M, K, N, out.data_ptr<float>(), row);
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// int8_scaled's first count - count % 16 columns on a CPU with AVX-512, 16 weights an instruction; the columns done
AVX512_TARGET int64_t int8_scaled_wide(const int8_t* w, int64_t count, float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t k = 0;
  for (; k + 16 <= count; k += 16) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
  }
  return k;
}
#endif

// out[k] = w[k] * scale for the int8 weights w [count]: a product rounded, as the reference's w.float() * scale
inline void int8_scaled(const int8_t* w, int64_t count, float scale, float* out) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (avx512_usable()) k = int8_scaled_wide(w, count, scale, out);
  const __m256 s = _mm256_set1_ps(scale);
  for (; k + 8 <= count; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(int8_floats(w + k), s));
#endif
  for (; k < count; ++k) out[k] = static_cast<float>(w[k]) * scale;
}

// x [M, K] float32 times the int8 weight [N, K] with scales [N] (each multiplying its row's sums) or [N, K / group]
// float32 (each multiplying its group's weights), as int8_gemv_cpu and int8_group_gemv_cpu: [M, N], the weights
// dequantized a task at a time; K a multiple of 16, a group a multiple of 8 dividing K
at::Tensor int8_matmul_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t group) {
  check_rows(x, weight, 1);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  const bool grouped = scales.dim() == 2;
  TORCH_CHECK(weight.scalar_type() == at::kChar && K % INT8_STEP == 0, "int8 weight with K % 16 == 0");
  TORCH_CHECK(!grouped || (group > 0 && group % 8 == 0 && K % group == 0),
              "group_size a multiple of 8 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == N && (!grouped || scales.size(1) == K / group),
              "scales must be [N] or [N, K / group_size] float32");
  auto xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous();
  auto out = at::empty({M, N}, x.options());
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = grouped ? K / group : 1;
  const auto row = [&](int64_t n, float* out_row) {
    for (int64_t g = 0; g < G; ++g)
      int8_scaled(wp + n * K + g * (K / G), K / G, grouped ? sp[n * G + g] : 1.f, out_row + g * (K / G));
  };
  dequantized_product(xc.data_ptr<float>(), M, K, N, op, row, grouped ? nullptr : sp);
  return out;
}

// ---- activations rounded to int8 (int8_q8_gemv_cpu, int4_q8_gemv_cpu) ----
//
// As llama.cpp multiplies its Q8_0 and Q4_1 weights: each block of QBLOCK activation columns is rounded to int8
// levels with one float scale (x ~ d q, d = max |x| / 127), and a weight row's product is a sum over blocks of
// (weight scale) * d * (integer dot product of the block), whose products integer instructions multiply and sum, 4
// columns of 16 weight rows at a time (the packed blocks below), where the float kernels above widen and multiply 8
// weights at a time. The results differ from the dequantized reference by the activations' rounding (half a level of
// their block at most per column). Two sets of instructions take the same packed weights:
// - AVX512-VNNI (vpdpbusd: unsigned bytes times signed ones, 4 to a 32-bit sum, 16 rows to an instruction). The int8
//   weights go in as w + 128 and the int4 levels as they are (0..15), and each block's sum starts from the integer
//   that makes it the weights' own values' (centered int4 levels, q - 8) times the activations' levels: -128 or -8
//   times the sum of those levels.
// - AVX2 (vpmaddubsw: unsigned bytes times signed ones, 2 to a saturating 16-bit sum; vpmaddwd by ones: 2 of those
//   to a 32-bit one; 8 rows to an instruction). An int4 pair's sum is at most 2 * 15 * 127 = 3810, so the 8 pairs of a
//   row's 32 columns add up in 16 bits (30480 at most) before they are widened, and the sum starts from -8 times the
//   levels' sum as above. An int8 pair of w + 128 could reach 2 * 255 * 127 and saturate, so the int8 weights go in
//   as |w| (0..128) against the activations' levels with w's sign (vpsignb: 2 * 128 * 127 = 32512 at most), a 32-bit
//   sum per 4 columns, and the sum starts from 0.
// The integer sums are exact either way; the float sums over blocks differ in their rounding only.

constexpr int64_t QBLOCK = 32;  // activation columns per scale
constexpr float QMAX = 127.f;

#if defined(__AVX2__) && defined(__FMA__)
#define Q8_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

// Whether the q8 products take vpdpbusd: the CPU has AVX512-VNNI (and AVX512-F, BW, VL) and the kernels their
// AVX-512 code (set_avx512); else they take AVX2's instructions
bool q8_vnni() {
  return avx512_usable() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}
#else
bool q8_vnni() {
  return false;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The levels q [QBLOCK] of the block x [QBLOCK], rounded to the nearest (ties to even), and its scale d = max |x| /
// 127 (x ~ d q; a block of zeros has d = 0); *sum: the sum of x itself
Q8_TARGET float quantize_block(const float* x, int8_t* q, float* sum) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);  // QBLOCK = 32 floats
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  const __m512 inverse = _mm512_set1_ps(amax > 0.f ? QMAX / amax : 0.f);
  // float -> int32 in the current rounding mode (to the nearest, ties to even, as nearbyint), then to bytes
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
  return amax / QMAX;
}

// quantize_block in AVX2: the same levels and scale
inline float quantize_block_avx2(const float* x, int8_t* q, float* sum) {
  __m256 v[4];  // QBLOCK = 4 vectors of 8 floats
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  *sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  const __m256 inverse = _mm256_set1_ps(amax > 0.f ? QMAX / amax : 0.f);
  __m256i n[4];  // float -> int32 in the current rounding mode, as above
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // int32 -> int16 -> int8 with saturation: each step interleaves the two 128-bit halves of its operands, so the
  // 32-bit groups come out as 0 4 1 5 2 6 3 7 of the block's order, put back by the permutation
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return amax / QMAX;
}

// Activation rows rounded block by block: levels [M, K]; per block [M, K / QBLOCK], the scales, the offsets (the first
// value of the block's sum: -128, -8 or 0 times its levels' sum, see above) and the sums of x itself
struct Q8Rows {
  const int8_t* levels;
  const float* scales;
  const int32_t* offsets;
  const float* sums;

  // the same from row m on (rows of K columns)
  Q8Rows from(int64_t m, int64_t K) const {
    const int64_t B = K / QBLOCK;
    return {levels + m * K, scales + m * B, offsets + m * B, sums + m * B};
  }
};

// x [M, K] rounded (with vpdpbusd's instructions, or AVX2's), each block's offset `factor` times its levels' sum
// (int8 weights: -128 with vpdpbusd, 0 with AVX2; int4: -8), in buffers of the calling thread kept from call to call
Q8Rows round_rows(const float* x, int64_t M, int64_t K, int32_t factor, bool vnni) {
  thread_local std::vector<int8_t> levels;
  thread_local std::vector<float> scales, sums;
  thread_local std::vector<int32_t> offsets;
  levels.resize(M * K);
  scales.resize(M * K / QBLOCK);
  sums.resize(M * K / QBLOCK);
  offsets.resize(M * K / QBLOCK);
  for (int64_t b = 0; b < M * K / QBLOCK; ++b)  // blocks of all rows in turn: K is a multiple of QBLOCK
    scales[b] = vnni ? quantize_block(x + b * QBLOCK, levels.data() + b * QBLOCK, &sums[b])
                     : quantize_block_avx2(x + b * QBLOCK, levels.data() + b * QBLOCK, &sums[b]);
  for (int64_t i = 0; i < M * K / QBLOCK; ++i) {
    int32_t sum = 0;
    for (int64_t t = 0; t < QBLOCK; ++t) sum += levels[i * QBLOCK + t];
    offsets[i] = factor * sum;
  }
  return {levels.data(), scales.data(), offsets.data(), sums.data()};
}

// The weights of the q8 products, packed by gpt_fast/kernels/cpu_gemv.py (pack_int8_q8, pack_int4_q8) for vpdpbusd:
// blocks of PACK_ROWS output rows by QBLOCK columns, the column blocks of a row block one after another. In a block's
// 64-byte vector i, lane n (a 32-bit word) holds row n's weights of 4 columns: int8 ones (8 vectors) as unsigned
// bytes w + 128, of columns 4 i .. 4 i + 3; int4 levels (4 vectors) in the bytes' low nibbles for columns 4 i .. 4 i
// + 3 and in their high ones for 16 + 4 i .. (a mask, or a shift and a mask, unpacks them). One vpdpbusd multiplies
// 16 rows' 4 columns by those 4 columns of an activation row, broadcast to every lane, and sums them per row: a
// block's product with one activation row is 8 instructions for 512 weights, and the weights are loaded (and
// unpacked) once for every 4 activation rows. Scales (and int4 zeros) are [row blocks, groups, PACK_ROWS].
constexpr int64_t PACK_ROWS = 16;
constexpr int64_t VECTOR = 64;  // bytes of a 512-bit vector
constexpr int64_t PACK_VECTORS = QBLOCK / 4;  // a block's vectors of unsigned bytes, 4 columns each

// The PACK_VECTORS vectors of bytes v[i] of column block b of the packed row block w (int8: PACK_VECTORS vectors;
// int4: half as many, each unpacked into two)
template <bool INT4>
Q8_TARGET inline void block_vectors(const uint8_t* w, int64_t b, __m512i* v) {
  constexpr int64_t stored = INT4 ? PACK_VECTORS / 2 : PACK_VECTORS;
  const uint8_t* wb = w + b * stored * VECTOR;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < stored; ++i) {
    prefetch(wb + VECTOR * i);
    const __m512i bytes = _mm512_loadu_si512(wb + VECTOR * i);
    if (INT4) {
      v[i] = _mm512_and_si512(bytes, nibble);
      v[stored + i] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    } else {
      v[i] = bytes;
    }
  }
}

// out[r * N + n] for the R activation rows from m (rounded: a, each block's sum started at -128 or -8 times its
// levels' sum, so that it is the signed weights' or the centered levels') and the PACK_ROWS output rows n of the
// packed row block w, with scales (and, int4, zeros) [G, PACK_ROWS], a group `per` column blocks: the sum over
// column blocks of scale * d * (weights . rounded levels), plus for int4 the sum over groups of zero * (the sum of x
// over the group)
template <int R, bool INT4>
Q8_TARGET inline void q8_block(const Q8Rows& a, int64_t m, int64_t K, int64_t G, int64_t per, const uint8_t* w,
                               const float* scales, const float* zeros, float* out, int64_t N) {
  const int64_t B = K / QBLOCK;
  const auto [q, d, offsets, sums] = a.from(m, K);  // row r's from q + r K, and d, offsets, sums + r B
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[R], xsum[R];  // the group's scaled integer sums, and the sums of x over it
    for (int r = 0; r < R; ++r) part[r] = xsum[r] = _mm512_setzero_ps();
    for (int64_t b = g * per; b < std::min(B, (g + 1) * per); ++b) {
      __m512i v[PACK_VECTORS];
      block_vectors<INT4>(w, b, v);
      for (int r = 0; r < R; ++r) {
        int32_t words[PACK_VECTORS];  // the row's 32 levels of the block, 4 to a word
        std::memcpy(words, q + r * K + b * QBLOCK, QBLOCK);
        __m512i s0 = _mm512_set1_epi32(offsets[r * B + b]), s1 = _mm512_setzero_si512();
        for (int i = 0; i < PACK_VECTORS; i += 2) {
          s0 = _mm512_dpbusd_epi32(s0, v[i], _mm512_set1_epi32(words[i]));
          s1 = _mm512_dpbusd_epi32(s1, v[i + 1], _mm512_set1_epi32(words[i + 1]));
        }
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(d[r * B + b]), part[r]);
        if (INT4) xsum[r] = _mm512_add_ps(xsum[r], _mm512_set1_ps(sums[r * B + b]));
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + g * PACK_ROWS);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
    if (INT4) {
      const __m512 z = _mm512_loadu_ps(zeros + g * PACK_ROWS);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(z, xsum[r], acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N, acc[r]);
}

constexpr int64_t HALF = PACK_ROWS / 2;  // the rows of a packed block that a 256-bit vector holds (AVX2)
// A weight byte's work in AVX2's q8 products against vpdpbusd's (over_tasks): about 16 multiply-adds an instruction
// (8 vpmaddubsw, 7 adds and a vpmaddwd for 8 rows' 32 columns) against 64, so that a product takes the second thread
// from a quarter of the weights. The default model through the server on a 2-core Zen 3: 4 requests at once in 2.46
// s against 3.12, one stream 97 tok/s against 89 (docs/bench/HISTORY.md, 2026-12-01f)
constexpr int64_t AVX2_Q8_WORK = 4;

// the 4 levels at p, broadcast to every 32-bit lane
inline __m256i broadcast_levels(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return _mm256_set1_epi32(word);
}

// Column block b of the packed int8 row block w, rows 8 h .. 8 h + 7 (the bytes 32 h .. 32 h + 31 of each 64-byte
// vector, see above): vector i holds the weights of columns 4 i .. 4 i + 3, signed (sign[i]) and as |w| (v[i])
inline void int8_half(const uint8_t* w, int64_t b, int h, __m256i* v, __m256i* sign) {
  const uint8_t* wb = w + b * PACK_VECTORS * VECTOR + h * VECTOR / 2;
  for (int i = 0; i < PACK_VECTORS; ++i) {
    if (h == 0) prefetch(wb + VECTOR * i);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + VECTOR * i));
    sign[i] = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128 -> w
    v[i] = _mm256_abs_epi8(sign[i]);  // |-128| = 128 as an unsigned byte
  }
}

// The same of an int4 row block: vector i holds the levels (0..15) of columns 4 i .. 4 i + 3
inline void int4_half(const uint8_t* w, int64_t b, int h, __m256i* v) {
  constexpr int stored = PACK_VECTORS / 2;
  const uint8_t* wb = w + b * stored * VECTOR + h * VECTOR / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < stored; ++i) {
    if (h == 0) prefetch(wb + VECTOR * i);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + VECTOR * i));
    v[i] = _mm256_and_si256(bytes, nibble);
    v[stored + i] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
  }
}

// The 32-bit sums per row of 8 rows' 32 columns (v, sign: int8_half or int4_half) times an activation row's levels
// of the block (levels [QBLOCK]), started from `offset`
template <bool INT4>
inline __m256i half_sums(const __m256i* v, const __m256i* sign, const int8_t* levels, int32_t offset) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_set1_epi32(offset);
  if (INT4) {  // 8 pairs of 16-bit sums per row, added in 16 bits (see above)
    __m256i pairs = _mm256_maddubs_epi16(v[0], broadcast_levels(levels));
    for (int i = 1; i < PACK_VECTORS; ++i)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[i], broadcast_levels(levels + 4 * i)));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
  }
  for (int i = 0; i < PACK_VECTORS; ++i) {
    const __m256i x = _mm256_sign_epi8(broadcast_levels(levels + 4 * i), sign[i]);
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(v[i], x), ones));
  }
  return sum;
}

// q8_block in AVX2: the same outputs, 8 of the PACK_ROWS rows at a time. Each block's integer sums go straight into
// the row's accumulator, scaled by d times the group's scales (a multiply and a fused multiply-add, as q8_block's two
// fused multiply-adds per block), which leaves the 16 vector registers to the weights and R accumulators.
template <int R, bool INT4>
inline void q8_block_avx2(const Q8Rows& a, int64_t m, int64_t K, int64_t G, int64_t per, const uint8_t* w,
                          const float* scales, const float* zeros, float* out, int64_t N) {
  const int64_t B = K / QBLOCK;
  const auto [q, d, offsets, sums] = a.from(m, K);  // row r's from q + r K, and d, offsets, sums + r B
  for (int h = 0; h < 2; ++h) {  // rows 8 h .. 8 h + 7; the row block's weights stay in the core's cache for h = 1
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 s = _mm256_loadu_ps(scales + g * PACK_ROWS + h * HALF);
      const int64_t first = g * per, last = std::min(B, (g + 1) * per);
      for (int64_t b = first; b < last; ++b) {
        __m256i v[PACK_VECTORS], sign[INT4 ? 1 : PACK_VECTORS];
        if constexpr (INT4)
          int4_half(w, b, h, v);
        else
          int8_half(w, b, h, v, sign);
        for (int r = 0; r < R; ++r) {
          const __m256i sum = half_sums<INT4>(v, sign, q + r * K + b * QBLOCK, offsets[r * B + b]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(s, _mm256_set1_ps(d[r * B + b])), acc[r]);
        }
      }
      if (INT4) {  // the zero points times the sums of x over the group
        const __m256 z = _mm256_loadu_ps(zeros + g * PACK_ROWS + h * HALF);
        for (int r = 0; r < R; ++r) {
          float xsum = 0.f;
          for (int64_t b = first; b < last; ++b) xsum += sums[r * B + b];
          acc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N + h * HALF, acc[r]);
  }
}
#endif

// The checks of a packed q8 product's operands (pack_int8_q8, pack_int4_q8): x [M, K] float32, words [N / PACK_ROWS,
// K * PACK_ROWS] uint8 (int4: half as many), scales (and zeros) [N / PACK_ROWS, groups, PACK_ROWS] float32; its groups
int64_t check_packed(const at::Tensor& x, const at::Tensor& words, std::initializer_list<at::Tensor> scales,
                     int64_t group, bool int4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  const int64_t K = x.size(1), G = (K + group - 1) / group;
  TORCH_CHECK(K % QBLOCK == 0 && group >= QBLOCK && group % QBLOCK == 0, "K and the group a multiple of 32");
  TORCH_CHECK(words.scalar_type() == at::kByte && words.dim() == 2 &&
                  words.size(1) == K * PACK_ROWS / (int4 ? 2 : 1),
              "words must be [N / 16, K * 16] (int8) or [N / 16, K * 8] (int4) uint8, as packed");
  for (const auto& t : scales)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == words.size(0) && t.size(1) == G &&
                    t.size(2) == PACK_ROWS,
                "scales and zeros must be [N / 16, groups, 16] float32, as packed");
  return G;
}

// x [M, K] float32 times packed int8 or int4 weights (INT4), the activations rounded to int8 per QBLOCK columns (each
// block's sum started from its offset, see above), by vpdpbusd or AVX2's instructions: [M, N]. Any number of rows:
// a row block's weights are loaded once for every 4 rows, and stay in the core's cache for all of them.
template <bool INT4>
at::Tensor packed_gemv(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, const float* zeros,
                       int64_t group, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), N = words.size(0) * PACK_ROWS;
  auto xc = x.contiguous(), wc = words.contiguous(), sc = scales.contiguous();
  auto out = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const bool vnni = q8_vnni();
  const int32_t factor = INT4 ? -static_cast<int32_t>(MID) : vnni ? -128 : 0;  // see "activations rounded" above
  const Q8Rows rounded = round_rows(xc.data_ptr<float>(), M, K, factor, vnni);
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t block_bytes = words.size(1), per = group / QBLOCK;
  over_tasks(N, N * K / (INT4 ? 2 : 1) * M * (vnni ? 1 : AVX2_Q8_WORK), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += PACK_ROWS) {
      const int64_t block = n / PACK_ROWS;
      const uint8_t* wb = wp + block * block_bytes;
      const float *sb = sp + block * G * PACK_ROWS, *zb = INT4 ? zeros + block * G * PACK_ROWS : nullptr;
      by_rows(M, [&](auto rows, int64_t m) {
        constexpr int R = decltype(rows)::value;
        if (vnni)
          q8_block<R, INT4>(rounded, m, K, G, per, wb, sb, zb, yp + m * N + n, N);
        else
          q8_block_avx2<R, INT4>(rounded, m, K, G, per, wb, sb, zb, yp + m * N + n, N);
      });
    }
  });
#endif
  return out;
}

// x [M, K] float32 times the int8 weights [N, K] packed by pack_int8_q8 (gpt_fast/kernels/cpu_gemv.py): words
// [N / PACK_ROWS, K * PACK_ROWS] uint8, scales [N / PACK_ROWS, groups, PACK_ROWS] float32, a group of `group` columns
// (0: one scale per row, for all K columns); the activations rounded to int8 per QBLOCK columns: [M, N]; K and the
// group a multiple of 32
at::Tensor int8_q8_gemv_cpu(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K] float32");
  const int64_t columns = group ? group : x.size(1);
  const int64_t G = check_packed(x, words, {scales}, columns, false);
  return packed_gemv<false>(x, words, scales, nullptr, columns, G);
}

// x [M, K] float32 times the int4 weights [N, K / 2] packed by pack_int4_q8: words [N / PACK_ROWS, K * PACK_ROWS / 2]
// uint8, scales and zeros [N / PACK_ROWS, groups, PACK_ROWS] float32 (a level q stands for (q - 8) * scale + zero,
// as int4_gemv_cpu's); the activations rounded to int8 per QBLOCK columns: [M, N]; K a multiple of 32, group_size a
// multiple of 32
at::Tensor int4_q8_gemv_cpu(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales,
                            const at::Tensor& zeros, int64_t group) {
  const int64_t G = check_packed(x, words, {scales, zeros}, group, true);
  const at::Tensor zc = zeros.contiguous();
  return packed_gemv<true>(x, words, scales, zc.data_ptr<float>(), group, G);
}

// x . w for the float32 rows x [K] and w [K]: 4 chains of fused multiply-adds side by side, the weights asked for
// PREFETCH bytes ahead
inline float float_dot(const float* x, const float* w, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int V = 4;
  __m256 acc[V];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * V <= K; k += 8 * V) {
    prefetch(w + k);
    prefetch(w + k + LINE / sizeof(float));
    for (int v = 0; v < V; ++v)
      acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * v), _mm256_loadu_ps(w + k + 8 * v), acc[v]);
  }
  for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc[0]);
  float sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#else
  float sum = 0.f;
  int64_t k = 0;
#endif
  for (; k < K; ++k) sum += x[k] * w[k];
  return sum;
}

// The rows x [M, K] float32 (a decode step's few) times the float32 weight [N, K]: [M, N]; on one thread it reads the
// weights 1.5x as fast as torch's product of one row (the default model's float32 decode: docs/bench/HISTORY.md,
// 2026-11-30i)
at::Tensor float_gemv(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, weight, 1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "float_gemv: float32 weights");
  auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(N, N * K * static_cast<int64_t>(sizeof(float)), [&](int64_t n) {
    for (int64_t m = 0; m < M; ++m) op[m * N + n] = float_dot(xp + m * K, wp + n * K, K);  // the weight row in L1
  });
  return out;
}

}  // namespace

namespace gpt_fast_cpu {

// One product of decode_layers_cpu (cpu_layers.cpp): the rows x [R, K] float32 times a layer's weight of `kind`
// (gpt_fast/kernels/cpu_layers.py names them), whose tensors are w[0] .. : 0 float32 [N, K]; 1 int8 [N, K] and
// scales ([N], or [N, K / group]); 2 the same packed, the rows rounded to int8 (int8_q8_gemv_cpu); 3 int4 [N, K / 2],
// scales and zeros [N, K / group]; 4 the same packed, the rows rounded (int4_q8_gemv_cpu). A product of kind 1 or 3 of
// more rows than `gemv_rows` (by kind; empty: any) is a matrix product (int8_matmul_cpu, int4_matmul_cpu), as the
// layers' own calls choose (gpt_fast/quant/products.py); kinds 2 and 4 take any rows
at::Tensor layer_product(int64_t kind, const at::Tensor& x, const at::Tensor* w, int64_t group,
                         c10::IntArrayRef gemv_rows) {
  const bool matmul = static_cast<int64_t>(gemv_rows.size()) > kind && x.size(0) > gemv_rows[kind];  // 0: not read
  switch (kind) {
    case 0:
      return float_gemv(x, w[0]);
    case 1:
      if (matmul) return int8_matmul_cpu(x, w[0], w[1], group);
      return group ? int8_group_gemv_cpu(x, w[0], w[1], group) : int8_gemv_cpu(x, w[0], w[1]);
    case 2:
      return int8_q8_gemv_cpu(x, w[0], w[1], group);
    case 3:
      return matmul ? int4_matmul_cpu(x, w[0], w[1], w[2], group) : int4_gemv_cpu(x, w[0], w[1], w[2], group);
    case 4:
      return int4_q8_gemv_cpu(x, w[0], w[1], w[2], group);
    default:
      TORCH_CHECK(false, "layer_product: kind ", kind, " is not 0 to 4");
  }
}

}  // namespace gpt_fast_cpu

TORCH_LIBRARY_FRAGMENT(gpt_fast, m) {
  m.def("int8_gemv_cpu(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_group_gemv_cpu(Tensor x, Tensor weight, Tensor scales, int group_size) -> Tensor");
  m.def("int4_gemv_cpu(Tensor x, Tensor weight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int4_dequantize_cpu(Tensor weight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int4_matmul_cpu(Tensor x, Tensor weight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int8_matmul_cpu(Tensor x, Tensor weight, Tensor scales, int group_size) -> Tensor");
  m.def("int8_q8_gemv_cpu(Tensor x, Tensor words, Tensor scales, int group_size) -> Tensor");
  m.def("int4_q8_gemv_cpu(Tensor x, Tensor words, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("q8_vnni() -> bool", &q8_vnni);
  m.def("set_avx512(bool enabled) -> bool", &set_avx512);
}

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) {
  m.impl("int8_gemv_cpu", &int8_gemv_cpu);
  m.impl("int8_group_gemv_cpu", &int8_group_gemv_cpu);
  m.impl("int4_gemv_cpu", &int4_gemv_cpu);
  m.impl("int4_dequantize_cpu", &int4_dequantize_cpu);
  m.impl("int4_matmul_cpu", &int4_matmul_cpu);
  m.impl("int8_matmul_cpu", &int8_matmul_cpu);
  m.impl("int8_q8_gemv_cpu", &int8_q8_gemv_cpu);
  m.impl("int4_q8_gemv_cpu", &int4_q8_gemv_cpu);
}
