// What the quantized kernel (woq_linear.cpp) offers the rest of the extension: the product itself,
// and the decoder layers written around it (decoder.cpp), bound into the same Python module.
#pragma once

#include <torch/extension.h>

#include <string>

namespace specchat {

// y = x @ dequant(W).T (+ bias) for x [M, K] bf16 or float32, on the instruction set `isa`.
torch::Tensor woq_linear(const torch::Tensor& x, const torch::Tensor& low, const torch::Tensor& high,
                         const torch::Tensor& scale, const torch::Tensor& offset, const c10::optional<torch::Tensor>& bias,
                         int64_t N, int64_t bits, const std::string& isa);

// decoder.cpp's classes, added to the module woq_linear.cpp defines.
void bind_decoder(pybind11::module& m);

}  // namespace specchat
