// The weights' layout, its products (woq_linear.cpp) and its quantization (quantize.cpp), as the
// extension's torch face (extension.cpp) and the layers (layers.cpp) call them: plain pointers and
// sizes, no ATen or torch headers. Those headers are much of a file's compile (torch/library.h ~4.3 s
// of a Xeon core, ~10 s of a Zen 3's), and the extension is compiled on a user's first start: only
// extension.cpp includes them, and the arithmetic (arithmetic.cpp) compiles beside it, on the other core.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <string>
#include <vector>

namespace specchat {

// The weights' layout (woq_linear.cpp's top comment; made by quantize.cpp).
constexpr int kGroup = 32;      // weights per quantization group along K
constexpr int kBlockRows = 16;  // output rows per block

// One linear layer's packed weights, [N, K] (the caller has checked the sizes).
struct PackedLinear {
  const uint8_t* low;
  const uint8_t* high;  // 5-bit codes' fifth bits; null for 4 bits
  const c10::Half* scale;
  const c10::Half* offset;
  const float* bias;  // [N] or null
  int64_t N, K;
  int bits;  // 4 or 5
};

// The instruction sets this build has a path for, best first (woq_linear.cpp's top comment), and
// the index of one by name (-1: none of them).
std::vector<std::string> isa_names();
int isa_index(const std::string& name);

// y [M, N] = x [M, K] @ dequant(W).T (+ bias), on the path `isa` (an `isa_index`) the CPU has.
template <typename T>
void woq_linear(const T* x, int64_t M, const PackedLinear& weights, int isa, T* y);

// Codes [N, K] (uint8), scales and offsets [N, K / 32] (fp16) of weight [N, K], K a multiple of 32.
template <typename T>
void quantize(const T* weight, int64_t N, int64_t K, int bits, uint8_t* codes, c10::Half* scale, c10::Half* offset);

// quantize's codes, scales and offsets in the products' layout (woq_linear.cpp's top comment);
// N a multiple of 16, `high` unused (may be null) for 4 bits.
void pack(const uint8_t* codes, const c10::Half* scale, const c10::Half* offset, int64_t N, int64_t K, int bits,
          uint8_t* low, uint8_t* high, c10::Half* scales, c10::Half* offsets);

}  // namespace specchat
