// Every decoder layer of a decode step of one token per row on an x86 CPU, as the operator
// gpt_fast::decode_layers_cpu (built with cpu_gemv.cpp and cpu_attention.cpp into one library by
// gpt_fast/kernels/cpu_gemv.py). A step of the model's own code makes a few dozen operator calls per layer, each a
// Python call in eager mode and a call from inductor's wrapper when compiled; this makes one call for all the layers,
// its norms, residual adds and gated activations written here, its products and attention those of the other two
// files (layer_product, attend_rows), called directly. A step of several rows (a server's) reads each weight once
// for all of them (the products take the rows together); each row attends at its own position.
//
// The layers are the model's Llama-style decoder in float32 (gpt_fast/model/transformer.py, TransformerBlock): the
// RMSNorm of the residual, the q/k/v product (and bias), the attention, the output product added to the residual,
// the RMSNorm, the gate and up product, the gated activation, the down product added to the residual. The numbers
// differ from the model's code by the order of float32 sums only (and by the products' own rounding with the q8
// kernels).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace gpt_fast_cpu {  // cpu_gemv.cpp's and cpu_attention.cpp's, which say what they do
at::Tensor layer_product(int64_t kind, const at::Tensor& x, const at::Tensor* w, int64_t group,
                         c10::IntArrayRef gemv_rows);
void attend_rows(const float* qkv, int64_t R, int64_t H, int64_t H_kv, int64_t D, const float* cos, const float* sin,
                 const at::Tensor& kv, const int64_t* table, int64_t table_stride, int64_t first_row,
                 const int64_t* positions, bool shared, float scale, std::optional<double> softcap, float* out);
__m256 exp8(__m256 x);
bool reads_cache_of(at::ScalarType dtype);
}  // namespace gpt_fast_cpu

namespace {

using gpt_fast_cpu::exp8;

constexpr int64_t LANES = 8;           // float32 lanes of an AVX2 vector
constexpr int64_t PLAN_FIELDS = 3;     // a product's plan: its weight's kind, group size, bias (1) or not (0)
constexpr int64_t LINEARS = 4;         // wqkv, wo, w13, w2
constexpr int64_t NORMS = 2;           // the attention norm's and the MLP norm's weights, first in a layer's tensors
constexpr int64_t TENSORS[] = {1, 2, 2, 3, 3};  // a weight's tensors by kind (layer_product)

// out [n] = RMSNorm of x [n]: x / sqrt(mean(x^2) + eps) times (offset + weight), as the model's rms_norm in float32
void rms_norm(const float* x, const float* weight, int64_t n, float eps, float offset, float* out) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) squares = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), squares);
  alignas(32) float lanes[LANES];
  _mm256_store_ps(lanes, squares);
  float sum = 0.f;
  for (const float lane : lanes) sum += lane;
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = x[i] * inverse * (offset + weight[i]);
}

// silu(g) = g / (1 + e^-g) for 8 g, as g * s with s = 1 / (1 + e) (g >= 0) or e / (1 + e), e = e^-|g| <= 1
inline __m256 silu8(__m256 g) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), g);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 numerator = _mm256_blendv_ps(one, e, g);  // the sign bit of g picks e
  return _mm256_mul_ps(g, _mm256_div_ps(numerator, _mm256_add_ps(one, e)));
}

// GeLU with tanh for 8 g: g / 2 * (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), tanh |y| = (1 - e) / (1 + e)
// with e = e^(-2 |y|) <= 1, its sign y's
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, y)));
  const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 tanh = _mm256_or_ps(magnitude, _mm256_and_ps(sign, y));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh));
}

// out [I] = act(gate) * up for gate_up [2 I] (the gate first), act silu or GeLU with tanh
void gated(const float* gate_up, int64_t I, bool gelu, float* out) {
  int64_t i = 0;
  for (; i + LANES <= I; i += LANES) {
    const __m256 g = _mm256_loadu_ps(gate_up + i);
    const __m256 act = gelu ? gelu_tanh8(g) : silu8(g);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(gate_up + I + i)));
  }
  for (; i < I; ++i) {
    const float g = gate_up[i];
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    out[i] = (gelu ? 0.5f * g * (1.f + std::tanh(y)) : g / (1.f + std::exp(-g))) * gate_up[I + i];
  }
}

// x [n] += y [n]
void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// The weights of the layers in order, each product's tensors as its plan says (the next product: product())
struct Weights {
  at::TensorList tensors;
  c10::IntArrayRef plan, gemv_rows;
  size_t next = 0, planned = 0;

  const at::Tensor& take() {
    TORCH_CHECK(next < tensors.size(), "decode_layers_cpu: fewer weights than the plan says");
    return tensors[next++];
  }

  // x [R, K] times the next product's weight (and bias): [R, N]
  at::Tensor product(const at::Tensor& x) {
    TORCH_CHECK(planned + PLAN_FIELDS <= plan.size(), "decode_layers_cpu: a plan of 3 numbers a product");
    const int64_t kind = plan[planned], group = plan[planned + 1];
    const bool bias = plan[planned + 2] != 0;
    planned += PLAN_FIELDS;
    TORCH_CHECK(kind >= 0 && kind < 5, "decode_layers_cpu: a product's kind is 0 to 4");
    TORCH_CHECK(next + TENSORS[kind] + bias <= tensors.size(), "decode_layers_cpu: fewer weights than the plan says");
    at::Tensor y = gpt_fast_cpu::layer_product(kind, x, tensors.data() + next, group, gemv_rows);
    next += TENSORS[kind];
    if (bias) {
      const at::Tensor& b = take();
      const int64_t N = y.size(1);
      TORCH_CHECK(b.numel() == N && b.is_contiguous() && b.scalar_type() == at::kFloat, "decode_layers_cpu: bias");
      for (int64_t r = 0; r < y.size(0); ++r) add_into(y.data_ptr<float>() + r * N, b.data_ptr<float>(), N);
    }
    return y;
  }
};

// Whether the caches are the ones a step of R rows at `positions` reads: float32, float16, bfloat16 or
// float8_e4m3fn (all one dtype), static [2, rows, H_kv, S, D] with rows first_row .. first_row + R - 1, or given the
// block table [rows, W], paged [2, N, block_size, H_kv, D]
void check_caches(at::TensorList kv, const std::optional<at::Tensor>& table, int64_t first_row, int64_t R,
                  int64_t H_kv, int64_t D, int64_t last) {
  if (table.has_value()) {
    TORCH_CHECK(table->dim() == 2 && table->scalar_type() == at::kLong && table->is_contiguous() && first_row >= 0 &&
                    first_row + R <= table->size(0),
                "decode_layers_cpu: a block table [rows, W] int64 holding the step's rows");
  }
  const at::ScalarType dtype = kv.empty() ? at::kFloat : kv[0].scalar_type();
  TORCH_CHECK(gpt_fast_cpu::reads_cache_of(dtype),
              "decode_layers_cpu: float32, float16, bfloat16 or float8_e4m3fn caches");
  for (const at::Tensor& cache : kv) {
    const bool shaped = cache.dim() == 5 && cache.stride(4) == 1 && cache.scalar_type() == dtype;
    if (table.has_value()) {
      TORCH_CHECK(shaped && cache.size(3) == H_kv && cache.size(4) == D && last < table->size(1) * cache.size(2),
                  "decode_layers_cpu: a paged cache [2, N, block_size, H_kv, D] holding the step's positions");
    } else {
      TORCH_CHECK(shaped && cache.size(2) == H_kv && cache.size(4) == D && first_row >= 0 &&
                      first_row + R <= cache.size(1) && last < cache.size(3),
                  "decode_layers_cpu: a static cache [2, rows, H_kv, S, D] holding the step's rows and positions");
    }
  }
}

// x [R, 1, dim] float32, the residual stream of R rows into the first layer, one token each; weights: each layer's
// attention and MLP norm weights [dim] then its wqkv, wo, w13, w2 tensors as `plan` [layers * 4 * 3] says (kind,
// group, bias: see layer_product); kv: each layer's cache, whose rows first_row .. first_row + R - 1 are the step's
// (check_caches: static, or paged with the block table `table`), written at each row's position; cos, sin
// [positions, D / 2] float32 (the model's tables); input_pos [1] (every row's) or [R, 1] int64; shape: H, H_kv, D;
// gemv_rows: by kind, the most rows a quantized product takes one weight row at a time (layer_product).
// Returns the residual stream out of the last layer, [R, 1, dim]; or, where the plan holds a product more (the output
// projection) and the weights the final norm's weight [dim] before its tensors, the logits [R, 1, V] of the normed
// residual.
at::Tensor decode_layers_cpu(const at::Tensor& x, at::TensorList weights, c10::IntArrayRef plan, at::TensorList kv,
                             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& input_pos,
                             c10::IntArrayRef shape, double eps, double offset, double scale,
                             std::optional<double> softcap, bool gelu, int64_t first_row,
                             const std::optional<at::Tensor>& table, c10::IntArrayRef gemv_rows) {
  TORCH_CHECK(shape.size() == 3, "decode_layers_cpu: shape is H, H_kv, D");
  const int64_t H = shape[0], H_kv = shape[1], D = shape[2], dim = x.size(-1), R = x.numel() / dim;
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat, "decode_layers_cpu: float32 rows [R, 1, dim]");
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0 && D % LANES == 0, "decode_layers_cpu: head shapes");
  const size_t layers_plan = kv.size() * LINEARS * PLAN_FIELDS;
  const bool head = plan.size() == layers_plan + PLAN_FIELDS;
  TORCH_CHECK(head || plan.size() == layers_plan, "decode_layers_cpu: a plan for every layer (and the head)");
  const bool shared = input_pos.numel() == 1;
  TORCH_CHECK((shared || input_pos.numel() == R) && input_pos.scalar_type() == at::kLong && input_pos.is_contiguous(),
              "decode_layers_cpu: int64 positions, one or one a row");
  const int64_t* positions = input_pos.data_ptr<int64_t>();
  const int64_t last = *std::max_element(positions, positions + input_pos.numel());
  TORCH_CHECK(*std::min_element(positions, positions + input_pos.numel()) >= 0, "decode_layers_cpu: positions >= 0");
  for (const at::Tensor* rope : {&cos, &sin})
    TORCH_CHECK(rope->scalar_type() == at::kFloat && rope->is_contiguous() && rope->size(-1) == D / 2 &&
                    last < rope->numel() / (D / 2),
                "decode_layers_cpu: rotary tables [positions, D / 2] float32 with the step's positions");
  check_caches(kv, table, first_row, R, H_kv, D, last);
  const int64_t* blocks = table.has_value() ? table->data_ptr<int64_t>() : nullptr;
  const int64_t table_stride = table.has_value() ? table->stride(0) : 0;
  at::Tensor h = x.reshape({R, dim}).clone();  // [R, dim]: the residual stream
  at::Tensor normed = at::empty({R, dim}, x.options()), attended = at::empty({R, H * D}, x.options()), hidden;
  float *hp = h.data_ptr<float>(), *np = normed.data_ptr<float>();
  const auto norm_rows = [&](const at::Tensor& weight) {
    for (int64_t r = 0; r < R; ++r) rms_norm(hp + r * dim, weight.data_ptr<float>(), dim, eps, offset, np + r * dim);
  };
  Weights w{weights, plan, gemv_rows};
  for (const at::Tensor& cache : kv) {
    const at::Tensor& attention_norm = w.take();
    const at::Tensor& mlp_norm = w.take();
    for (const at::Tensor* norm : {&attention_norm, &mlp_norm})
      TORCH_CHECK(norm->numel() == dim && norm->scalar_type() == at::kFloat && norm->is_contiguous(),
                  "decode_layers_cpu: norm weights [dim] float32");
    norm_rows(attention_norm);
    const at::Tensor qkv = w.product(normed);  // [R, (H + 2 H_kv) D]
    TORCH_CHECK(qkv.size(1) == (H + 2 * H_kv) * D, "decode_layers_cpu: wqkv gives H + 2 H_kv heads");
    gpt_fast_cpu::attend_rows(qkv.data_ptr<float>(), R, H, H_kv, D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                              cache, blocks, table_stride, first_row, positions, shared, static_cast<float>(scale),
                              softcap, attended.data_ptr<float>());
    add_into(hp, w.product(attended).data_ptr<float>(), R * dim);
    norm_rows(mlp_norm);
    const at::Tensor gate_up = w.product(normed);  // [R, 2 I]
    const int64_t I = gate_up.size(1) / 2;
    if (!hidden.defined()) hidden = at::empty({R, I}, x.options());  // [R, I]: every layer's MLP is alike
    for (int64_t r = 0; r < R; ++r)
      gated(gate_up.data_ptr<float>() + r * 2 * I, I, gelu, hidden.data_ptr<float>() + r * I);
    add_into(hp, w.product(hidden).data_ptr<float>(), R * dim);
  }
  at::Tensor out = h;
  if (head) {
    const at::Tensor& final_norm = w.take();
    TORCH_CHECK(final_norm.numel() == dim && final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous(),
                "decode_layers_cpu: the final norm's weight [dim] float32");
    norm_rows(final_norm);
    out = w.product(normed);  // [R, V]
  }
  TORCH_CHECK(w.next == weights.size(), "decode_layers_cpu: more weights than the plan says");
  return out.view({R, 1, out.size(-1)});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpt_fast, m) {
  m.def(
      "decode_layers_cpu(Tensor x, Tensor[] weights, int[] plan, Tensor(a!)[] kv, Tensor cos, Tensor sin, "
      "Tensor input_pos, int[] shape, float eps, float offset, float scale, float? softcap, bool gelu, "
      "int first_row=0, Tensor? table=None, int[] gemv_rows=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt_fast, CPU, m) {
  m.impl("decode_layers_cpu", &decode_layers_cpu);
}
