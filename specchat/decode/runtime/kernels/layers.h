// The arithmetic between the products of a decoder layer (layers.cpp), as the extension's torch face
// (extension.cpp: the layers, decoders and draft heads as torch classes) calls it: plain pointers and
// sizes, no ATen or torch headers (woq_linear.h says why). Each function takes the activations' dtype
// T, float or c10::BFloat16; the caller has checked the shapes.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace specchat {

constexpr bool head_size_supported(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128; }

// transformers' RMSNorm of `rows` rows of `size`: x * rsqrt(mean(x^2) + eps) rounded to T, times the weight.
template <typename T>
void rms_norm(const T* x, const T* weight, T* y, int64_t rows, int64_t size, float eps);

// The attention's shape.
struct Heads {
  int64_t heads, kv_heads, head_dim;
};

// The positions a forward's rows attend: all of [0, prefix), and of [prefix, prefix + width) those
// the row's block marks; no block: causally, the forward's n rows being the last n of that width.
struct Span {
  int64_t prefix, width;
  const bool* block;  // [n, width] or nullptr
};

// A cache of one layer: keys and values [kv_heads, capacity, head_dim].
template <typename T>
struct LayerCache {
  T* keys;
  T* values;
  int64_t capacity;
};

// The n projected rows [n, (heads + 2 kv_heads) * d] (q, k, v) made ready in place: each head's q and
// k normed where the layer has those norms (Qwen3; null: none), rotated by cos/sin [n, d]; their keys
// and values copied into the cache at positions first .. first + n.
template <typename T>
void rotate_into_cache(T* rows, int64_t n, const Heads& shape, const T* q_norm, const T* k_norm, float eps,
                       const T* cos, const T* sin, const LayerCache<T>& cache, int64_t first);

// Attention of rows skipped .. n of the n projected rows over the positions each may see (`span`),
// written to out [n - skipped, heads * d].
template <typename T>
void attend(const T* rows, int64_t n, int64_t skipped, const Heads& shape, const LayerCache<T>& cache,
            const Span& span, float scaling, T* out);

// y += x (size values), rounded to T: a residual sum.
template <typename T>
void add_into(T* y, const T* x, int64_t size);

// act [rows, inner] = T(silu(gate)) * up, rounded to T, for gated [rows, 2 inner] (the gate, then up).
template <typename T>
void silu_times(const T* gated, T* act, int64_t rows, int64_t inner);

// An EAGLE-3 head's layer input for m rows: x [m, 2H] = cat(input_norm(embedded), hidden_norm(hidden)),
// and hidden_norm(hidden) alone in normed [m, H].
template <typename T>
void eagle3_input(const T* hidden, const T* embedded, const T* hidden_norm, const T* input_norm, int64_t m,
                  int64_t H, float eps, T* x, T* normed);

// Llama's rotary angles for m positions: cos and sin [m, d], each half of the head with the same angles.
template <typename T>
void rotary_angles(const float* inv_freq, const int64_t* positions, int64_t m, int64_t d, T* cos, T* sin);

// The k likeliest of each row of logits [r, V] (float32), best first (ties: the lower index first), as
// their indices [r, k] and log-probabilities [r, k].
void top_k(const float* logits, int64_t r, int64_t V, int64_t k, float* logps, int64_t* ids);

// The greedy choice after each row of logits [n, V] and how near a tie it was (layers.cpp says how).
template <typename T>
void choose(const T* logits, int64_t n, int64_t V, int64_t* choices, float* margins);

// The token each row of logits [n, V] draws at its temperature (0: the argmax, as `choose`; else from
// softmax(logits / temperature) with the row's uniform in [0, 1)); layers.cpp says how.
template <typename T>
void sample(const T* logits, int64_t n, int64_t V, const float* temperatures, const float* uniforms,
            int64_t* tokens);

}  // namespace specchat
