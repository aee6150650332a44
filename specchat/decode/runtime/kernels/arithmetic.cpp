// The extension's arithmetic as one translation unit: the products (woq_linear.cpp), the layers'
// work around them (layers.cpp) and the weights' quantization (quantize.cpp). Each compiled on its
// own spent ~2 of its 2.5-5.5 s (a Xeon core) parsing the same headers (immintrin.h's every
// instruction set, c10's number types, ATen's parallel_for): 9.3 CPU-seconds for the three, 6.2
// together, beside extension.cpp (torch's face, ~12 s) on the other core of a user's first start.
#include "woq_linear.cpp"
#include "layers.cpp"
#include "quantize.cpp"
