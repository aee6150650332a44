// The extension as one translation unit (what specchat/decode/runtime/woq_kernel.py compiles): the
// products and the layers around them share ATen's and torch's headers, which took a third of
// each file's compile when each parsed them. A user's first start compiles this beside the model's
// conversion on the same two cores, so CPU-seconds are what count: 14.3 instead of 19.5 on a Xeon
// core (the two files compiled in parallel finish ~1.5 s sooner only where a core is idle); 12.5
// with decoder.cpp's layer compiled once per dtype rather than per dtype and head size.
#include "woq_linear.cpp"
#include "decoder.cpp"
#include "quantize.cpp"
