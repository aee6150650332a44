// The vector loads and stores the extension's files share (AVX2, as the whole extension outside its
// per-path sections).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace specchat {

// Eight values as a float32 vector, from float32 or bf16 (widened exactly: bf16 is float32's top half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Four vectors of int32 in -128..127 stored as their 32 bytes, in order: a group of 32 quantized values
// (x's int8 in woq_linear.cpp, the weights' codes in quantize.cpp). The packs interleave 128-bit lanes,
// so their 32-bit pieces come out 0, 4, 1, 5, 2, 6, 3, 7 and are put back in order.
inline void store_bytes32(const __m256i (&values)[4], void* out) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(values[0], values[1]),
                                           _mm256_packs_epi32(values[2], values[3]));
  _mm256_storeu_si256(static_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

}  // namespace specchat
