// What the quantized kernel (woq_linear.cpp) offers the rest of the extension (decoder.cpp, the
// layers written around it). Only ATen's core headers: torch/extension.h (the whole C++ frontend
// and pybind11) takes 55 s to compile on a 2-core Zen 3, these ~10 s, and the extension is compiled
// on a user's first start (its classes and functions reach Python through torch.ops and torch.classes).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace specchat {

// The weights' layout (woq_linear.cpp's top comment; made by quantize.cpp).
constexpr int kGroup = 32;      // weights per quantization group along K
constexpr int kBlockRows = 16;  // output rows per block

// y = x @ dequant(W).T (+ bias) for x [M, K] bf16 or float32, on the instruction set `isa`.
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scale,
                      const at::Tensor& offset, const c10::optional<at::Tensor>& bias, int64_t N, int64_t bits,
                      const std::string& isa);

}  // namespace specchat
