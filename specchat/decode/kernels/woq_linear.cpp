// Weight-only quantized linear layers for CPUs with AVX512-VNNI: y = x @ dequant(W).T for a few
// rows of x (one decode token, or the few dozen tokens of a draft tree being verified).
//
// Why not the kernels torch already has: aten._weight_int4pack_mm_for_cpu and _weight_int8pack_mm
// dequantize the weights again for every row of x and multiply in fp32, so verifying 8 tokens
// costs 2-3x one token; bf16 GEMMs are flat in the row count but read 2 bytes per weight. Here each
// block of 16 output rows is unpacked once into bytes in registers and every row of x is
// multiplied against it: the weights cross the memory bus once, at 4-5 bits each, whatever the
// row count.
//
// The products are 8-bit integer dot products (vpdpbusd: 64 multiply-adds per instruction, twice
// vdpbf16ps's), as llama.cpp multiplies its Q5_0 weights: each row of x is quantized per group of
// 32 to int8 with a float scale (symmetric, the group's largest magnitude -> 127). With
// w = code * scale + offset per group of 32 weights and x = q * s,
//     x . w = scale * s * (q . code) + offset * s * sum(q),
// so the kernel sums q . code exactly in int32 and applies the scales once per group. The integer
// sums do not depend on how many rows are multiplied together, and the float part is the same
// sequence for every row, so a row's result is bit-identical whether it is verified alone or in a
// tree of 16 (speculation compares like with like).
//
// Layout (made by specchat/quantized.py): codes are unsigned (0-31 or 0-15); output rows come in
// blocks of 16. "Quad" j of a block holds the codes of k = 4j .. 4j+3 for its 16 rows in vpdpbusd
// order: byte 4r + b is row r, k = 4j + b.
//   low[NB][K/8][64] bytes: the low nibbles of quads 2p (bits 0-3) and 2p + 1 (bits 4-7);
//   high[NB][K/4][8] bytes (5-bit codes only): bit t of quad j's 64-bit word = byte t's fifth bit;
//   scale, offset: [NB][K/32][16] fp16;
//   bias (optional): [N] float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kGroup = 32;               // weights per quantization group along K
constexpr int kPairsPerGroup = kGroup / 8;  // 64-byte nibble vectors (two quads each) per group
// The codes are read this many 64-byte vectors (4 KB) ahead: the hardware prefetcher alone left a
// forward at ~27 GB/s; with this, one token's linear layers take 10 ms instead of 12 and eight
// tokens' 15 instead of 19 (2-core Zen 4; 2, 4 and 8 KB ahead measured within 4% of each other).
constexpr int64_t kPrefetchAhead = 64;

// Each row of x as int8 per group of 32: q, its scale s, and s * sum(q).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

QuantizedRows quantize_rows(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedRows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  for (int64_t i = 0; i < M * groups; ++i) {
    const at::BFloat16* group = x + i * kGroup;
    float largest = 0.0f;
    for (int k = 0; k < kGroup; ++k) largest = std::fmax(largest, std::fabs(static_cast<float>(group[k])));
    const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    int32_t total = 0;
    for (int k = 0; k < kGroup; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyintf(static_cast<float>(group[k]) * inverse));
      rows.q[i * kGroup + k] = static_cast<int8_t>(q);
      total += q;
    }
    rows.scale[i] = scale;
    rows.sum[i] = scale * static_cast<float>(total);
  }
  return rows;
}

// y[r] = sum over groups of scale * s[r] * (q[r] . codes) + offset * s[r] * sum(q[r]), for ROWS rows.
template <int BITS, int ROWS>
void multiply_block(const uint8_t* low, const uint8_t* high, const int8_t* q, const float* q_scale,
                    const float* q_sum, int64_t K, const at::Half* scale, const at::Half* offset, float* y) {
  constexpr int SPLIT = ROWS <= 3 ? 2 : 1;  // independent chains to hide vpdpbusd's latency with few rows
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[ROWS][SPLIT];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < SPLIT; ++s) dots[r][s] = _mm512_setzero_si512();
    for (int64_t pair = g * kPairsPerGroup; pair < (g + 1) * kPairsPerGroup; ++pair) {
      _mm_prefetch(reinterpret_cast<const char*>(low + (pair + kPrefetchAhead) * 64), _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(low + pair * 64);
      __m512i first = _mm512_and_si512(packed, nibble);                         // quad 2 * pair
      __m512i second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);  // quad 2 * pair + 1
      if constexpr (BITS == 5) {
        __mmask64 first_high, second_high;
        std::memcpy(&first_high, high + pair * 16, 8);
        std::memcpy(&second_high, high + pair * 16 + 8, 8);
        first = _mm512_mask_add_epi8(first, first_high, first, sixteen);
        second = _mm512_mask_add_epi8(second, second_high, second, sixteen);
      }
      for (int r = 0; r < ROWS; ++r) {
        const auto* row = reinterpret_cast<const int32_t*>(q + r * K);  // four int8 of x per int32
        dots[r][0] = _mm512_dpbusd_epi32(dots[r][0], first, _mm512_set1_epi32(row[2 * pair]));
        dots[r][SPLIT - 1] = _mm512_dpbusd_epi32(dots[r][SPLIT - 1], second, _mm512_set1_epi32(row[2 * pair + 1]));
      }
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * 16)));
    const __m512 of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + g * 16)));
    for (int r = 0; r < ROWS; ++r) {
      __m512i dot = dots[r][0];
      if constexpr (SPLIT == 2) dot = _mm512_add_epi32(dot, dots[r][1]);
      const __m512 step = _mm512_mul_ps(sc, _mm512_set1_ps(q_scale[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(dot), acc[r]);
      acc[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(q_sum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + r * 16, acc[r]);
}

// All rows of x against one block: eight rows at a time and the rest in one more pass (each pass
// unpacks the block's codes again, which is much of the cost for a few rows).
template <int BITS>
void multiply_rows(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t M, int64_t K,
                   const at::Half* scale, const at::Half* offset, float* y) {
  const int64_t groups = K / kGroup;
  int64_t m = 0;
  auto at = [&](int64_t row, auto rows) {
    multiply_block<BITS, decltype(rows)::value>(low, high, x.q.data() + row * K, x.scale.data() + row * groups,
                                                x.sum.data() + row * groups, K, scale, offset, y + row * 16);
  };
  for (; m + 8 <= M; m += 8) at(m, std::integral_constant<int, 8>{});
  switch (M - m) {
    case 7: at(m, std::integral_constant<int, 7>{}); break;
    case 6: at(m, std::integral_constant<int, 6>{}); break;
    case 5: at(m, std::integral_constant<int, 5>{}); break;
    case 4: at(m, std::integral_constant<int, 4>{}); break;
    case 3: at(m, std::integral_constant<int, 3>{}); break;
    case 2: at(m, std::integral_constant<int, 2>{}); break;
    case 1: at(m, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <int BITS>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& low, const torch::Tensor& high,
                     const torch::Tensor& scale, const torch::Tensor& offset, const c10::optional<torch::Tensor>& bias,
                     int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / kGroup, blocks = N / 16;
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows rows = quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  const auto* low_ptr = low.data_ptr<uint8_t>();
  const auto* high_ptr = BITS == 5 ? high.data_ptr<uint8_t>() : nullptr;
  const auto* scale_ptr = scale.data_ptr<at::Half>();
  const auto* offset_ptr = offset.data_ptr<at::Half>();
  auto* y_ptr = y.data_ptr<at::BFloat16>();
  const float* bias_ptr = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(M * 16);
    for (int64_t nb = begin; nb < end; ++nb) {
      multiply_rows<BITS>(low_ptr + nb * K * 8, high_ptr ? high_ptr + nb * K * 2 : nullptr, rows, M, K,
                          scale_ptr + nb * groups * 16, offset_ptr + nb * groups * 16, tile.data());
      // The bias joins in float32, so each output is rounded to bf16 once (and no separate add runs).
      const __m512 bias16 = bias_ptr ? _mm512_loadu_ps(bias_ptr + nb * 16) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(tile.data() + m * 16), bias16));
        std::memcpy(y_ptr + m * N + nb * 16, &out, 16 * sizeof(at::BFloat16));
      }
    }
  });
  return y;
}

torch::Tensor woq_linear(const torch::Tensor& x, const torch::Tensor& low, const torch::Tensor& high,
                         const torch::Tensor& scale, const torch::Tensor& offset, const c10::optional<torch::Tensor>& bias,
                         int64_t N, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(x.size(1) % kGroup == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias: contiguous float32 [N]");
  if (bits == 4) return linear<4>(x, low, high, scale, offset, bias, N);
  TORCH_CHECK(bits == 5, "bits must be 4 or 5");
  return linear<5>(x, low, high, scale, offset, bias, N);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("woq_linear", &woq_linear, "weight-only 4/5-bit quantized linear, int8 products (AVX512-VNNI)");
}
