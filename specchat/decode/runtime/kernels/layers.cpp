// The arithmetic between a decoder layer's products (extension.cpp calls it, one call per forward:
// specchat/decode/runtime/cpu_decoder.py).
//
// A decoding step of a small model on a CPU spends as long between its products as in them: a
// Llama-family layer written as torch calls is ~40 of them (norms, rotary, the cache write,
// attention's steps, SwiGLU, residuals), each microseconds of dispatch, 24 layers a forward
// (2-core Zen 3, Qwen2.5-0.5B int5: ~0.5 ms per layer outside the products, about as much as the
// products of one token; docs/cpu-runtime.md). Here a whole forward is one call: each layer is
// its four products (woq_linear.cpp) and plain loops between them (this file).
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
// dtype. Head sizes 16, 32, 64 and 128 (`head_size_supported`; the Python side checks too).

#include "layers.h"

#include "vectors.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
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
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  return _mm256_blendv_ps(nearest, quiet_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
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
    for (int64_t t = 0; t < count; ++t)
      _mm256_storeu_ps(weights + 8 * t, _mm256_div_ps(_mm256_loadu_ps(weights + 8 * t), total));
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
  }  // (no other: the caller has checked head_size_supported)
}

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

// A draw from softmax(row / temperature) with the uniform u: the first index whose running sum of the
// weights exp((x - max) / temperature) passes u times their total, as `sample_rows` searches its
// cumsum (`right=True`). Three passes over the row (the maximum, the total, the search, which sums
// whole vectors until the one that passes), where torch took a float32 copy, the division, a softmax
// and a cumsum, each over all of a regeneration step's rows. A row with a NaN draws its argmax.
template <typename T>
int64_t sample_row(const T* row, int64_t size, float temperature, float u) {
  constexpr int lanes = 8;
  const int64_t whole = size / lanes * lanes;
  __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += lanes) {
    const __m256 v = load8(row + k);
    top = _mm256_max_ps(top, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float values[lanes], best = -INFINITY;
  _mm256_storeu_ps(values, top);
  for (const float value : values) best = std::fmax(best, value);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (int64_t k = whole; k < size; ++k) nan |= std::isnan(f32(row[k])), best = std::fmax(best, f32(row[k]));
  if (nan || std::isinf(best)) {  // (no finite weights to draw from: the greedy choice)
    int64_t choice = 0;
    float margin = 0.0f;
    choose_row(row, size, &choice, &margin);
    return choice;
  }
  const __m256 shift = _mm256_set1_ps(best), inverse = _mm256_set1_ps(1.0f / temperature);
  const auto weights = [&](int64_t k) { return exp8(_mm256_mul_ps(_mm256_sub_ps(load8(row + k), shift), inverse)); };
  const auto weight = [&](int64_t k) { return exp1((f32(row[k]) - best) / temperature); };
  const auto lane_total = [&](__m256 v) {
    _mm256_storeu_ps(values, v);
    float total = 0.0f;
    for (const float value : values) total += value;
    return total;
  };
  float total = 0.0f;
  for (int64_t k = 0; k < whole; k += lanes) total += lane_total(weights(k));
  for (int64_t k = whole; k < size; ++k) total += weight(k);
  // The same sums in the same order again, so that the search ends inside the row (u < 1). Where
  // rounding says otherwise (u * total rounded up to the total; a block's lanes added one by one
  // falling short of its sum), the draw is the last token of positive weight, the one u near 1 draws.
  const float target = u * total;
  float running = 0.0f;
  int64_t last = 0;
  for (int64_t k = 0; k < whole; k += lanes) {
    const __m256 w = weights(k);
    const float block = lane_total(w);  // (leaves the weights in `values`)
    if (running + block > target) {
      float inside = running;
      for (int j = 0; j < lanes; ++j)
        if ((inside += values[j]) > target) return k + j;
    }
    running += block;
    for (int j = 0; j < lanes; ++j)
      if (values[j] > 0.0f) last = k + j;
  }
  for (int64_t k = whole; k < size; ++k) {
    const float w = weight(k);
    if ((running += w) > target) return k;
    if (w > 0.0f) last = k;
  }
  return last;
}

}  // namespace

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

template <typename T>
void rotate_into_cache(T* rows, int64_t n, const Heads& shape, const T* q_norm, const T* k_norm, float eps,
                       const T* cos, const T* sin, const LayerCache<T>& cache, int64_t first) {
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, D = shape.head_dim;
  const int64_t width = (heads + 2 * kv_heads) * D;
  for (int64_t i = 0; i < n; ++i) {
    T* row = rows + i * width;
    if (q_norm) {
      rms_norm(row, q_norm, row, heads, D, eps);
      rms_norm(row + heads * D, k_norm, row + heads * D, kv_heads, D, eps);
    }
    for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * D, cos + i * D, sin + i * D, D);
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::copy_n(row + (heads + g) * D, D, cache.keys + (g * cache.capacity + first + i) * D);
      std::copy_n(row + (heads + kv_heads + g) * D, D, cache.values + (g * cache.capacity + first + i) * D);
    }
  }
}

template <typename T>
void attend(const T* rows, int64_t n, int64_t skipped, const Heads& shape, const LayerCache<T>& cache,
            const Span& span, float scaling, T* out) {
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, D = shape.head_dim, G = heads / kv_heads;
  const int64_t width = (heads + 2 * kv_heads) * D, kept = n - skipped;
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
      attend_heads<T>(D, rows + i * width + g * G * D, G, cache.keys + g * cache.capacity * D,
                      cache.values + g * cache.capacity * D, span, i, n, scaling, out + (r * heads + g * G) * D,
                      marked, scores);
    }
  });
}

template <typename T>
void add_into(T* y, const T* x, int64_t size) {
  int64_t k = 0;
  for (; k + 8 <= size; k += 8) store8(y + k, round8<T>(_mm256_add_ps(load8(y + k), load8(x + k))));
  for (; k < size; ++k) y[k] = narrow<T>(f32(y[k]) + f32(x[k]));
}

template <typename T>
void silu_times(const T* gated, T* act, int64_t rows, int64_t inner) {
  for_rows(rows, inner, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = gated + i * 2 * inner;
      T* out = act + i * inner;
      int64_t c = 0;
      for (; c + 8 <= inner; c += 8) {
        const __m256 x = load8(gate + c);
        const __m256 silu =
            _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        store8(out + c, round8<T>(_mm256_mul_ps(round8<T>(silu), load8(gate + inner + c))));
      }
      for (; c < inner; ++c) {
        const float x = f32(gate[c]);
        out[c] = narrow<T>(f32(narrow<T>(x / (1.0f + exp1(-x)))) * f32(gate[inner + c]));
      }
    }
  });
}

template <typename T>
void eagle3_input(const T* hidden, const T* embedded, const T* hidden_norm, const T* input_norm, int64_t m,
                  int64_t H, float eps, T* x, T* normed) {
  rms_norm(hidden, hidden_norm, normed, m, H, eps);
  for (int64_t r = 0; r < m; ++r) {
    rms_norm(embedded + r * H, input_norm, x + r * 2 * H, 1, H, eps);
    std::copy_n(normed + r * H, H, x + r * 2 * H + H);
  }
}

template <typename T>
void rotary_angles(const float* inv_freq, const int64_t* positions, int64_t m, int64_t d, T* cos, T* sin) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < d / 2; ++j) {
      const float angle = static_cast<float>(positions[r]) * inv_freq[j];
      cos[r * d + j] = cos[r * d + j + d / 2] = narrow<T>(std::cos(angle));
      sin[r * d + j] = sin[r * d + j + d / 2] = narrow<T>(std::sin(angle));
    }
  }
}

void top_k(const float* logits, int64_t r, int64_t V, int64_t k, float* logps, int64_t* ids) {
  for (int64_t i = 0; i < r; ++i) {
    const float* row = logits + i * V;
    float* best = logps + i * k;
    int64_t* best_id = ids + i * k;
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
}

template <typename T>
void choose(const T* logits, int64_t n, int64_t V, int64_t* choices, float* margins) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) choose_row(logits + r * V, V, choices + r, margins + r);
  });
}

template <typename T>
void sample(const T* logits, int64_t n, int64_t V, const float* temperatures, const float* uniforms,
            int64_t* tokens) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float margin = 0.0f;
      if (temperatures[r] > 0.0f)
        tokens[r] = sample_row(logits + r * V, V, temperatures[r], uniforms[r]);
      else
        choose_row(logits + r * V, V, tokens + r, &margin);
    }
  });
}

// Each for the two activation dtypes.
#define SPECCHAT_LAYERS_FOR(T)                                                                                        \
  template void rms_norm(const T*, const T*, T*, int64_t, int64_t, float);                                         \
  template void rotate_into_cache(T*, int64_t, const Heads&, const T*, const T*, float, const T*, const T*,          \
                                  const LayerCache<T>&, int64_t);                                                   \
  template void attend(const T*, int64_t, int64_t, const Heads&, const LayerCache<T>&, const Span&, float, T*);   \
  template void add_into(T*, const T*, int64_t);                                                                    \
  template void silu_times(const T*, T*, int64_t, int64_t);                                                         \
  template void eagle3_input(const T*, const T*, const T*, const T*, int64_t, int64_t, float, T*, T*);              \
  template void rotary_angles(const float*, const int64_t*, int64_t, int64_t, T*, T*);                              \
  template void choose(const T*, int64_t, int64_t, int64_t*, float*);                                           \
  template void sample(const T*, int64_t, int64_t, const float*, const float*, int64_t*);
SPECCHAT_LAYERS_FOR(float)
SPECCHAT_LAYERS_FOR(c10::BFloat16)
#undef SPECCHAT_LAYERS_FOR

}  // namespace specchat
