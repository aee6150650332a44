// The weights quantized for the kernel (specchat/decode/runtime/quantized.py's `quantize` and `pack`):
// codes, scales and offsets per group of 32 weights along K, then the kernel's layout (woq_linear.cpp's
// top comment). A model is quantized once, at its first start, after the kernel's compile: in torch
// that took ~4.4 ns a weight on two Xeon vCPUs (two dozen elementwise passes a group), 8 s of the
// 1.5B's first start with the 0.5B that drafts for it, and moving the codes into the layout 2-3 more.
//
// Each group gets whichever of two grids reconstructs it better: llama.cpp's symmetric one
// (Q4_0/Q5_0: the largest magnitude maps to code 0, so weights that came from such a GGUF are
// reproduced exactly) or the asymmetric min-max grid (better for skewed groups). Every value is the
// float32 operation torch's elementwise version made (a subtraction, a division, rounding to nearest
// even, the clamp; each correctly rounded, so the same in any vector width); only the order in which
// a group's 32 squared errors are summed is this file's own, fixed (torch's depends on its vector
// width), so two grids within rounding of each other may be chosen the other way than torch would.

#include "vectors.h"
#include "woq_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specchat {
namespace {

struct Grid {
  float scale, offset;
};

// The group's codes on `grid` (its scale and offset as fp16 hold them) and their squared error.
inline float codes_on(const __m256 (&values)[4], Grid grid, float top, __m256 (&codes)[4]) {
  const __m256 step = _mm256_set1_ps(grid.scale), base = _mm256_set1_ps(grid.offset);
  __m256 errors[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 quotient = _mm256_div_ps(_mm256_sub_ps(values[j], base), step);
    const __m256 rounded = _mm256_round_ps(quotient, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    codes[j] = _mm256_min_ps(_mm256_max_ps(rounded, _mm256_setzero_ps()), _mm256_set1_ps(top));
    const __m256 error = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(codes[j], step), base), values[j]);
    errors[j] = _mm256_mul_ps(error, error);
  }
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(errors[0], errors[1]), _mm256_add_ps(errors[2], errors[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// A scale as fp16 holds it, a step of at least 1e-7 (a constant group still needs one), and an offset.
inline Grid grid(float scale, float offset) {
  if (std::fabs(scale) < 1e-7f) scale = 1e-7f;
  return {static_cast<float>(c10::Half(scale)), static_cast<float>(c10::Half(offset))};
}

// The smallest and largest of a vector's lanes (order does not matter: both are exact).
inline float lowest(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}
inline float highest(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

template <typename T>
void quantize_group(const T* weights, int64_t bits, uint8_t* codes, c10::Half* scale, c10::Half* offset) {
  __m256 values[4];
  for (int j = 0; j < 4; ++j) values[j] = load8(weights + 8 * j);
  const float low = lowest(_mm256_min_ps(_mm256_min_ps(values[0], values[1]), _mm256_min_ps(values[2], values[3])));
  const float high = highest(_mm256_max_ps(_mm256_max_ps(values[0], values[1]), _mm256_max_ps(values[2], values[3])));
  const float top = static_cast<float>((1 << bits) - 1), half = static_cast<float>(1 << (bits - 1));
  const float extreme = std::fabs(high) > std::fabs(low) ? high : low;  // the largest magnitude, signed
  const Grid asymmetric = grid((high - low) / top, low), symmetric = grid(-extreme / half, extreme);
  __m256 first[4], second[4];
  const float first_error = codes_on(values, asymmetric, top, first);
  const bool better = codes_on(values, symmetric, top, second) < first_error;
  const __m256(&chosen)[4] = better ? second : first;
  __m256i codes_as_integers[4];
  for (int j = 0; j < 4; ++j) codes_as_integers[j] = _mm256_cvtps_epi32(chosen[j]);
  store_bytes32(codes_as_integers, codes);
  const Grid kept = better ? symmetric : asymmetric;
  *scale = c10::Half(kept.scale);
  *offset = c10::Half(kept.offset);
}

}  // namespace

template <typename T>
void quantize(const T* weight, int64_t N, int64_t K, int bits, uint8_t* codes, c10::Half* scale, c10::Half* offset) {
  at::parallel_for(0, N * (K / kGroup), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      quantize_group(weight + g * kGroup, bits, codes + g * kGroup, scale + g, offset + g);
  });
}

template void quantize(const float*, int64_t, int64_t, int, uint8_t*, c10::Half*, c10::Half*);
template void quantize(const c10::BFloat16*, int64_t, int64_t, int, uint8_t*, c10::Half*, c10::Half*);

// The codes in the kernel's layout: low [N/16][K/8][64] (the low nibbles of quads 2p and 2p + 1),
// high [N/16][K/4][8] (5 bits: bit t of quad j's word is byte t's fifth bit; empty for 4), and the
// scales and offsets as [N/16][K/32][16]. Quad j of a block: byte 4r + b is row r, k = 4j + b.
void pack(const uint8_t* code, const c10::Half* s, const c10::Half* o, int64_t N, int64_t K, int bits,
          uint8_t* lows, uint8_t* highs, c10::Half* ss, c10::Half* os) {
  const int64_t blocks = N / kBlockRows, groups = K / kGroup;
  if (bits != 5) highs = nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(32) uint8_t quads[2][4 * kBlockRows];  // quads 2p and 2p + 1 of a block
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* rows = code + b * kBlockRows * K;
      for (int64_t p = 0; p < K / 8; ++p) {
        for (int h = 0; h < 2; ++h) {
          const int64_t j = 2 * p + h;
          for (int64_t r = 0; r < kBlockRows; ++r) std::memcpy(quads[h] + 4 * r, rows + r * K + 4 * j, 4);
          if (highs != nullptr) {  // bit 4 of each byte to bit 7 (16-bit shifts carry nothing into it), gathered
            const __m256i first = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[h]));
            const __m256i second = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[h] + 32));
            const uint32_t lower = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(first, 3)));
            const uint32_t upper = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(second, 3)));
            const uint64_t word = lower | static_cast<uint64_t>(upper) << 32;
            std::memcpy(highs + (b * (K / 4) + j) * 8, &word, 8);
          }
        }
        uint8_t* out = lows + (b * (K / 8) + p) * 4 * kBlockRows;
        for (int half = 0; half < 2; ++half) {
          const __m256i even = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[0] + 32 * half));
          const __m256i odd = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[1] + 32 * half));
          const __m256i both = _mm256_or_si256(_mm256_and_si256(even, nibble),
                                               _mm256_slli_epi16(_mm256_and_si256(odd, nibble), 4));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * half), both);
        }
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t r = 0; r < kBlockRows; ++r) {
          ss[(b * groups + g) * kBlockRows + r] = s[(b * kBlockRows + r) * groups + g];
          os[(b * groups + g) * kBlockRows + r] = o[(b * kBlockRows + r) * groups + g];
        }
    }
  });
}

}  // namespace specchat
