// Eight values as a float32 vector, from float32 or bf16 (widened exactly: bf16 is float32's top
// half): the load the products' quantization of x (woq_linear.cpp) and the layers (decoder.cpp) share.
// AVX2, as the whole extension outside its per-path sections.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace specchat {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

}  // namespace specchat
