// The decoder layers around the quantized products, one call per forward (specchat/decode/runtime/cpu_decoder.py).
//
// A decoding step of a small model on a CPU spends as long between its products as in them: a
// Llama-family layer written as torch calls is ~40 of them (norms, rotary, the cache write,
// attention's steps, SwiGLU, residuals), each microseconds of dispatch, 24 layers a forward
// (2-core Zen 3, Qwen2.5-0.5B int5: ~0.5 ms per layer outside the products, about as much as the
// products of one token; docs/cpu-runtime.md). Here a whole forward is one call: each layer is
// its four products (woq_linear.cpp) and plain loops between them.
//
// Every row is computed on its own, in the same order whatever the other rows are: a norm sums
// its row in order; attention gathers, for each row, the positions it may see in cache order
// and reduces over them in that order. A draft token verified in a tree therefore sees the same
// keys in the same order as when plain decoding reaches it (the cached prefix, the root, its
// ancestors, itself), and gets the same bits, as the products do (woq_linear.cpp): greedy
// speculative output is plain decoding's token for token, not only up to rounding.
//
// Arithmetic follows transformers' Llama/Qwen2/Qwen3 layers: float32 inside, the activations'
// dtype (bf16 or float32) where those layers round to it (after each norm, rotary product and sum,
// residual sum, SiLU and product); attention in float32 over keys and values read in their own
// dtype. Head sizes 16, 32, 64 and 128 (the Python side checks).

#include "vectors.h"
#include "woq_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <cmath>
#include <vector>

namespace specchat {
namespace {

inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T narrow(float v) { return static_cast<T>(v); }  // bf16: to nearest even, as torch rounds


// e^x, Cephes' single-precision polynomial after reducing x by multiples of ln 2 (~1 ulp);
// arguments are clamped to where the result is a normal float.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

inline float exp1(float x) { return _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(x)))); }

// Loops over many elements split across threads; a few rows' worth runs on the calling thread.
constexpr int64_t kParallelElements = 1 << 16;

template <typename F>
void for_rows(int64_t rows, int64_t row_size, const F& body) {
  if (rows * row_size < kParallelElements) return body(0, rows);
  at::parallel_for(0, rows, 1, body);
}

// Eight floats rounded to T and widened back (the rounding transformers' layers make where they
// store in T): float32 as is; bf16 to nearest even, NaN to 0x7FC0, as c10::BFloat16 rounds one.
template <typename T>
inline __m256 round8(__m256 v);
template <>
inline __m256 round8<float>(__m256 v) { return v; }
template <>
inline __m256 round8<c10::BFloat16>(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256 nearest = _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32(-65536)));
  return _mm256_blendv_ps(nearest, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Stores eight floats that are already T's values (round8<T>'s results).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

// The elementwise work between the products, eight values at a time: the same roundings as the
// scalar tails (and as transformers' layers), so only the norm's sum depends on the vector width
// (it is summed in a fixed order per row all the same: alone or in a tree, a row gets the same bits).
// A few rows' worth is far below what spreading over threads pays for.

// transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) rounded to x's dtype, times the weight.
template <typename T>
void rms_norm(const T* x, const T* weight, T* y, int64_t rows, int64_t size, float eps) {
  for_rows(rows, size, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * size;
      T* out = y + r * size;
      __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();  // in double: exact squares
      int64_t k = 0;
      for (; k + 8 <= size; k += 8) {
        const __m256 v = load8(in + k);
        const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        low = _mm256_add_pd(low, _mm256_mul_pd(a, a));
        high = _mm256_add_pd(high, _mm256_mul_pd(b, b));
      }
      double lanes[4];
      _mm256_storeu_pd(lanes, _mm256_add_pd(low, high));
      double squares = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      for (; k < size; ++k) squares += static_cast<double>(f32(in[k])) * f32(in[k]);
      const float scale = 1.0f / std::sqrt(static_cast<float>(squares / size) + eps);
      const __m256 scales = _mm256_set1_ps(scale);
      for (k = 0; k + 8 <= size; k += 8)
        store8(out + k, round8<T>(_mm256_mul_ps(load8(weight + k), round8<T>(_mm256_mul_ps(load8(in + k), scales)))));
      for (; k < size; ++k) out[k] = narrow<T>(f32(weight[k]) * f32(narrow<T>(f32(in[k]) * scale)));
    }
  });
}

// Rotary embedding of one head's vector in place: x * cos + rotate_half(x) * sin, each product and
// the sum rounded to T (transformers' apply_rotary_pos_emb). d is a multiple of 16 (HEAD_SIZES).
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < half; j += 8) {
    const __m256 a = load8(x + j), b = load8(x + j + half);
    const __m256 first = _mm256_add_ps(round8<T>(_mm256_mul_ps(a, load8(cos + j))),
                                       round8<T>(_mm256_mul_ps(_mm256_xor_ps(b, sign), load8(sin + j))));
    const __m256 second = _mm256_add_ps(round8<T>(_mm256_mul_ps(b, load8(cos + j + half))),
                                        round8<T>(_mm256_mul_ps(a, load8(sin + j + half))));
    store8(x + j, round8<T>(first));
    store8(x + j + half, round8<T>(second));
  }
}

// The positions a forward's rows attend: all of [0, prefix), and of [prefix, prefix + width) those
// the row's block marks; no block: causally, the forward's n rows being the last n of that width.
struct Span {
  int64_t prefix, width;
  const bool* block;  // [n, width] or nullptr
};

// Eight vectors' lane sums as one vector: lane h holds the sum of a[h]'s eight lanes.
inline __m256 lane_sums(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  // each lane's two halves
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Attention of one row's G query heads (those sharing KV head g) over the positions it may see,
// in cache order (the prefix, then the positions of its block): scores in float32, softmax, the
// values' weighted sum, written to out [G, D] in T. Eight heads at a time, one per vector lane:
// each key and value is read and widened once for all of them, and the softmax runs across heads.
template <typename T, int D>
void attend_group(const T* q, int64_t G, const T* keys, const T* values, const Span& span, int64_t row, int64_t n,
                  float scaling, T* out, std::vector<int64_t>& marked, std::vector<float>& scores) {
  // Without a block the row sees one run of positions from 0 (a prefill's rows, or a chain's): listing
  // them, as a tree's rows need, cost a prefill of 2,048 tokens 200M entries.
  marked.clear();
  int64_t run = span.prefix + span.width - n + row + 1;
  if (span.block) {
    run = span.prefix;
    for (int64_t c = 0; c < span.width; ++c)
      if (span.block[row * span.width + c]) marked.push_back(span.prefix + c);
  }
  const int64_t count = run + static_cast<int64_t>(marked.size());
  const auto position = [&](int64_t t) { return t < run ? t : marked[t - run]; };
  scores.resize(8 * count);  // [count, 8]: position t's score (then weight) for each of eight heads
  float* weights = scores.data();
  for (int64_t first = 0; first < G; first += 8) {
    const int64_t heads = std::min<int64_t>(8, G - first);
    alignas(32) float query[8][D];  // (lanes past the group's heads: zeros, never written out)
    for (int64_t h = 0; h < 8; ++h)
      for (int j = 0; j < D; ++j) query[h][j] = h < heads ? f32(q[(first + h) * D + j]) : 0.0f;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < count; ++t) {
      const T* k = keys + position(t) * D;
      __m256 acc[8];
      for (int h = 0; h < 8; ++h) acc[h] = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 8) {
        const __m256 key = load8(k + c);
        for (int h = 0; h < 8; ++h) acc[h] = _mm256_fmadd_ps(_mm256_load_ps(query[h] + c), key, acc[h]);
      }
      const __m256 score = _mm256_mul_ps(lane_sums(acc), _mm256_set1_ps(scaling));
      _mm256_storeu_ps(weights + 8 * t, score);
      top = _mm256_max_ps(top, score);
    }
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(weights + 8 * t), top));
      _mm256_storeu_ps(weights + 8 * t, e);
      total = _mm256_add_ps(total, e);
    }
    for (int64_t t = 0; t < count; ++t) _mm256_storeu_ps(weights + 8 * t, _mm256_div_ps(_mm256_loadu_ps(weights + 8 * t), total));
    for (int c = 0; c < D; c += 8) {
      __m256 acc[8];
      for (int h = 0; h < 8; ++h) acc[h] = _mm256_setzero_ps();
      for (int64_t t = 0; t < count; ++t) {
        const __m256 value = load8(values + position(t) * D + c);
        for (int h = 0; h < 8; ++h) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + 8 * t + h), value, acc[h]);
      }
      // (a bound known at compile time: with `heads` for one, GCC stored every accumulator at every
      // position besides keeping it in a register, which made this loop a third slower)
      for (int h = 0; h < 8; ++h)
        if (h < heads) store8(out + (first + h) * D + c, round8<T>(acc[h]));
    }
  }
}

// `attend_group` with the head size as its template argument, where only the attention's loops
// need it (they unroll over a head's 8-float vectors): the layer around it is compiled once per
// dtype, not once per dtype and head size (1.8 of the extension's 14.3 CPU-seconds of compiling on
// a Xeon core, which a user's first start pays).
template <typename T, typename... Args>
void attend_heads(int64_t head_dim, Args&&... args) {
  switch (head_dim) {
    case 16: return attend_group<T, 16>(std::forward<Args>(args)...);
    case 32: return attend_group<T, 32>(std::forward<Args>(args)...);
    case 64: return attend_group<T, 64>(std::forward<Args>(args)...);
    case 128: return attend_group<T, 128>(std::forward<Args>(args)...);
  }
  TORCH_CHECK(false, "head sizes 16, 32, 64 and 128 only, not ", head_dim);
}

// The quantized linear layers' packed weights (specchat/decode/runtime/quantized.py's QuantizedLinear).
struct Linear : torch::CustomClassHolder {
  at::Tensor low, high, scale, offset;
  c10::optional<at::Tensor> bias;
  int64_t N, bits;
  Linear(at::Tensor low, at::Tensor high, at::Tensor scale, at::Tensor offset, c10::optional<at::Tensor> bias,
         int64_t N, int64_t bits)
      : low(std::move(low)), high(std::move(high)), scale(std::move(scale)), offset(std::move(offset)),
        bias(std::move(bias)), N(N), bits(bits) {}
  at::Tensor operator()(const at::Tensor& x, const std::string& isa) const {
    return woq_linear(x, low, high, scale, offset, bias, N, bits, isa);
  }
};

// The attention's shape and what every layer shares.
struct Shape {
  int64_t heads, kv_heads, head_dim;
  double eps, scaling;
  std::string isa;
};

// Where a forward's time went, when asked (`specchat bench --profile`): the kernel's products and
// attention, in seconds; the rest of a forward is what its caller's clock adds.
struct Timings {
  double products = 0.0, attention = 0.0;
};

// Runs `work`, adding its wall time to `*total` when timing (a null total: not timing).
template <typename F>
auto timed(double* total, const F& work) {
  if (total == nullptr) return work();
  const auto start = std::chrono::steady_clock::now();
  auto result = work();
  *total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// One Llama-family decoder layer from its attention input on: the norms before it are the caller's
// (a target layer's input norm; a draft head's own prologue).
struct Layer : torch::CustomClassHolder {
  c10::intrusive_ptr<Linear> qkv, o, gate_up, down;  // q, k and v stacked; gate and up stacked
  at::Tensor post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3: each head's query and key normed before rotating

  Layer(c10::intrusive_ptr<Linear> qkv, c10::intrusive_ptr<Linear> o, c10::intrusive_ptr<Linear> gate_up,
        c10::intrusive_ptr<Linear> down, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
        c10::optional<at::Tensor> k_norm)
      : qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)),
        post_norm(std::move(post_norm)), q_norm(std::move(q_norm)), k_norm(std::move(k_norm)) {}

  // residual + o(attention(qkv(attention_input))), then + down(act(gate) * up) of its norm: [n, H].
  // New keys and values go to positions prefix + width - n .. prefix + width of keys/values [kv_heads, capacity, d].
  // With `outputs` < n, only the last `outputs` rows go on past their keys and values (a one-layer
  // draft head's context pass: the rows before its last are needed only as cache entries): [outputs, H].
  template <typename T>
  at::Tensor step(const Shape& shape, const at::Tensor& attention_input, const at::Tensor& residual,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                     const at::Tensor& values, const Span& span, Timings* timings, int64_t outputs = -1) const {
    double* products = timings ? &timings->products : nullptr;
    const int64_t n = attention_input.size(0), heads = shape.heads, kv_heads = shape.kv_heads, G = heads / kv_heads;
    const int64_t D = shape.head_dim;
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head sizes 16, 32, 64 and 128 only, not ", D);
    const int64_t skipped = outputs < 0 ? 0 : n - outputs;  // rows that stop at their keys and values
    TORCH_CHECK(skipped >= 0 && skipped < n, "outputs: 1 to the rows given");
    const int64_t width = (heads + 2 * kv_heads) * D, capacity = keys.size(1), first = span.prefix + span.width - n;
    TORCH_CHECK(first >= 0 && span.prefix + span.width <= capacity, "new entries beyond the cache's room");
    TORCH_CHECK(G <= 16 && heads % kv_heads == 0, "at most 16 query heads per KV head");
    at::Tensor projected = timed(products, [&] { return (*qkv)(attention_input, shape.isa); });  // [n, (h + 2 kv) * D]
    T* rows = projected.data_ptr<T>();
    const T* cos_ptr = cos.data_ptr<T>();
    const T* sin_ptr = sin.data_ptr<T>();
    T* key_ptr = keys.data_ptr<T>();
    T* value_ptr = values.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      T* row = rows + i * width;
      if (q_norm) {
        rms_norm(row, q_norm->data_ptr<T>(), row, heads, D, shape.eps);
        rms_norm(row + heads * D, k_norm->data_ptr<T>(), row + heads * D, kv_heads, D, shape.eps);
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * D, cos_ptr + i * D, sin_ptr + i * D, D);
      for (int64_t g = 0; g < kv_heads; ++g) {
        std::copy_n(row + (heads + g) * D, D, key_ptr + (g * capacity + first + i) * D);
        std::copy_n(row + (heads + kv_heads + g) * D, D, value_ptr + (g * capacity + first + i) * D);
      }
    }
    const int64_t kept = n - skipped;  // the rows that go on: skipped .. n
    at::Tensor attended = at::empty({kept, heads * D}, attention_input.options());
    T* attended_ptr = attended.data_ptr<T>();
    const auto attend_all = [&] {
      // Tasks take rows from both ends in turn: a causal row's cost grows with its place, and each
      // thread's run of tasks then holds as many late rows as early ones (in order, a causal forward's
      // second half of rows reads three times the keys of its first, and parallel_for gives each
      // thread one run).
      at::parallel_for(0, kept * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> marked;
        std::vector<float> scores;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t turn = task / kv_heads, g = task % kv_heads;
          const int64_t r = turn % 2 ? kept - 1 - turn / 2 : turn / 2, i = skipped + r;
          attend_heads<T>(D, rows + i * width + g * G * D, G, key_ptr + g * capacity * D,
                          value_ptr + g * capacity * D, span, i, n, shape.scaling,
                          attended_ptr + (r * heads + g * G) * D, marked, scores);
        }
      });
      return 0;
    };
    timed(timings ? &timings->attention : nullptr, attend_all);
    at::Tensor h = timed(products, [&] { return (*o)(attended, shape.isa); });
    add_into<T>(h, skipped ? residual.narrow(0, skipped, kept).contiguous() : residual);
    const int64_t hidden = h.size(1);
    at::Tensor normed = at::empty_like(h);
    rms_norm(h.data_ptr<T>(), post_norm.data_ptr<T>(), normed.data_ptr<T>(), kept, hidden, shape.eps);
    at::Tensor gated = timed(products, [&] { return (*gate_up)(normed, shape.isa); });  // [kept, 2I]: gate, then up
    const int64_t inner = gated.size(1) / 2;
    at::Tensor act = at::empty({kept, inner}, h.options());
    const T* gate_ptr = gated.data_ptr<T>();
    T* act_ptr = act.data_ptr<T>();
    for_rows(kept, inner, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) silu_times(gate_ptr + i * 2 * inner, act_ptr + i * inner, inner);
    });
    at::Tensor out = timed(products, [&] { return (*down)(act, shape.isa); });
    add_into<T>(out, h);
    return out;
  }

  // y += x, rounded to T (a residual sum).
  template <typename T>
  static void add_into(at::Tensor& y, const at::Tensor& x) {
    T* out = y.data_ptr<T>();
    const T* in = x.data_ptr<T>();
    const int64_t size = y.numel();
    int64_t k = 0;
    for (; k + 8 <= size; k += 8) store8(out + k, round8<T>(_mm256_add_ps(load8(out + k), load8(in + k))));
    for (; k < size; ++k) out[k] = narrow<T>(f32(out[k]) + f32(in[k]));
  }

  // act = T(silu(gate)) * up, rounded to T; the gate's and up's halves of one row of `gated`.
  template <typename T>
  static void silu_times(const T* gated, T* act, int64_t inner) {
    int64_t c = 0;
    for (; c + 8 <= inner; c += 8) {
      const __m256 x = load8(gated + c);
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      store8(act + c, round8<T>(_mm256_mul_ps(round8<T>(silu), load8(gated + inner + c))));
    }
    for (; c < inner; ++c) {
      const float x = f32(gated[c]);
      act[c] = narrow<T>(f32(narrow<T>(x / (1.0f + exp1(-x)))) * f32(gated[inner + c]));
    }
  }
};

// The activations' dtype as a template argument.
template <typename F>
auto dispatch(const at::Tensor& x, const F& body) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "activations: float32 or bf16");
  if (x.scalar_type() == at::kFloat) return body(float{});
  return body(c10::BFloat16{});
}

Span span_of(int64_t prefix, int64_t width, const c10::optional<at::Tensor>& block, int64_t n) {
  if (block) {
    TORCH_CHECK(block->scalar_type() == at::kBool && block->is_contiguous() && block->dim() == 2 &&
                block->size(0) == n && block->size(1) == width, "block: contiguous bool [n, width]");
  }
  TORCH_CHECK(width >= n, "the span's new part holds the forward's rows");
  return Span{prefix, width, block ? block->data_ptr<bool>() : nullptr};
}

// A whole decoder: the layers with their input norms, and the final norm.
struct Decoder : torch::CustomClassHolder {
  Shape shape;
  std::vector<c10::intrusive_ptr<Layer>> layers;
  std::vector<at::Tensor> input_norms;
  at::Tensor final_norm;
  bool profiling = false;  // time the products and attention of each forward (`take_timings`)
  Timings timings;

  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
          std::vector<c10::intrusive_ptr<Layer>> layers, std::vector<at::Tensor> input_norms, at::Tensor final_norm)
      : shape{heads, kv_heads, head_dim, eps, scaling, std::move(isa)}, layers(std::move(layers)),
        input_norms(std::move(input_norms)), final_norm(std::move(final_norm)) {}

  // The products' and attention's seconds since the last call.
  std::tuple<double, double> take_timings() {
    const Timings taken = timings;
    timings = Timings{};
    return {taken.products, taken.attention};
  }

  // x [n, H] (the embedded tokens) at the positions cos/sin [n, d] give, on top of the cache keys/values
  // [layers, kv_heads, capacity, d], whose first `prefix` positions every row sees; the new rows'
  // entries go to prefix .. prefix + n, and `block` [n, n] (None: causal) says which of them each row
  // sees. Returns the final normed state and the hidden states `features` names (i: layer i's input;
  // the number of layers: the final normed state).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                                          const at::Tensor& keys, const at::Tensor& values,
                                                          int64_t prefix, const c10::optional<at::Tensor>& block,
                                                          const std::vector<int64_t>& features) {
    const int64_t n = x.size(0), count = static_cast<int64_t>(layers.size());
    TORCH_CHECK(x.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == n, "x [n, H], cos and sin [n, d]");
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == count && keys.scalar_type() == x.scalar_type(),
                "keys, values: [layers, kv_heads, capacity, d] in x's dtype");
    const Span span = span_of(prefix, n, block, n);
    x = x.contiguous();
    std::vector<at::Tensor> hidden(count + 1);
    dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      const at::Tensor cosines = cos.contiguous(), sines = sin.contiguous();
      at::Tensor normed = at::empty_like(x);
      for (int64_t l = 0; l < count; ++l) {
        hidden[l] = x;  // (each step returns a new tensor: this one stays layer l's input)
        rms_norm(x.data_ptr<T>(), input_norms[l].data_ptr<T>(), normed.data_ptr<T>(), n, x.size(1), shape.eps);
        x = layers[l]->step<T>(shape, normed, x, cosines, sines, keys[l], values[l], span,
                               profiling ? &timings : nullptr);
      }
      hidden[count] = at::empty_like(x);
      rms_norm(x.data_ptr<T>(), final_norm.data_ptr<T>(), hidden[count].data_ptr<T>(), n, x.size(1), shape.eps);
      return 0;
    });
    std::vector<at::Tensor> taken;
    for (const int64_t index : features) taken.push_back(hidden.at(index));
    return {hidden[count], taken};
  }
};

// One layer on its own, from its attention input on (a draft head's layer: its prologue is the head's).
struct Block : torch::CustomClassHolder {
  Shape shape;
  c10::intrusive_ptr<Layer> layer;

  Block(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
        c10::intrusive_ptr<Layer> layer)
      : shape{heads, kv_heads, head_dim, eps, scaling, std::move(isa)}, layer(std::move(layer)) {}

  // attention_input [m, A] and residual [m, H] at the positions cos/sin [m, d] give; the new keys and
  // values go to keys/values [kv_heads, capacity, d] at prefix + width - m.., and row i sees [0, prefix)
  // and the positions of [prefix, prefix + width) that block [m, width] marks (None: causally).
  at::Tensor forward(const at::Tensor& attention_input, const at::Tensor& residual, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values, int64_t prefix,
                     int64_t width, const c10::optional<at::Tensor>& block) {
    const int64_t m = attention_input.size(0);
    TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() &&
                keys.scalar_type() == attention_input.scalar_type(), "keys, values: [kv_heads, capacity, d]");
    const Span span = span_of(prefix, width, block, m);
    return dispatch(attention_input, [&](auto zero) {
      using T = decltype(zero);
      return layer->step<T>(shape, attention_input.contiguous(), residual.contiguous(), cos.contiguous(),
                            sin.contiguous(), keys, values, span, nullptr);
    });
  }
};

// An EAGLE-3 head's draft step in one call, and its best next tokens in another
// (specchat/decode/runtime/cpu_decoder.py's FusedEagle3Step). In torch calls a step was ~25 of them
// around the layer (fc, the two norms and their concatenation, the rotary angles; the final norm,
// the draft LM head, the log-softmax, the top-k): ~0.5 ms of a 1.4 ms step on 2 Zen 3 cores, where
// the weights are ~10 MB. What it computes only drafts (every draft is verified), so it follows the
// torch code's arithmetic without its every rounding: the angles' cosines and the log-softmax's sum
// may differ from torch's in the last bits.
struct Eagle3Step : torch::CustomClassHolder {
  Shape shape;
  c10::intrusive_ptr<Linear> fc;  // [3 H_target] target features -> [H]
  c10::intrusive_ptr<Layer> layer;
  at::Tensor input_norm, hidden_norm;  // the embedding's and the hidden state's
  bool norm_before_residual;  // the residual is the normed hidden state (else the hidden state)
  at::Tensor final_norm;
  c10::intrusive_ptr<Linear> lm_head;  // [H] -> draft vocabulary
  at::Tensor inv_freq;  // [d / 2] float32: the rotary frequencies (with the head's scaling)
  at::Tensor embedding;  // [target vocabulary, H]: the head's token embeddings (the target's, shared)

  Eagle3Step(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
             c10::intrusive_ptr<Linear> fc, c10::intrusive_ptr<Layer> layer, at::Tensor input_norm,
             at::Tensor hidden_norm, bool norm_before_residual, at::Tensor final_norm,
             c10::intrusive_ptr<Linear> lm_head, at::Tensor inv_freq, at::Tensor embedding)
      : shape{heads, kv_heads, head_dim, eps, scaling, std::move(isa)}, fc(std::move(fc)), layer(std::move(layer)),
        input_norm(std::move(input_norm)), hidden_norm(std::move(hidden_norm)),
        norm_before_residual(norm_before_residual), final_norm(std::move(final_norm)), lm_head(std::move(lm_head)),
        inv_freq(std::move(inv_freq)), embedding(std::move(embedding)) {}

  // A draft level in one call: the next tokens' embeddings [m] -> [m, H], `step` and `top` (each a
  // call from Python cost a dispatch and, right after the target's forward, a cold start of the
  // thread pool). Returns the outputs [outputs, H] and their k best draft ids and log-probabilities.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> draft(const at::Tensor& hidden, const at::Tensor& tokens,
                                                       const at::Tensor& positions, const at::Tensor& keys,
                                                       const at::Tensor& values, int64_t prefix, int64_t width,
                                                       const c10::optional<at::Tensor>& block, int64_t outputs,
                                                       int64_t k) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "tokens: [m] int64");
    const at::Tensor embedded = embedding.index_select(0, tokens).to(hidden.scalar_type());
    const at::Tensor out = step(hidden, embedded, positions, keys, values, prefix, width, block, outputs);
    auto [logps, ids] = top(out, k);
    return {out, logps, ids};
  }

  // hidden [m, 3 H_target] (target features: fc first) or [m, H] (the head's outputs of the step
  // before), embedded [m, H] (the next tokens' embeddings), at positions [m]; keys and values as
  // `Block::forward` takes them. Every row's entries go to the cache; returns the head's outputs of
  // the last `outputs` rows [outputs, H] (a context pass needs only its last row's).
  at::Tensor step(const at::Tensor& hidden, const at::Tensor& embedded, const at::Tensor& positions,
                  const at::Tensor& keys, const at::Tensor& values, int64_t prefix, int64_t width,
                  const c10::optional<at::Tensor>& block, int64_t outputs) {
    const int64_t m = hidden.size(0), H = input_norm.size(0), D = shape.head_dim;
    TORCH_CHECK(embedded.dim() == 2 && embedded.size(0) == m && embedded.size(1) == H &&
                embedded.scalar_type() == hidden.scalar_type(), "embedded: [m, H] in hidden's dtype");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == m && positions.scalar_type() == at::kLong,
                "positions: [m] int64");
    TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() &&
                keys.scalar_type() == hidden.scalar_type(), "keys, values: [kv_heads, capacity, d]");
    const at::Tensor h = hidden.size(1) == H ? hidden.contiguous() : (*fc)(hidden.contiguous(), shape.isa);
    const Span span = span_of(prefix, width, block, m);
    return dispatch(h, [&](auto zero) {
      using T = decltype(zero);
      const at::Tensor tokens = embedded.contiguous();
      at::Tensor x = at::empty({m, 2 * H}, h.options()), normed = at::empty_like(h);
      rms_norm(h.data_ptr<T>(), hidden_norm.data_ptr<T>(), normed.data_ptr<T>(), m, H, shape.eps);
      T* rows = x.data_ptr<T>();
      for (int64_t r = 0; r < m; ++r) {  // x = cat(input_norm(embedded), hidden_norm(hidden))
        rms_norm(tokens.data_ptr<T>() + r * H, input_norm.data_ptr<T>(), rows + r * 2 * H, 1, H, shape.eps);
        std::copy_n(normed.data_ptr<T>() + r * H, H, rows + r * 2 * H + H);
      }
      at::Tensor cos = at::empty({m, D}, h.options()), sin = at::empty({m, D}, h.options());
      const float* frequency = inv_freq.data_ptr<float>();
      const int64_t* position = positions.data_ptr<int64_t>();
      T* cosines = cos.data_ptr<T>();
      T* sines = sin.data_ptr<T>();
      for (int64_t r = 0; r < m; ++r) {  // Llama's layout: each half of the head holds the same angles
        for (int64_t j = 0; j < D / 2; ++j) {
          const float angle = static_cast<float>(position[r]) * frequency[j];
          cosines[r * D + j] = cosines[r * D + j + D / 2] = narrow<T>(std::cos(angle));
          sines[r * D + j] = sines[r * D + j + D / 2] = narrow<T>(std::sin(angle));
        }
      }
      return layer->step<T>(shape, x, norm_before_residual ? normed : h, cos, sin, keys, values, span, nullptr,
                            outputs);
    });
  }

  // The k likeliest next tokens after each output [r, H], best first (ties: the lower id first), as
  // draft-vocabulary ids [r, k] with their log-probabilities [r, k] (float32).
  std::tuple<at::Tensor, at::Tensor> top(const at::Tensor& outputs, int64_t k) {
    TORCH_CHECK(outputs.dim() == 2 && outputs.size(1) == final_norm.size(0), "outputs: [r, H]");
    const int64_t r = outputs.size(0), H = outputs.size(1);
    const at::Tensor x = outputs.contiguous();
    at::Tensor normed = at::empty_like(x);
    at::Tensor logits = dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      rms_norm(x.data_ptr<T>(), final_norm.data_ptr<T>(), normed.data_ptr<T>(), r, H, shape.eps);
      return (*lm_head)(normed, shape.isa).to(at::kFloat).contiguous();
    });
    const int64_t V = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= V, "k: 1 to the draft vocabulary's size");
    at::Tensor logps = at::empty({r, k}, x.options().dtype(at::kFloat));
    at::Tensor ids = at::empty({r, k}, x.options().dtype(at::kLong));
    for (int64_t i = 0; i < r; ++i) {
      const float* row = logits.data_ptr<float>() + i * V;
      float* best = logps.data_ptr<float>() + i * k;
      int64_t* best_id = ids.data_ptr<int64_t>() + i * k;
      for (int64_t j = 0; j < k; ++j) best[j] = -INFINITY, best_id[j] = j;
      float largest = -INFINITY;
      for (int64_t t = 0; t < V; ++t) {
        const float v = row[t];
        largest = std::fmax(largest, v);
        if (!(v > best[k - 1])) continue;  // (NaN too)
        int64_t j = k - 1;
        for (; j > 0 && best[j - 1] < v; --j) best[j] = best[j - 1], best_id[j] = best_id[j - 1];
        best[j] = v, best_id[j] = t;
      }
      __m256 sums = _mm256_setzero_ps();
      const __m256 top8 = _mm256_set1_ps(largest);
      int64_t t = 0;
      for (; t + 8 <= V; t += 8) sums = _mm256_add_ps(sums, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), top8)));
      float lanes[8], total = 0.0f;
      _mm256_storeu_ps(lanes, sums);
      for (const float lane : lanes) total += lane;
      for (; t < V; ++t) total += exp1(row[t] - largest);
      const float normalizer = largest + std::log(total);
      for (int64_t j = 0; j < k; ++j) best[j] -= normalizer;
    }
    return {logps, ids};
  }
};

// The greedy choice after each row of logits [n, V] (bf16 or float32) and how near a tie it was:
// the first index of the row's maximum, as torch's argmax gives it (a NaN counts as the maximum),
// and the maximum less the largest value elsewhere in the row, in float32 (0 at a tie, NaN where
// the row holds a NaN), as `specchat.decode.acceptance.sampling.margins` gives it. Two passes over
// each row where torch takes a float32 copy, an argmax and a top-2 (~1 ms a cycle for a tree's rows
// over a 152k vocabulary on 2 cores): the maximum, then where it first is, how often, and the largest
// value below it. Each pass keeps several running maxima, since one would wait on the last max's
// latency at every vector; the first place of the maximum is found by the second pass's compares (a
// scalar search for it took as long as both passes: 93 us a row, 302 us for four rows on 2 Xeon cores).
template <typename T>
void choose_row(const T* row, int64_t size, int64_t* choice, float* margin) {
  constexpr int lanes = 8, ways = 4;
  const __m256 none = _mm256_set1_ps(-INFINITY);
  __m256 top[ways] = {none, none, none, none}, unordered = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + ways * lanes <= size; k += ways * lanes) {
    for (int w = 0; w < ways; ++w) {
      const __m256 v = load8(row + k + w * lanes);
      top[w] = _mm256_max_ps(top[w], v);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  for (; k + lanes <= size; k += lanes) {
    const __m256 v = load8(row + k);
    top[0] = _mm256_max_ps(top[0], v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float values[lanes], best = -INFINITY;
  for (int w = 0; w < ways; ++w) {
    _mm256_storeu_ps(values, top[w]);
    for (const float value : values) best = std::fmax(best, value);
  }
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t t = k; t < size; ++t) nan |= std::isnan(f32(row[t])), best = std::fmax(best, f32(row[t]));
  if (nan) {  // torch's argmax: the first NaN
    int64_t first = 0;
    while (!std::isnan(f32(row[first]))) ++first;
    *choice = first, *margin = NAN;
    return;
  }
  // The largest value elsewhere: the maximum again where it occurs twice, else the largest below it.
  const __m256 maximum = _mm256_set1_ps(best);
  __m256 second[2] = {none, none};
  int64_t first = -1, ties = 0;
  const auto compare = [&](const __m256 v, int64_t at, __m256& below) {
    const __m256 equal = _mm256_cmp_ps(v, maximum, _CMP_EQ_OQ);
    const int found = _mm256_movemask_ps(equal);
    if (found) {  // (rarely: where the maximum is)
      if (first < 0) first = at + __builtin_ctz(found);
      ties += __builtin_popcount(found);
    }
    below = _mm256_max_ps(below, _mm256_blendv_ps(v, none, equal));
  };
  for (k = 0; k + 2 * lanes <= size; k += 2 * lanes) {
    compare(load8(row + k), k, second[0]);
    compare(load8(row + k + lanes), k + lanes, second[1]);
  }
  for (; k + lanes <= size; k += lanes) compare(load8(row + k), k, second[0]);
  float below = -INFINITY;
  for (const __m256 part : second) {
    _mm256_storeu_ps(values, part);
    for (const float value : values) below = std::fmax(below, value);
  }
  for (; k < size; ++k) {
    const float v = f32(row[k]);
    if (v == best) {
      if (first < 0) first = k;
      ++ties;
    } else {
      below = std::fmax(below, v);
    }
  }
  *choice = first;
  *margin = best - (ties > 1 ? best : below);  // (as torch's top-2: NaN where the maximum is infinite)
}

std::tuple<at::Tensor, at::Tensor> choose(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits: contiguous [n, V] float32 or bf16");
  const int64_t n = logits.size(0), size = logits.size(1);
  at::Tensor choices = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor margins = at::empty({n}, logits.options().dtype(at::kFloat));
  int64_t* choice = choices.data_ptr<int64_t>();
  float* margin = margins.data_ptr<float>();
  const auto rows = [&](const auto* first) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) choose_row(first + r * size, size, choice + r, margin + r);
    });
  };
  if (logits.scalar_type() == at::kFloat) rows(logits.data_ptr<float>());
  else rows(logits.data_ptr<c10::BFloat16>());
  return {choices, margins};
}

}  // namespace

// The classes as torch.classes.specchat.* (specchat/decode/runtime/cpu_decoder.py builds them from a model's layers).
TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.class_<Linear>("Linear").def(
      torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t>());
  m.class_<Layer>("Layer").def(
      torch::init<c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>,
                  c10::intrusive_ptr<Linear>, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>>());
  m.class_<Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, std::vector<c10::intrusive_ptr<Layer>>,
                       std::vector<at::Tensor>, at::Tensor>())
      .def("forward", &Decoder::forward)
      .def("set_profiling", [](const c10::intrusive_ptr<Decoder>& self, bool on) { self->profiling = on; })
      .def("take_timings", &Decoder::take_timings);
  m.def("choose(Tensor logits) -> (Tensor, Tensor)");
  m.impl("choose", c10::DispatchKey::CPU, &choose);
  m.class_<Block>("Block")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, c10::intrusive_ptr<Layer>>())
      .def("forward", &Block::forward);
  m.class_<Eagle3Step>("Eagle3Step")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, c10::intrusive_ptr<Linear>,
                       c10::intrusive_ptr<Layer>, at::Tensor, at::Tensor, bool, at::Tensor, c10::intrusive_ptr<Linear>,
                       at::Tensor, at::Tensor>())
      .def("step", &Eagle3Step::step)
      .def("top", &Eagle3Step::top)
      .def("draft", &Eagle3Step::draft);
}

}  // namespace specchat
