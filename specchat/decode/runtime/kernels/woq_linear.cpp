// Weight-only quantized linear layers for x86 CPUs with AVX2: y = x @ dequant(W).T for a few rows
// of x (one decode token, or the few dozen tokens of a draft tree being verified).
//
// Why not the kernels torch already has: aten._weight_int4pack_mm_for_cpu and _weight_int8pack_mm
// dequantize the weights again for every row of x and multiply in fp32, so verifying 8 tokens
// costs 2-3x one token; bf16 GEMMs are flat in the row count but read 2 bytes per weight. Here each
// block of 16 output rows is unpacked once into bytes in registers and every row of x is
// multiplied against it: the weights cross the memory bus once, at 4-5 bits each, whatever the
// row count.
//
// The products are 8-bit integer dot products, as llama.cpp multiplies its Q5_0 weights: each row
// of x (bf16 or float32) is quantized per group of 32 to int8 with a float scale (symmetric, the
// group's largest magnitude -> 127). With w = code * scale + offset per group of 32 weights and
// x = q * s,
//     x . w = scale * s * (q . code) + offset * s * sum(q),
// so the kernel sums q . code exactly in int32 and applies the scales once per group. The integer
// sums do not depend on how many rows are multiplied together, and the float part is the same
// sequence for every row, so a row's result is bit-identical whether it is verified alone or in a
// tree of 16 (speculation compares like with like).
//
// Three instruction sets compute those sums, chosen at run time (specchat/quantized.py):
//   avx512   (AVX512-VNNI): vpdpbusd on 512-bit registers, 16 output rows per register, 64
//            multiply-adds per instruction; the fifth bits are added by a masked add.
//   avx-vnni (AVX-VNNI: Intel Core 12th gen and later, which have no AVX-512): vpdpbusd on 256-bit
//            registers, 8 rows per register; the fifth bits are spread by a byte shuffle and a
//            compare. Also built as avx-vnni-evex (vpdpbusd's AVX512-VNNI encoding) so that
//            AVX-512 CPUs, which lack AVX-VNNI (Zen 4 included), can test this code.
//   avx2:    vpmaddubsw (unsigned codes x signed int8 into int16 pairs) + vpmaddwd with ones
//            (pairs into int32), as llama.cpp multiplies Q5_0 by Q8_0 on AVX2.
// On the 256-bit paths five or more rows (a draft tree) are multiplied group by group against codes
// unpacked once into L1 (multiply_unpacked): there each row costs only its products, which on AVX2
// is what bounds verification (2-core Zen 4, all linear layers of the 0.5B, float32 x: 8 rows 38 ->
// 34 ms, 16 rows 73 -> 58 ms; one row ~13.5 ms, bound by memory).
// All make the same int32 sums and then run the same float operations per output (one multiply,
// two fused multiply-adds per group, the bias added in float32, one rounding to bf16 when x is
// bf16, emulating vcvtneps2bf16 in AVX2 for every path), so their outputs are bit-identical. This
// file is compiled once; the part after the "one instruction set" marker below is included once
// per path under its target pragma, so the AVX-512 and AVX-VNNI code is confined to functions
// that only run where the CPU has it (the rest of the file is plain AVX2+FMA+F16C).
//
// Layout (made by specchat/quantized.py): codes are unsigned (0-31 or 0-15); output rows come in
// blocks of 16. "Quad" j of a block holds the codes of k = 4j .. 4j+3 for its 16 rows in vpdpbusd
// order: byte 4r + b is row r, k = 4j + b.
//   low[NB][K/8][64] bytes: the low nibbles of quads 2p (bits 0-3) and 2p + 1 (bits 4-7);
//   high[NB][K/4][8] bytes (5-bit codes only): bit t of quad j's 64-bit word = byte t's fifth bit;
//   scale, offset: [NB][K/32][16] fp16;
//   bias (optional): [N] float32.

#ifndef WOQ_ISA  // ================================ the shared part ================================

#include "vectors.h"
#include "woq_linear.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using specchat::kBlockRows;
using specchat::kGroup;
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

// Every |q| <= 127 (the largest magnitude maps to 127), which the AVX2 path's int16 sums rely on.
// A group's eight lanes at a time: the largest magnitude ignores NaNs as std::fmax does (vmaxps
// returns its second operand where either is NaN), each q is the same product rounded to nearest
// even (as std::nearbyintf in the default mode) and stored as a byte, and the int32 sum is exact
// in any order, so every row gets the bits the scalar loop gave it. That loop called fmaxf for every
// value: on a 2-vCPU Xeon a 512-token prefill's products took 1.01 s with it and 0.75 s without,
// sixteen verified rows' 39.1 ms and 32.3, one decoding step's 13.5 ms and 12.9.
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  static_assert(kGroup == 32, "four vectors a group");
  const int64_t groups = K / kGroup;
  QuantizedRows rows{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < M * groups; ++i) {
    const T* group = x + i * kGroup;
    __m256 values[4], largest = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      values[j] = specchat::load8(group + 8 * j);
      largest = _mm256_max_ps(_mm256_and_ps(values[j], magnitude), largest);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, largest);
    float top = 0.0f;
    for (const float lane : lanes) top = std::max(top, lane);  // (no lane is NaN)
    const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
    const __m256 inverses = _mm256_set1_ps(inverse);
    __m256i q[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256 rounded =
          _mm256_round_ps(_mm256_mul_ps(values[j], inverses), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[j] = _mm256_cvttps_epi32(rounded);
      total = _mm256_add_epi32(total, q[j]);
    }
    specchat::store_bytes32(q, rows.q.data() + i * kGroup);
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
    int32_t sum = 0;
    for (const int32_t lane : sums) sum += lane;
    rows.scale[i] = scale;
    rows.sum[i] = scale * static_cast<float>(sum);
  }
  return rows;
}

// One instruction set's product of all rows of x with one block of 16 output rows: y[M][16].
using MultiplyRows = void (*)(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t M,
                              int64_t K, const c10::Half* scale, const c10::Half* offset, float* y);

}  // namespace

#define WOQ_STRING(x) #x
#define WOQ_PRAGMA(x) _Pragma(WOQ_STRING(x))

#define WOQ_ISA avx512
#define WOQ_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
#define WOQ_WIDTH 512
#include __FILE__
#undef WOQ_ISA
#undef WOQ_TARGET
#undef WOQ_WIDTH

// AVX-VNNI's intrinsics came with GCC 11 and clang 12; an older compiler builds the other two paths.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define WOQ_HAS_AVX_VNNI 1
#define WOQ_ISA avx_vnni
#define WOQ_TARGET "avx2,fma,f16c,avxvnni"
#define WOQ_WIDTH 256
#define WOQ_VNNI 1
#include __FILE__
#undef WOQ_ISA
#undef WOQ_TARGET
#undef WOQ_WIDTH
#undef WOQ_VNNI
#else
#define WOQ_HAS_AVX_VNNI 0
#endif

// The avx-vnni path's code with vpdpbusd in its EVEX encoding (AVX512-VNNI at 256 bits): CPUs with
// AVX-512 (which run the avx512 path by default) have no AVX-VNNI, so this is how they test it.
#define WOQ_ISA avx_vnni_evex
#define WOQ_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define WOQ_WIDTH 256
#define WOQ_VNNI 2
#include __FILE__
#undef WOQ_ISA
#undef WOQ_TARGET
#undef WOQ_WIDTH
#undef WOQ_VNNI

#define WOQ_ISA avx2
#define WOQ_TARGET "avx2,fma,f16c"
#define WOQ_WIDTH 256
#define WOQ_VNNI 0
#include __FILE__
#undef WOQ_ISA
#undef WOQ_TARGET
#undef WOQ_WIDTH
#undef WOQ_VNNI

namespace {

// 16 outputs of a block for one row: tile + bias, stored as float32 ...
inline void store_outputs(float* out, const float* tile, const float* bias) {
  const __m256 lo = _mm256_loadu_ps(tile), hi = _mm256_loadu_ps(tile + 8);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(hi, bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps()));
}

// ... or rounded to bf16 once, exactly as AVX512-BF16's vcvtneps2bf16 rounds: to nearest even,
// zeros and denormals to a signed zero, NaNs quieted. The same AVX2 code for every path.
inline __m256i round_to_bf16(__m256 v) {  // eight bf16 in the low halves of eight int32
  const __m256i bits = _mm256_castps_si256(v), truncated = _mm256_srli_epi32(bits, 16);
  const __m256i odd = _mm256_and_si256(truncated, _mm256_set1_epi32(1));
  const __m256i rounding = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
  const __m256i nearest = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
  const __m256i exponent = _mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000));
  const __m256i tiny = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  __m256i out = _mm256_blendv_epi8(nearest, _mm256_or_si256(truncated, _mm256_set1_epi32(0x40)), nan);
  return _mm256_blendv_epi8(out, _mm256_and_si256(truncated, _mm256_set1_epi32(0x8000)), tiny);
}

inline void store_outputs(c10::BFloat16* out, const float* tile, const float* bias) {
  const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(tile), bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps());
  const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(tile + 8), bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps());
  // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute restores the order.
  const __m256i packed = _mm256_packus_epi32(round_to_bf16(lo), round_to_bf16(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xd8));
}

// The paths in `isa_names`' order (WOQ_HAS_AVX_VNNI: whether this compiler built avx-vnni).
struct Path {
  const char* name;
  MultiplyRows four, five;
};
const Path kPaths[] = {
    {"avx512", avx512::multiply_rows<4>, avx512::multiply_rows<5>},
#if WOQ_HAS_AVX_VNNI
    {"avx-vnni", avx_vnni::multiply_rows<4>, avx_vnni::multiply_rows<5>},
#endif
    {"avx-vnni-evex", avx_vnni_evex::multiply_rows<4>, avx_vnni_evex::multiply_rows<5>},
    {"avx2", avx2::multiply_rows<4>, avx2::multiply_rows<5>},
};

// All rows of x against every block (the caller has checked the sizes).
template <typename T>
void linear(const T* x, int64_t M, const specchat::PackedLinear& w, MultiplyRows multiply, T* y) {
  const int64_t K = w.K, N = w.N, groups = K / kGroup, blocks = N / kBlockRows;
  const QuantizedRows rows = quantize_rows(x, M, K);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(M * 16);
    for (int64_t nb = begin; nb < end; ++nb) {
      multiply(w.low + nb * K * 8, w.bits == 5 ? w.high + nb * K * 2 : nullptr, rows, M, K,
               w.scale + nb * groups * 16, w.offset + nb * groups * 16, tile.data());
      // The bias joins in float32, so each output is rounded once (and no separate add runs).
      for (int64_t m = 0; m < M; ++m)
        store_outputs(y + m * N + nb * 16, tile.data() + m * 16, w.bias ? w.bias + nb * 16 : nullptr);
    }
  });
}

}  // namespace

std::vector<std::string> specchat::isa_names() {
  std::vector<std::string> names;
  for (const Path& path : kPaths) names.emplace_back(path.name);
  return names;
}

int specchat::isa_index(const std::string& name) {
  for (int i = 0; i < static_cast<int>(std::size(kPaths)); ++i)
    if (name == kPaths[i].name) return i;
  return -1;
}

// The caller (extension.cpp) has checked the sizes, and (specchat/decode/runtime/woq_kernel.py) that
// the CPU has `isa`'s instructions.
template <typename T>
void specchat::woq_linear(const T* x, int64_t M, const PackedLinear& weights, int isa, T* y) {
  linear(x, M, weights, weights.bits == 5 ? kPaths[isa].five : kPaths[isa].four, y);
}

template void specchat::woq_linear(const float*, int64_t, const PackedLinear&, int, float*);
template void specchat::woq_linear(const c10::BFloat16*, int64_t, const PackedLinear&, int, c10::BFloat16*);

#else  // ====================== one instruction set: WOQ_ISA, compiled for WOQ_TARGET ======================

#if defined(__clang__)
WOQ_PRAGMA(clang attribute push(__attribute__((target(WOQ_TARGET))), apply_to = function))
#else
WOQ_PRAGMA(GCC push_options)
WOQ_PRAGMA(GCC target(WOQ_TARGET))
#endif

namespace {
namespace WOQ_ISA {

#if WOQ_WIDTH == 512  // ---- AVX512-VNNI: a block's 16 rows in one register ----

constexpr int kMaxRows = 8;     // rows of x per pass over a block (32 registers: accumulators for 8)
constexpr int kSplitRows = 3;   // up to this many rows, two dot chains per row hide vpdpbusd's latency

struct Codes {
  __m512i first, second;  // quads 2p and 2p + 1 as bytes
};
using Ints = __m512i;
using Floats = __m512;

inline Ints zero_ints() { return _mm512_setzero_si512(); }
inline Floats zero_floats() { return _mm512_setzero_ps(); }
inline Ints add(Ints a, Ints b) { return _mm512_add_epi32(a, b); }

template <int BITS>
inline Codes unpack(const uint8_t* low, const uint8_t* high, int64_t pair) {
  const __m512i nibble = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
  const __m512i packed = _mm512_loadu_si512(low + pair * 64);
  Codes codes{_mm512_and_si512(packed, nibble), _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble)};
  if constexpr (BITS == 5) {
    __mmask64 first_high, second_high;
    std::memcpy(&first_high, high + pair * 16, 8);
    std::memcpy(&second_high, high + pair * 16 + 8, 8);
    codes.first = _mm512_mask_add_epi8(codes.first, first_high, codes.first, sixteen);
    codes.second = _mm512_mask_add_epi8(codes.second, second_high, codes.second, sixteen);
  }
  return codes;
}

// first += codes.first . x0, second += codes.second . x1 (x0, x1: four int8 of a row of x each)
inline void dot(Ints& first, Ints& second, const Codes& codes, int32_t x0, int32_t x1) {
  first = _mm512_dpbusd_epi32(first, codes.first, _mm512_set1_epi32(x0));
  second = _mm512_dpbusd_epi32(second, codes.second, _mm512_set1_epi32(x1));
}

inline Floats load_fp16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc + scale * s * dot + offset * s * sum(q): one multiply and two fused multiply-adds per output.
inline Floats accumulate(Floats acc, Floats scale, Floats offset, Ints dot, float s, float sum) {
  const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(s));
  acc = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(dot), acc);
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(sum), acc);
}

inline void store(float* y, Floats acc) { _mm512_storeu_ps(y, acc); }

#else  // ---- AVX2 / AVX-VNNI: a block's 16 rows in two registers, rows 0-7 and 8-15 ----

// Rows of x per pass over a block. With 16 registers some accumulators spill (the float ones are
// touched once per group); per row and pair of quads, AVX2 on Zen 4 took 2.4 ns with 2 rows per
// pass, 2.05 with 3, 1.96 with 4 and 1.9-2.0 with 5-6.
constexpr int kMaxRows = 4;
constexpr int kSplitRows = WOQ_VNNI ? 2 : 0;  // vpdpbusd chains as in the AVX-512 path; AVX2's adds are short

struct Halves {
  __m256i lo, hi;
};
struct Codes {
  Halves first, second;
};
using Ints = Halves;
struct Floats {
  __m256 lo, hi;
};

inline Ints zero_ints() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Floats zero_floats() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Ints add(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }

// 16 for each byte of 32 codes whose fifth bit is set: the bits of four bytes of `bits` (here at
// `start`), byte i's bit in byte start + i / 8 at bit i % 8. The shuffle copies that byte to byte
// i (both 128-bit lanes of `bits` hold all 16 bytes), the AND keeps bit i % 8 and the compare
// makes it a full byte.
inline __m256i fifth_bits(__m256i bits, char start) {
  const char a = start, b = start + 1, c = start + 2, d = start + 3;
  const __m256i spread = _mm256_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b,
                                          c, c, c, c, c, c, c, c, d, d, d, d, d, d, d, d);
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(bits, spread), select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

template <int BITS>
inline Codes unpack(const uint8_t* low, const uint8_t* high, int64_t pair) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + pair * 64));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + pair * 64 + 32));
  Codes codes{{_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, nibble)},
              {_mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble)}};
  if constexpr (BITS == 5) {  // quad 2p's 64-bit word, then quad 2p + 1's; rows 0-7 in each word's low half
    const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + pair * 16));
    const __m256i bits = _mm256_broadcastsi128_si256(words);
    codes.first.lo = _mm256_or_si256(codes.first.lo, fifth_bits(bits, 0));
    codes.first.hi = _mm256_or_si256(codes.first.hi, fifth_bits(bits, 4));
    codes.second.lo = _mm256_or_si256(codes.second.lo, fifth_bits(bits, 8));
    codes.second.hi = _mm256_or_si256(codes.second.hi, fifth_bits(bits, 12));
  }
  return codes;
}

#if WOQ_VNNI
inline __m256i dpbusd(__m256i acc, __m256i codes, __m256i q) {
#if WOQ_VNNI == 1
  return _mm256_dpbusd_avx_epi32(acc, codes, q);  // VEX: AVX-VNNI
#else
  return _mm256_dpbusd_epi32(acc, codes, q);  // EVEX: AVX512-VNNI + VL
#endif
}

inline void dot(Ints& first, Ints& second, const Codes& codes, int32_t x0, int32_t x1) {
  const __m256i q0 = _mm256_set1_epi32(x0), q1 = _mm256_set1_epi32(x1);
  first.lo = dpbusd(first.lo, codes.first.lo, q0);
  first.hi = dpbusd(first.hi, codes.first.hi, q0);
  second.lo = dpbusd(second.lo, codes.second.lo, q1);
  second.hi = dpbusd(second.hi, codes.second.hi, q1);
}
#else
// vpmaddubsw multiplies unsigned codes by signed int8 and adds pairs into int16 with saturation;
// with codes <= 31 and |q| <= 127 a pair is at most 2 * 31 * 127 = 7874 in magnitude and the sum
// of both quads' pairs at most 15748, so nothing saturates and the sums are the exact ones that
// vpdpbusd makes. vpmaddwd with ones then adds the int16 pairs into int32.
inline __m256i dot_half(__m256i first, __m256i second, __m256i q0, __m256i q1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, q0), _mm256_maddubs_epi16(second, q1));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

inline void dot(Ints& first, Ints&, const Codes& codes, int32_t x0, int32_t x1) {
  const __m256i q0 = _mm256_set1_epi32(x0), q1 = _mm256_set1_epi32(x1);
  first.lo = _mm256_add_epi32(first.lo, dot_half(codes.first.lo, codes.second.lo, q0, q1));
  first.hi = _mm256_add_epi32(first.hi, dot_half(codes.first.hi, codes.second.hi, q0, q1));
}
#endif

inline Floats load_fp16(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

// The same operations as the AVX-512 path's, on each half.
inline __m256 accumulate_half(__m256 acc, __m256 scale, __m256 offset, __m256i dot, float s, float sum) {
  const __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(s));
  acc = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(dot), acc);
  return _mm256_fmadd_ps(offset, _mm256_set1_ps(sum), acc);
}

inline Floats accumulate(Floats acc, Floats scale, Floats offset, Ints dot, float s, float sum) {
  return {accumulate_half(acc.lo, scale.lo, offset.lo, dot.lo, s, sum),
          accumulate_half(acc.hi, scale.hi, offset.hi, dot.hi, s, sum)};
}

inline void store(float* y, Floats acc) {
  _mm256_storeu_ps(y, acc.lo);
  _mm256_storeu_ps(y + 8, acc.hi);
}

inline Floats load(const float* y) { return {_mm256_loadu_ps(y), _mm256_loadu_ps(y + 8)}; }

// One row's integer sums over one group (four pairs of quads, unpacked in `codes`): rows 0-7 of the
// block in .lo, 8-15 in .hi. x: the group's 32 int8 of the row, four per int32.
inline Ints group_dot(const Codes* codes, const int32_t* x) {
#if WOQ_VNNI
  Ints first = zero_ints(), second = zero_ints();
  for (int pair = 0; pair < kPairsPerGroup; ++pair) dot(first, second, codes[pair], x[2 * pair], x[2 * pair + 1]);
  return add(first, second);
#else
  // Two pairs' products stay in int16 before vpmaddwd widens them: each int16 is then a sum of 8
  // products, at most 8 * 31 * 127 = 31496 in magnitude, so nothing wraps (and vpmaddubsw's own
  // pairs, at most 7874, never saturate); one widening per two pairs instead of one per pair.
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i q[2 * kPairsPerGroup];
  for (int i = 0; i < 2 * kPairsPerGroup; ++i) q[i] = _mm256_set1_epi32(x[i]);
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  for (int pair = 0; pair < kPairsPerGroup; pair += 2) {
    const Codes& a = codes[pair];
    const Codes& b = codes[pair + 1];
    const __m256i* x4 = q + 2 * pair;
    const __m256i sum_lo = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(a.first.lo, x4[0]), _mm256_maddubs_epi16(a.second.lo, x4[1])),
        _mm256_add_epi16(_mm256_maddubs_epi16(b.first.lo, x4[2]), _mm256_maddubs_epi16(b.second.lo, x4[3])));
    const __m256i sum_hi = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(a.first.hi, x4[0]), _mm256_maddubs_epi16(a.second.hi, x4[1])),
        _mm256_add_epi16(_mm256_maddubs_epi16(b.first.hi, x4[2]), _mm256_maddubs_epi16(b.second.hi, x4[3])));
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(sum_lo, ones));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(sum_hi, ones));
  }
  return {lo, hi};
#endif
}

// From this many rows on, a block is multiplied group by group: the group's codes are unpacked
// once into a 512-byte buffer (L1) and every row of x is multiplied against it, instead of
// unpacking them again for every kMaxRows rows (16 registers hold the codes of one pair and four
// rows' sums, no more). Outputs are the same bits: the same integer sums, the same float steps.
constexpr int kUnpackedRows = 5;

template <int BITS>
void multiply_unpacked(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t M, int64_t K,
                       const c10::Half* scale, const c10::Half* offset, float* y) {
  const int64_t groups = K / kGroup;
  Codes codes[kPairsPerGroup];
  for (int64_t m = 0; m < M; ++m) store(y + m * 16, zero_floats());
  for (int64_t g = 0; g < groups; ++g) {
    for (int pair = 0; pair < kPairsPerGroup; ++pair) {
      const int64_t at = g * kPairsPerGroup + pair;
      _mm_prefetch(reinterpret_cast<const char*>(low + (at + kPrefetchAhead) * 64), _MM_HINT_T0);
      codes[pair] = unpack<BITS>(low, high, at);
    }
    const Floats sc = load_fp16(scale + g * 16), of = load_fp16(offset + g * 16);
    for (int64_t m = 0; m < M; ++m) {
      const auto* row = reinterpret_cast<const int32_t*>(x.q.data() + m * K) + g * 2 * kPairsPerGroup;
      const Ints total = group_dot(codes, row);
      store(y + m * 16, accumulate(load(y + m * 16), sc, of, total, x.scale[m * groups + g], x.sum[m * groups + g]));
    }
  }
}

#endif  // WOQ_WIDTH

// ---- the same for every instruction set ----

// y[r] = sum over groups of scale * s[r] * (q[r] . codes) + offset * s[r] * sum(q[r]), for ROWS rows.
template <int BITS, int ROWS>
void multiply_block(const uint8_t* low, const uint8_t* high, const int8_t* q, const float* q_scale,
                    const float* q_sum, int64_t K, const c10::Half* scale, const c10::Half* offset, float* y) {
  constexpr int SPLIT = ROWS <= kSplitRows ? 2 : 1;  // independent dot chains per row
  const int64_t groups = K / kGroup;
  Floats acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = zero_floats();
  for (int64_t g = 0; g < groups; ++g) {
    Ints dots[ROWS][SPLIT];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < SPLIT; ++s) dots[r][s] = zero_ints();
    for (int64_t pair = g * kPairsPerGroup; pair < (g + 1) * kPairsPerGroup; ++pair) {
      _mm_prefetch(reinterpret_cast<const char*>(low + (pair + kPrefetchAhead) * 64), _MM_HINT_T0);
      const Codes codes = unpack<BITS>(low, high, pair);
      for (int r = 0; r < ROWS; ++r) {
        const auto* row = reinterpret_cast<const int32_t*>(q + r * K);  // four int8 of x per int32
        dot(dots[r][0], dots[r][SPLIT - 1], codes, row[2 * pair], row[2 * pair + 1]);
      }
    }
    const Floats sc = load_fp16(scale + g * 16), of = load_fp16(offset + g * 16);
    for (int r = 0; r < ROWS; ++r) {
      Ints total = dots[r][0];
      if constexpr (SPLIT == 2) total = add(total, dots[r][1]);
      acc[r] = accumulate(acc[r], sc, of, total, q_scale[r * groups + g], q_sum[r * groups + g]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store(y + r * 16, acc[r]);
}

template <int BITS, int ROWS>
void multiply_tile(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t row, int64_t K,
                   const c10::Half* scale, const c10::Half* offset, float* y) {
  const int64_t groups = K / kGroup;
  multiply_block<BITS, ROWS>(low, high, x.q.data() + row * K, x.scale.data() + row * groups,
                             x.sum.data() + row * groups, K, scale, offset, y + row * 16);
}

// The last 1 .. ROWS rows in one pass.
template <int BITS, int ROWS>
void multiply_rest(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t row, int64_t left,
                   int64_t K, const c10::Half* scale, const c10::Half* offset, float* y) {
  if constexpr (ROWS > 0) {
    if (left == ROWS) return multiply_tile<BITS, ROWS>(low, high, x, row, K, scale, offset, y);
    multiply_rest<BITS, ROWS - 1>(low, high, x, row, left, K, scale, offset, y);
  }
}

// All rows of x against one block: kMaxRows rows at a time and the rest in one more pass (each
// pass unpacks the block's codes again, which is much of the cost for a few rows).
template <int BITS>
void multiply_rows(const uint8_t* low, const uint8_t* high, const QuantizedRows& x, int64_t M, int64_t K,
                   const c10::Half* scale, const c10::Half* offset, float* y) {
#if WOQ_WIDTH != 512
  if (M >= kUnpackedRows) return multiply_unpacked<BITS>(low, high, x, M, K, scale, offset, y);
#endif
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) multiply_tile<BITS, kMaxRows>(low, high, x, m, K, scale, offset, y);
  multiply_rest<BITS, kMaxRows - 1>(low, high, x, m, M - m, K, scale, offset, y);
}

}  // namespace WOQ_ISA
}  // namespace

#if defined(__clang__)
WOQ_PRAGMA(clang attribute pop)
#else
WOQ_PRAGMA(GCC pop_options)
#endif

#endif  // WOQ_ISA
