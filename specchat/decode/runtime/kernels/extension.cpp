// The extension's face to torch: its operators (torch.ops.specchat.*) and classes (torch.classes.specchat.*),
// which check and allocate tensors and call the arithmetic in the files beside it: the products
// (woq_linear.cpp), the layers' work around them (layers.cpp) and the weights' quantization
// (quantize.cpp), compiled together as arithmetic.cpp.
//
// Only this file includes torch's and ATen's headers. The extension is compiled on a user's first
// start, beside the model's conversion, on two cores: as one translation unit it took 17 CPU-seconds
// of a Xeon core, the second core idle once the conversion ended; now this file takes ~12 (torch's
// headers ~4.5, registering the classes' methods with torch ~4.5: its templates) and arithmetic.cpp
// ~6.5 on the other core, and the 0.5B's first start answered ~1.2 s sooner there (26.2 against 27.4
// s, three alternating pairs); more is to be gained where compiling is slow against converting (a Zen 3
// core took 2.3-3x a Xeon core's time for the same files).
//
// Loaded as a library of torch operators and classes, not a Python module: no pybind11
// (torch/extension.h, the whole C++ frontend with it, takes 22 s to compile on a Xeon core, 55 on a
// Zen 3's).

#include "layers.h"
#include "woq_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

namespace specchat {
namespace {

// y = x @ dequant(W).T (+ bias) for x [M, K] bf16 or float32, on the instruction set `isa`
// (the caller, specchat/decode/runtime/quantized.py, has checked that the CPU has it).
at::Tensor linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scale,
                  const at::Tensor& offset, const c10::optional<at::Tensor>& bias, int64_t N, int64_t bits,
                  const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: contiguous bf16 or float32 [M, K]");
  TORCH_CHECK(x.size(1) % kGroup == 0 && N % kBlockRows == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "bias: contiguous float32 [N]");
  TORCH_CHECK(bits == 4 || bits == 5, "bits must be 4 or 5");
  const int path = isa_index(isa);
  TORCH_CHECK(path >= 0, "isa must be one of the compiled ones (isas()), not ", isa);
  const PackedLinear weights{low.data_ptr<uint8_t>(), bits == 5 ? high.data_ptr<uint8_t>() : nullptr,
                             scale.data_ptr<c10::Half>(), offset.data_ptr<c10::Half>(),
                             bias ? bias->data_ptr<float>() : nullptr, N, x.size(1), static_cast<int>(bits)};
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) woq_linear(x.data_ptr<float>(), x.size(0), weights, path, y.data_ptr<float>());
  else woq_linear(x.data_ptr<c10::BFloat16>(), x.size(0), weights, path, y.data_ptr<c10::BFloat16>());
  return y;
}

// The operator's signature spells the ISA as a string_view.
at::Tensor woq_linear_op(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scale,
                         const at::Tensor& offset, const c10::optional<at::Tensor>& bias, int64_t N, int64_t bits,
                         c10::string_view isa) {
  return linear(x, low, high, scale, offset, bias, N, bits, std::string(isa));
}

// codes [N, K] uint8, scale and offset [N, K / 32] fp16, for weight [N, K] (bf16 or float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_op(const at::Tensor& weight, int64_t bits) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % kGroup == 0, "quantize: weight [N, K], K a multiple of 32");
  TORCH_CHECK(bits == 4 || bits == 5, "quantize: 4 or 5 bits");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "quantize: bf16 or float32 weights");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor codes = at::empty({N, K}, w.options().dtype(at::kByte));
  at::Tensor scale = at::empty({N, K / kGroup}, w.options().dtype(at::kHalf));
  at::Tensor offset = at::empty({N, K / kGroup}, w.options().dtype(at::kHalf));
  const auto run = [&](const auto* first) {
    quantize(first, N, K, static_cast<int>(bits), codes.data_ptr<uint8_t>(), scale.data_ptr<c10::Half>(),
             offset.data_ptr<c10::Half>());
  };
  if (w.scalar_type() == at::kFloat) run(w.data_ptr<float>());
  else run(w.data_ptr<c10::BFloat16>());
  return {codes, scale, offset};
}

// The codes in the kernel's layout (quantize.cpp's `pack`): low [N/16][K/8][64], high [N/16][K/4][8]
// (empty for 4 bits), scales and offsets [N/16][K/32][16].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack_op(const at::Tensor& codes_in,
                                                                   const at::Tensor& scale_in,
                                                                   const at::Tensor& offset_in, int64_t bits) {
  const at::Tensor codes = codes_in.contiguous(), scale = scale_in.contiguous(), offset = offset_in.contiguous();
  const int64_t N = codes.size(0), K = codes.size(1), blocks = N / kBlockRows, groups = K / kGroup;
  TORCH_CHECK(N % kBlockRows == 0 && K % kGroup == 0, "pack: N a multiple of 16, K of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf &&
                  offset.scalar_type() == at::kHalf, "pack: uint8 codes, fp16 scales and offsets");
  at::Tensor low = at::empty({blocks, K / 8, 4 * kBlockRows}, codes.options());
  at::Tensor high = bits == 5 ? at::empty({blocks, K / 4, 8}, codes.options()) : at::empty({0}, codes.options());
  at::Tensor scales = at::empty({blocks, groups, kBlockRows}, scale.options());
  at::Tensor offsets = at::empty({blocks, groups, kBlockRows}, offset.options());
  pack(codes.data_ptr<uint8_t>(), scale.data_ptr<c10::Half>(), offset.data_ptr<c10::Half>(), N, K,
       static_cast<int>(bits), low.data_ptr<uint8_t>(), bits == 5 ? high.data_ptr<uint8_t>() : nullptr,
       scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>());
  return {low, high, scales, offsets};
}

// The greedy choice after each row of logits [n, V] and how near a tie it was (layers.cpp's `choose`).
std::tuple<at::Tensor, at::Tensor> choose_op(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits: contiguous [n, V] float32 or bf16");
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor choices = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor margins = at::empty({n}, logits.options().dtype(at::kFloat));
  if (logits.scalar_type() == at::kFloat)
    choose(logits.data_ptr<float>(), n, V, choices.data_ptr<int64_t>(), margins.data_ptr<float>());
  else
    choose(logits.data_ptr<c10::BFloat16>(), n, V, choices.data_ptr<int64_t>(), margins.data_ptr<float>());
  return {choices, margins};
}

// The token each row of logits [n, V] draws at temperatures [n] with uniforms [n] (layers.cpp's `sample`).
at::Tensor sample_op(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits: contiguous [n, V] float32 or bf16");
  const int64_t n = logits.size(0), V = logits.size(1);
  for (const at::Tensor* t : {&temperatures, &uniforms})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "temperatures, uniforms: contiguous float32 [n]");
  at::Tensor tokens = at::empty({n}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat)
    sample(logits.data_ptr<float>(), n, V, temperatures.data_ptr<float>(), uniforms.data_ptr<float>(),
           tokens.data_ptr<int64_t>());
  else
    sample(logits.data_ptr<c10::BFloat16>(), n, V, temperatures.data_ptr<float>(), uniforms.data_ptr<float>(),
           tokens.data_ptr<int64_t>());
  return tokens;
}

// The quantized linear layers' packed weights (specchat/decode/runtime/quantized.py's QuantizedLinear).
struct Linear : torch::CustomClassHolder {
  at::Tensor low, high, scale, offset;
  c10::optional<at::Tensor> bias;
  int64_t N, bits;
  Linear(at::Tensor low, at::Tensor high, at::Tensor scale, at::Tensor offset, c10::optional<at::Tensor> bias,
         int64_t N, int64_t bits)
      : low(std::move(low)), high(std::move(high)), scale(std::move(scale)), offset(std::move(offset)),
        bias(std::move(bias)), N(N), bits(bits) {}
  at::Tensor operator()(const at::Tensor& x, const std::string& isa) const {
    return linear(x, low, high, scale, offset, bias, N, bits, isa);
  }
};

// The attention's shape and what every layer shares.
struct Shape {
  Heads attention;
  double eps, scaling;
  std::string isa;
};

// Where a forward's time went, when asked (`specchat bench --profile`): the kernel's products and
// attention, in seconds; the rest of a forward is what its caller's clock adds.
struct Timings {
  double products = 0.0, attention = 0.0;
};

// Runs `work`, adding its wall time to `*total` when timing (a null total: not timing).
template <typename F>
auto timed(double* total, const F& work) {
  if (total == nullptr) return work();
  const auto start = std::chrono::steady_clock::now();
  auto result = work();
  *total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// One Llama-family decoder layer from its attention input on: the norms before it are the caller's
// (a target layer's input norm; a draft head's own prologue).
struct Layer : torch::CustomClassHolder {
  c10::intrusive_ptr<Linear> qkv, o, gate_up, down;  // q, k and v stacked; gate and up stacked
  at::Tensor post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3: each head's query and key normed before rotating

  Layer(c10::intrusive_ptr<Linear> qkv, c10::intrusive_ptr<Linear> o, c10::intrusive_ptr<Linear> gate_up,
        c10::intrusive_ptr<Linear> down, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
        c10::optional<at::Tensor> k_norm)
      : qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)),
        post_norm(std::move(post_norm)), q_norm(std::move(q_norm)), k_norm(std::move(k_norm)) {}

  // residual + o(attention(qkv(attention_input))), then + down(act(gate) * up) of its norm: [n, H].
  // New keys and values go to positions prefix + width - n .. prefix + width of keys/values [kv_heads, capacity, d].
  // With `outputs` < n, only the last `outputs` rows go on past their keys and values (a one-layer
  // draft head's context pass: the rows before its last are needed only as cache entries): [outputs, H].
  template <typename T>
  at::Tensor step(const Shape& shape, const at::Tensor& attention_input, const at::Tensor& residual,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                     const at::Tensor& values, const Span& span, Timings* timings, int64_t outputs = -1) const {
    double* products = timings ? &timings->products : nullptr;
    const int64_t n = attention_input.size(0), heads = shape.attention.heads, kv_heads = shape.attention.kv_heads;
    const int64_t G = heads / kv_heads, D = shape.attention.head_dim;
    TORCH_CHECK(head_size_supported(D), "head sizes 16, 32, 64 and 128 only, not ", D);
    const int64_t skipped = outputs < 0 ? 0 : n - outputs;  // rows that stop at their keys and values
    TORCH_CHECK(skipped >= 0 && skipped < n, "outputs: 1 to the rows given");
    const int64_t capacity = keys.size(1), first = span.prefix + span.width - n;
    TORCH_CHECK(first >= 0 && span.prefix + span.width <= capacity, "new entries beyond the cache's room");
    TORCH_CHECK(G <= 16 && heads % kv_heads == 0, "at most 16 query heads per KV head");
    at::Tensor projected = timed(products, [&] { return (*qkv)(attention_input, shape.isa); });  // [n, (h + 2 kv) * D]
    T* rows = projected.data_ptr<T>();
    const LayerCache<T> cache{keys.data_ptr<T>(), values.data_ptr<T>(), capacity};
    rotate_into_cache(rows, n, shape.attention, q_norm ? q_norm->data_ptr<T>() : nullptr,
                      k_norm ? k_norm->data_ptr<T>() : nullptr, shape.eps, cos.data_ptr<T>(), sin.data_ptr<T>(),
                      cache, first);
    const int64_t kept = n - skipped;  // the rows that go on: skipped .. n
    at::Tensor attended = at::empty({kept, heads * D}, attention_input.options());
    timed(timings ? &timings->attention : nullptr, [&] {
      attend(rows, n, skipped, shape.attention, cache, span, shape.scaling, attended.data_ptr<T>());
      return 0;
    });
    return finish<T>(shape, attended, skipped ? residual.narrow(0, skipped, kept).contiguous() : residual, timings);
  }

  // `step` for rows that are each a sequence of its own (regeneration's slots): row r's key and value
  // go to position lengths[r] of caches[r], and it attends to that cache's positions 0 .. lengths[r].
  // A row gets the bits `step` gives it decoding its sequence alone (the products are row by row, and
  // so is the attention: its kv heads in one thread here, each head's loop the same).
  template <typename T>
  at::Tensor step_apart(const Shape& shape, const at::Tensor& attention_input, const at::Tensor& residual,
                        const at::Tensor& cos, const at::Tensor& sin, const std::vector<LayerCache<T>>& caches,
                        const int64_t* lengths) const {
    const int64_t n = attention_input.size(0), heads = shape.attention.heads, D = shape.attention.head_dim;
    const int64_t width = (heads + 2 * shape.attention.kv_heads) * D;
    at::Tensor projected = (*qkv)(attention_input, shape.isa);
    at::Tensor attended = at::empty({n, heads * D}, attention_input.options());
    T* rows = projected.data_ptr<T>();
    T* out = attended.data_ptr<T>();
    const T* cosines = cos.data_ptr<T>();
    const T* sines = sin.data_ptr<T>();
    const T* q_normed = q_norm ? q_norm->data_ptr<T>() : nullptr;
    const T* k_normed = k_norm ? k_norm->data_ptr<T>() : nullptr;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rotate_into_cache(rows + r * width, 1, shape.attention, q_normed, k_normed, shape.eps, cosines + r * D,
                          sines + r * D, caches[r], lengths[r]);
        attend(rows + r * width, 1, 0, shape.attention, caches[r], Span{lengths[r], 1, nullptr}, shape.scaling,
               out + r * heads * D);
      }
    });
    return finish<T>(shape, attended, residual, nullptr);
  }

  // residual + o(attended), then + down(act(gate) * up) of its norm: [rows, H].
  template <typename T>
  at::Tensor finish(const Shape& shape, const at::Tensor& attended, const at::Tensor& residual, Timings* timings) const {
    double* products = timings ? &timings->products : nullptr;
    at::Tensor h = timed(products, [&] { return (*o)(attended, shape.isa); });
    add_into(h.data_ptr<T>(), residual.data_ptr<T>(), h.numel());
    const int64_t rows = h.size(0), hidden = h.size(1);
    at::Tensor normed = at::empty_like(h);
    rms_norm(h.data_ptr<T>(), post_norm.data_ptr<T>(), normed.data_ptr<T>(), rows, hidden, shape.eps);
    at::Tensor gated = timed(products, [&] { return (*gate_up)(normed, shape.isa); });  // [rows, 2I]: gate, then up
    const int64_t inner = gated.size(1) / 2;
    at::Tensor act = at::empty({rows, inner}, h.options());
    silu_times(gated.data_ptr<T>(), act.data_ptr<T>(), rows, inner);
    at::Tensor out = timed(products, [&] { return (*down)(act, shape.isa); });
    add_into(out.data_ptr<T>(), h.data_ptr<T>(), out.numel());
    return out;
  }
};

// The activations' dtype as a template argument.
template <typename F>
auto dispatch(const at::Tensor& x, const F& body) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "activations: float32 or bf16");
  if (x.scalar_type() == at::kFloat) return body(float{});
  return body(c10::BFloat16{});
}

Span span_of(int64_t prefix, int64_t width, const c10::optional<at::Tensor>& block, int64_t n) {
  if (block) {
    TORCH_CHECK(block->scalar_type() == at::kBool && block->is_contiguous() && block->dim() == 2 &&
                block->size(0) == n && block->size(1) == width, "block: contiguous bool [n, width]");
  }
  TORCH_CHECK(width >= n, "the span's new part holds the forward's rows");
  return Span{prefix, width, block ? block->data_ptr<bool>() : nullptr};
}

// A whole decoder: the layers with their input norms, and the final norm.
struct Decoder : torch::CustomClassHolder {
  Shape shape;
  std::vector<c10::intrusive_ptr<Layer>> layers;
  std::vector<at::Tensor> input_norms;
  at::Tensor final_norm;
  bool profiling = false;  // time the products and attention of each forward (`take_timings`)
  Timings timings;

  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
          std::vector<c10::intrusive_ptr<Layer>> layers, std::vector<at::Tensor> input_norms, at::Tensor final_norm)
      : shape{{heads, kv_heads, head_dim}, eps, scaling, std::move(isa)}, layers(std::move(layers)),
        input_norms(std::move(input_norms)), final_norm(std::move(final_norm)) {}

  // The products' and attention's seconds since the last call.
  std::tuple<double, double> take_timings() {
    const Timings taken = timings;
    timings = Timings{};
    return {taken.products, taken.attention};
  }

  // x [n, H] (the embedded tokens) at the positions cos/sin [n, d] give, on top of the cache keys/values
  // [layers, kv_heads, capacity, d], whose first `prefix` positions every row sees; the new rows'
  // entries go to prefix .. prefix + n, and `block` [n, n] (None: causal) says which of them each row
  // sees. Returns the final normed state and the hidden states `features` names (i: layer i's input;
  // the number of layers: the final normed state).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                                          const at::Tensor& keys, const at::Tensor& values,
                                                          int64_t prefix, const c10::optional<at::Tensor>& block,
                                                          const std::vector<int64_t>& features) {
    const int64_t n = x.size(0), count = static_cast<int64_t>(layers.size());
    TORCH_CHECK(x.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == n, "x [n, H], cos and sin [n, d]");
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == count && keys.scalar_type() == x.scalar_type(),
                "keys, values: [layers, kv_heads, capacity, d] in x's dtype");
    const Span span = span_of(prefix, n, block, n);
    x = x.contiguous();
    std::vector<at::Tensor> hidden(count + 1);
    dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      const at::Tensor cosines = cos.contiguous(), sines = sin.contiguous();
      at::Tensor normed = at::empty_like(x);
      for (int64_t l = 0; l < count; ++l) {
        hidden[l] = x;  // (each step returns a new tensor: this one stays layer l's input)
        rms_norm(x.data_ptr<T>(), input_norms[l].data_ptr<T>(), normed.data_ptr<T>(), n, x.size(1), shape.eps);
        x = layers[l]->step<T>(shape, normed, x, cosines, sines, keys[l], values[l], span,
                               profiling ? &timings : nullptr);
      }
      hidden[count] = at::empty_like(x);
      rms_norm(x.data_ptr<T>(), final_norm.data_ptr<T>(), hidden[count].data_ptr<T>(), n, x.size(1), shape.eps);
      return 0;
    });
    std::vector<at::Tensor> taken;
    for (const int64_t index : features) taken.push_back(hidden.at(index));
    return {hidden[count], taken};
  }

  // One new token for each of n sequences held apart (regeneration's slots: specchat/train/batched.py's
  // KernelSlots): x [n, H] at the positions cos/sin [n, d] give; sequence r's cache is keys/values
  // [slots[r]] of [slots, layers, kv_heads, capacity, d], its first lengths[r] positions written, and
  // the new entry goes to position lengths[r]. Returns the final normed states [n, H], each row's the
  // bits `forward` gives it decoding its sequence alone.
  at::Tensor forward_apart(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& slots, const at::Tensor& lengths) {
    const int64_t n = x.size(0), count = static_cast<int64_t>(layers.size());
    const Heads& heads = shape.attention;
    TORCH_CHECK(x.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == n, "x [n, H], cos and sin [n, d]");
    TORCH_CHECK(keys.dim() == 5 && keys.size(1) == count && keys.size(2) == heads.kv_heads &&
                    keys.size(4) == heads.head_dim && keys.is_contiguous() && values.sizes() == keys.sizes() &&
                    values.is_contiguous() && keys.scalar_type() == x.scalar_type() &&
                    values.scalar_type() == x.scalar_type(),
                "keys, values: contiguous [slots, layers, kv_heads, capacity, d] in x's dtype");
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == at::kLong && lengths.dim() == 1 &&
                    lengths.size(0) == n && lengths.scalar_type() == at::kLong, "slots, lengths: [n] int64");
    TORCH_CHECK(head_size_supported(heads.head_dim) && heads.heads % heads.kv_heads == 0 &&
                heads.heads / heads.kv_heads <= 16, "head sizes 16, 32, 64 and 128, at most 16 query heads per KV head");
    const at::Tensor slot_of = slots.contiguous(), length_of = lengths.contiguous();
    const int64_t* slot = slot_of.data_ptr<int64_t>();
    const int64_t* length = length_of.data_ptr<int64_t>();
    const int64_t capacity = keys.size(3), layer_size = heads.kv_heads * capacity * heads.head_dim;
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(slot[r] >= 0 && slot[r] < keys.size(0) && length[r] >= 0 && length[r] < capacity,
                  "a slot outside the cache, or a sequence at its capacity");
    x = x.contiguous();
    at::Tensor final;
    dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      const at::Tensor cosines = cos.contiguous(), sines = sin.contiguous();
      at::Tensor normed = at::empty_like(x);
      std::vector<LayerCache<T>> caches(n);
      for (int64_t l = 0; l < count; ++l) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t at_layer = (slot[r] * count + l) * layer_size;
          caches[r] = LayerCache<T>{keys.data_ptr<T>() + at_layer, values.data_ptr<T>() + at_layer, capacity};
        }
        rms_norm(x.data_ptr<T>(), input_norms[l].data_ptr<T>(), normed.data_ptr<T>(), n, x.size(1), shape.eps);
        x = layers[l]->step_apart<T>(shape, normed, x, cosines, sines, caches, length);
      }
      final = at::empty_like(x);
      rms_norm(x.data_ptr<T>(), final_norm.data_ptr<T>(), final.data_ptr<T>(), n, x.size(1), shape.eps);
      return 0;
    });
    return final;
  }
};

// One layer on its own, from its attention input on (a draft head's layer: its prologue is the head's).
struct Block : torch::CustomClassHolder {
  Shape shape;
  c10::intrusive_ptr<Layer> layer;

  Block(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
        c10::intrusive_ptr<Layer> layer)
      : shape{{heads, kv_heads, head_dim}, eps, scaling, std::move(isa)}, layer(std::move(layer)) {}

  // attention_input [m, A] and residual [m, H] at the positions cos/sin [m, d] give; the new keys and
  // values go to keys/values [kv_heads, capacity, d] at prefix + width - m.., and row i sees [0, prefix)
  // and the positions of [prefix, prefix + width) that block [m, width] marks (None: causally).
  at::Tensor forward(const at::Tensor& attention_input, const at::Tensor& residual, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values, int64_t prefix,
                     int64_t width, const c10::optional<at::Tensor>& block) {
    const int64_t m = attention_input.size(0);
    TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() &&
                keys.scalar_type() == attention_input.scalar_type(), "keys, values: [kv_heads, capacity, d]");
    const Span span = span_of(prefix, width, block, m);
    return dispatch(attention_input, [&](auto zero) {
      using T = decltype(zero);
      return layer->step<T>(shape, attention_input.contiguous(), residual.contiguous(), cos.contiguous(),
                            sin.contiguous(), keys, values, span, nullptr);
    });
  }
};

// An EAGLE-3 head's draft step in one call, and its best next tokens in another
// (specchat/decode/runtime/cpu_decoder.py's FusedEagle3Step). In torch calls a step was ~25 of them
// around the layer (fc, the two norms and their concatenation, the rotary angles; the final norm,
// the draft LM head, the log-softmax, the top-k): ~0.5 ms of a 1.4 ms step on 2 Zen 3 cores, where
// the weights are ~10 MB. What it computes only drafts (every draft is verified), so it follows the
// torch code's arithmetic without its every rounding: the angles' cosines and the log-softmax's sum
// may differ from torch's in the last bits.
struct Eagle3Step : torch::CustomClassHolder {
  Shape shape;
  c10::intrusive_ptr<Linear> fc;  // [3 H_target] target features -> [H]
  c10::intrusive_ptr<Layer> layer;
  at::Tensor input_norm, hidden_norm;  // the embedding's and the hidden state's
  bool norm_before_residual;  // the residual is the normed hidden state (else the hidden state)
  at::Tensor final_norm;
  c10::intrusive_ptr<Linear> lm_head;  // [H] -> draft vocabulary
  at::Tensor inv_freq;  // [d / 2] float32: the rotary frequencies (with the head's scaling)
  at::Tensor embedding;  // [target vocabulary, H]: the head's token embeddings (the target's, shared)

  Eagle3Step(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling, std::string isa,
             c10::intrusive_ptr<Linear> fc, c10::intrusive_ptr<Layer> layer, at::Tensor input_norm,
             at::Tensor hidden_norm, bool norm_before_residual, at::Tensor final_norm,
             c10::intrusive_ptr<Linear> lm_head, at::Tensor inv_freq, at::Tensor embedding)
      : shape{{heads, kv_heads, head_dim}, eps, scaling, std::move(isa)}, fc(std::move(fc)), layer(std::move(layer)),
        input_norm(std::move(input_norm)), hidden_norm(std::move(hidden_norm)),
        norm_before_residual(norm_before_residual), final_norm(std::move(final_norm)), lm_head(std::move(lm_head)),
        inv_freq(std::move(inv_freq)), embedding(std::move(embedding)) {}

  // A draft level in one call: the next tokens' embeddings [m] -> [m, H], `step` and `top` (each a
  // call from Python cost a dispatch and, right after the target's forward, a cold start of the
  // thread pool). Returns the outputs [outputs, H] and their k best draft ids and log-probabilities.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> draft(const at::Tensor& hidden, const at::Tensor& tokens,
                                                       const at::Tensor& positions, const at::Tensor& keys,
                                                       const at::Tensor& values, int64_t prefix, int64_t width,
                                                       const c10::optional<at::Tensor>& block, int64_t outputs,
                                                       int64_t k) {
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "tokens: [m] int64");
    const at::Tensor embedded = embedding.index_select(0, tokens).to(hidden.scalar_type());
    const at::Tensor out = step(hidden, embedded, positions, keys, values, prefix, width, block, outputs);
    auto [logps, ids] = top(out, k);
    return {out, logps, ids};
  }

  // hidden [m, 3 H_target] (target features: fc first) or [m, H] (the head's outputs of the step
  // before), embedded [m, H] (the next tokens' embeddings), at positions [m]; keys and values as
  // `Block::forward` takes them. Every row's entries go to the cache; returns the head's outputs of
  // the last `outputs` rows [outputs, H] (a context pass needs only its last row's).
  at::Tensor step(const at::Tensor& hidden, const at::Tensor& embedded, const at::Tensor& positions,
                  const at::Tensor& keys, const at::Tensor& values, int64_t prefix, int64_t width,
                  const c10::optional<at::Tensor>& block, int64_t outputs) {
    const int64_t m = hidden.size(0), H = input_norm.size(0), D = shape.attention.head_dim;
    TORCH_CHECK(embedded.dim() == 2 && embedded.size(0) == m && embedded.size(1) == H &&
                embedded.scalar_type() == hidden.scalar_type(), "embedded: [m, H] in hidden's dtype");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == m && positions.scalar_type() == at::kLong,
                "positions: [m] int64");
    TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.is_contiguous() &&
                keys.scalar_type() == hidden.scalar_type(), "keys, values: [kv_heads, capacity, d]");
    const at::Tensor h = hidden.size(1) == H ? hidden.contiguous() : (*fc)(hidden.contiguous(), shape.isa);
    const Span span = span_of(prefix, width, block, m);
    return dispatch(h, [&](auto zero) {
      using T = decltype(zero);
      const at::Tensor tokens = embedded.contiguous();
      at::Tensor x = at::empty({m, 2 * H}, h.options()), normed = at::empty_like(h);
      eagle3_input(h.data_ptr<T>(), tokens.data_ptr<T>(), hidden_norm.data_ptr<T>(), input_norm.data_ptr<T>(), m, H,
                   shape.eps, x.data_ptr<T>(), normed.data_ptr<T>());
      at::Tensor cos = at::empty({m, D}, h.options()), sin = at::empty({m, D}, h.options());
      rotary_angles(inv_freq.data_ptr<float>(), positions.data_ptr<int64_t>(), m, D, cos.data_ptr<T>(),
                    sin.data_ptr<T>());
      return layer->step<T>(shape, x, norm_before_residual ? normed : h, cos, sin, keys, values, span, nullptr,
                            outputs);
    });
  }

  // The k likeliest next tokens after each output [r, H], best first (ties: the lower id first), as
  // draft-vocabulary ids [r, k] with their log-probabilities [r, k] (float32).
  std::tuple<at::Tensor, at::Tensor> top(const at::Tensor& outputs, int64_t k) {
    TORCH_CHECK(outputs.dim() == 2 && outputs.size(1) == final_norm.size(0), "outputs: [r, H]");
    const int64_t r = outputs.size(0), H = outputs.size(1);
    const at::Tensor x = outputs.contiguous();
    at::Tensor normed = at::empty_like(x);
    at::Tensor logits = dispatch(x, [&](auto zero) {
      using T = decltype(zero);
      rms_norm(x.data_ptr<T>(), final_norm.data_ptr<T>(), normed.data_ptr<T>(), r, H, shape.eps);
      return (*lm_head)(normed, shape.isa).to(at::kFloat).contiguous();
    });
    const int64_t V = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= V, "k: 1 to the draft vocabulary's size");
    at::Tensor logps = at::empty({r, k}, x.options().dtype(at::kFloat));
    at::Tensor ids = at::empty({r, k}, x.options().dtype(at::kLong));
    top_k(logits.data_ptr<float>(), r, V, k, logps.data_ptr<float>(), ids.data_ptr<int64_t>());
    return {logps, ids};
  }
};

}  // namespace

// The operators and classes. torch.ops.specchat.woq_linear is what torch.compile captures inside a
// graph (specchat/decode/runtime/woq_kernel.py gives it its shape function); .isas says the
// instruction sets this build has a path for, best first; specchat/decode/runtime/cpu_decoder.py
// builds the classes from a model's layers.
TORCH_LIBRARY(specchat, m) {
  m.def("woq_linear(Tensor x, Tensor low, Tensor high, Tensor scale, Tensor offset, Tensor? bias, int N, int bits, "
        "str isa) -> Tensor");
  m.impl("woq_linear", c10::DispatchKey::CPU, &woq_linear_op);
  m.def("isas() -> str[]", &isa_names);
  m.def("quantize(Tensor weight, int bits) -> (Tensor, Tensor, Tensor)");
  m.impl("quantize", c10::DispatchKey::CPU, &quantize_op);
  m.def("pack(Tensor codes, Tensor scale, Tensor offset, int bits) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("pack", c10::DispatchKey::CPU, &pack_op);
  m.def("choose(Tensor logits) -> (Tensor, Tensor)");
  m.impl("choose", c10::DispatchKey::CPU, &choose_op);
  m.def("sample(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
  m.impl("sample", c10::DispatchKey::CPU, &sample_op);

  m.class_<Linear>("Linear").def(
      torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t>());
  m.class_<Layer>("Layer").def(
      torch::init<c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>, c10::intrusive_ptr<Linear>,
                  c10::intrusive_ptr<Linear>, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>>());
  m.class_<Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, std::vector<c10::intrusive_ptr<Layer>>,
                       std::vector<at::Tensor>, at::Tensor>())
      .def("forward", &Decoder::forward)
      .def("forward_apart", &Decoder::forward_apart)
      .def("set_profiling", [](const c10::intrusive_ptr<Decoder>& self, bool on) { self->profiling = on; })
      .def("take_timings", &Decoder::take_timings);
  m.class_<Block>("Block")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, c10::intrusive_ptr<Layer>>())
      .def("forward", &Block::forward);
  m.class_<Eagle3Step>("Eagle3Step")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, std::string, c10::intrusive_ptr<Linear>,
                       c10::intrusive_ptr<Layer>, at::Tensor, at::Tensor, bool, at::Tensor, c10::intrusive_ptr<Linear>,
                       at::Tensor, at::Tensor>())
      .def("step", &Eagle3Step::step)
      .def("top", &Eagle3Step::top)
      .def("draft", &Eagle3Step::draft);
}

}  // namespace specchat
