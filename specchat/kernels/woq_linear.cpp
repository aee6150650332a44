// Weight-only quantized linear layers for CPUs with AVX512-BF16: y = x @ dequant(W).T for a few
// rows of x (one decode token, or the few dozen tokens of a draft tree being verified).
//
// Why not the kernels torch already has: aten._weight_int4pack_mm_for_cpu and _weight_int8pack_mm
// dequantize the weights again for every row of x and multiply in fp32, so verifying 8 tokens
// costs 2-3x one token; bf16 GEMMs are flat in the row count but read 2 bytes per weight. Here each
// block of 16 output rows is expanded once into bf16 (in L1/L2) and every row of x is multiplied
// against it with vdpbf16ps: the weights cross the memory bus once, at 4-5 bits each, whatever the
// row count, and the products run at the bf16 dot-product rate.
//
// The expansion needs no float arithmetic: for a code q < 128 the bf16 bit pattern 0x4300 | q is
// exactly the number 128 + q. With w = q * scale + offset per group of 32 weights,
//     x . w = scale * (x . (128 + q)) + (offset - 128 * scale) * sum(x),
// so the kernel dots x with the raw codes per group and applies scale and offset once per group.
//
// Layout (made by specchat/quantized.py): codes are unsigned, fp16 scale and offset per output row
// and group of 32 along K. Output rows come in blocks of 16; within a block, "pair vector" p holds
// the 32 codes of k = 2p, 2p + 1 for the 16 rows in vdpbf16ps order: element e is row e / 2,
// k = 2p + e % 2.
//   low[NB][K/2][16] bytes: byte j = code_j & 15 | (code_{j+16} & 15) << 4;
//   high[NB][K/2] uint32 (5-bit codes only): bit e = code_e >> 4;
//   scale, offset: [NB][K/32][16] fp16;
//   bias (optional): [N] float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kGroup = 32;               // weights per quantization group along K
constexpr int kPairsPerGroup = kGroup / 2;

// One pair vector's codes as bf16 (128 + q): the 16 bytes go to every 128-bit lane, a byte
// shuffle puts byte e % 16 in word e, words 16-31 shift down to their high nibble, and one
// ternary-logic op keeps the nibble and sets the exponent bits of 128.
struct Expander {
  const __m512i spread = _mm512_set_epi8(
      -1, 15, -1, 14, -1, 13, -1, 12, -1, 11, -1, 10, -1, 9, -1, 8, -1, 7, -1, 6, -1, 5, -1, 4, -1, 3, -1, 2, -1, 1, -1, 0,
      -1, 15, -1, 14, -1, 13, -1, 12, -1, 11, -1, 10, -1, 9, -1, 8, -1, 7, -1, 6, -1, 5, -1, 4, -1, 3, -1, 2, -1, 1, -1, 0);
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                          0x0004000400040004, 0, 0, 0, 0);
  const __m512i nibble = _mm512_set1_epi16(15), exponent = _mm512_set1_epi16(0x4300), sixteen = _mm512_set1_epi16(16);

  template <int BITS>
  __m512i operator()(const uint8_t* low, const uint32_t* high, int64_t p) const {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + p * 16)));
    const __m512i words = _mm512_srlv_epi16(_mm512_shuffle_epi8(bytes, spread), shifts);
    __m512i codes = _mm512_ternarylogic_epi32(words, nibble, exponent, 0xEA);  // (words & nibble) | exponent
    if constexpr (BITS == 5) codes = _mm512_mask_add_epi16(codes, static_cast<__mmask32>(high[p]), codes, sixteen);
    return codes;
  }
};

// y[r] = sum over groups of scale * (x[r] . codes) + offset' * sum(x[r] in group), for ROWS rows;
// `codes(p)` expands pair vector p in registers (cheaper than storing the block and reading it
// back, even when a block is expanded once per eight rows).
template <int ROWS, typename Codes>
void multiply_block(Codes codes, const int32_t* x_pairs, const float* x_sums, int64_t pairs,
                    const at::Half* scale, const at::Half* offset, float* y) {
  // Independent accumulation chains hide vdpbf16ps's latency: with one row of x a single chain
  // waits on itself (four chains made one-token decoding ~8% faster on a Zen 4 CPU).
  constexpr int SPLIT = ROWS == 1 ? 4 : ROWS < 8 ? 2 : 1;
  const int64_t groups = pairs / kPairsPerGroup;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 c128 = _mm512_set1_ps(128.0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[ROWS][SPLIT];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < SPLIT; ++s) part[r][s] = _mm512_setzero_ps();
    for (int64_t p = g * kPairsPerGroup; p < (g + 1) * kPairsPerGroup; p += SPLIT) {
      for (int s = 0; s < SPLIT; ++s) {
        const __m512bh wv = (__m512bh)codes(p + s);
        for (int r = 0; r < ROWS; ++r)
          part[r][s] = _mm512_dpbf16_ps(part[r][s], wv, (__m512bh)_mm512_set1_epi32(x_pairs[r * pairs + p + s]));
      }
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * 16)));
    const __m512 of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + g * 16)));
    const __m512 shifted = _mm512_fnmadd_ps(c128, sc, of);  // offset - 128 * scale
    for (int r = 0; r < ROWS; ++r) {
      __m512 sum = part[r][0];
      for (int s = 1; s < SPLIT; ++s) sum = _mm512_add_ps(sum, part[r][s]);
      acc[r] = _mm512_fmadd_ps(sc, sum, acc[r]);
      acc[r] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(x_sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + r * 16, acc[r]);
}

// All rows of x against one block, eight rows at a time and the rest in one more pass: every pass
// expands the block's codes again, which is most of the cost for a few rows (7 rows as 4 + 2 + 1
// cost 1.6x 7 rows at once).
template <typename Codes>
void multiply_rows(Codes codes, const int32_t* x_pairs, const float* x_sums, int64_t M, int64_t pairs,
                   const at::Half* scale, const at::Half* offset, float* y) {
  const int64_t groups = pairs / kPairsPerGroup;
  int64_t m = 0;
  auto at = [&](int64_t row, auto rows) {
    multiply_block<decltype(rows)::value>(codes, x_pairs + row * pairs, x_sums + row * groups, pairs, scale, offset,
                                          y + row * 16);
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
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2, groups = K / kGroup, blocks = N / 16;
  auto y = torch::empty({M, N}, x.options());
  const auto* x_pairs = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> x_sums_store(M * groups);  // sum of x over each group, per row
  const auto* x_raw = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * groups; ++i) {
    float total = 0.0f;
    for (int k = 0; k < kGroup; ++k) total += static_cast<float>(x_raw[i * kGroup + k]);
    x_sums_store[i] = total;
  }
  const float* x_sums = x_sums_store.data();
  const auto* low_ptr = low.data_ptr<uint8_t>();
  const auto* high_ptr = BITS == 5 ? reinterpret_cast<const uint32_t*>(high.data_ptr<int32_t>()) : nullptr;
  const auto* scale_ptr = scale.data_ptr<at::Half>();
  const auto* offset_ptr = offset.data_ptr<at::Half>();
  auto* y_ptr = y.data_ptr<at::BFloat16>();
  const float* bias_ptr = bias ? bias->data_ptr<float>() : nullptr;
  const Expander expand;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(M * 16);
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint8_t* block_low = low_ptr + nb * pairs * 16;
      const uint32_t* block_high = high_ptr ? high_ptr + nb * pairs : nullptr;
      auto codes = [&](int64_t p) { return expand.operator()<BITS>(block_low, block_high, p); };
      multiply_rows(codes, x_pairs, x_sums, M, pairs, scale_ptr + nb * groups * 16, offset_ptr + nb * groups * 16,
                    tile.data());
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
  m.def("woq_linear", &woq_linear, "weight-only 4/5-bit quantized linear (AVX512-BF16)");
}
