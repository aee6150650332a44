"""specchat's forward in one C++ call per forward, for targets whose linear layers are specchat's
quantized ones on a CPU (`--quantize int5|int4`, the default there), and a draft head's layer in
one call per draft step (`fuse_head`), an EAGLE-3 head's whole step and top-k so (`FusedEagle3Step`).

Between its products a decoding step of the 0.5B spends about as long again in small torch calls
(norms, rotary, the cache write, attention's steps, SwiGLU, residuals: ~40 per layer); the
kernel's extension (`kernels/extension.cpp`; the arithmetic in `kernels/layers.cpp`) runs each layer as
its four products and plain loops between them, on the same weights and the same KV buffers as
`specchat.decode.runtime.forward`, with every row computed on its own (a verified draft token gets
plain decoding's bits). The embedding and the rotary angles stay torch calls, once per forward.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.cache import GrowingKV, HeadCache
from drafters.eagle3 import Eagle3Head
from drafters.layers import DecoderLayer
from specchat.decode.runtime import woq_kernel
from specchat.decode.runtime.quantized import GatedMLP, QuantizedLinear, SharedProjection

HEAD_SIZES = (16, 32, 64, 128)  # the attention loops layers.cpp is compiled for
MOST_HEADS_PER_KV_HEAD = 16


def packed(layer: QuantizedLinear):
    """A quantized layer's weights as the extension holds them (shared, not copied)."""
    return woq_kernel.kernel().Linear(layer.low, layer.high, layer.scale, layer.bias, layer.bias_term,
                                      layer.out_features, layer.bits)


def unfused_reason(forward) -> str | None:
    """Why `forward` (a `specchat.decode.runtime.forward.DecoderForward`) cannot run as one call, or None."""
    if forward.device.type != "cpu" or forward.compiled:
        return "not an eager CPU forward"
    if forward.dtype not in (torch.float32, torch.bfloat16):
        return f"{forward.dtype} activations"
    if forward.activation != "silu":
        return f"the {forward.activation} activation"
    if forward.head_dim not in HEAD_SIZES or forward.heads // forward.kv_heads > MOST_HEADS_PER_KV_HEAD:
        return f"head size {forward.head_dim}, {forward.heads // forward.kv_heads} heads per KV head"
    for layer, projections in zip(forward.layers, forward.projections):
        mlp, attention = layer.mlp, layer.self_attn
        if projections.stacked is None or not isinstance(attention.o_proj, QuantizedLinear) \
                or not isinstance(mlp, GatedMLP) or not isinstance(mlp.down_proj, QuantizedLinear):
            return "layers that are not all specchat's quantized ones"
    return None


def build(forward):
    """The extension's `Decoder` over `forward`'s layers (their tensors shared)."""
    kernel = woq_kernel.kernel()
    shape = (forward.heads, forward.kv_heads, forward.head_dim, epsilon(forward.norm), forward.scaling,
             woq_kernel.kernel_isa())
    layers = []
    for layer, projections in zip(forward.layers, forward.projections):
        attention = layer.self_attn
        heads_normed = forward.normalizes_heads
        layers.append(kernel.Layer(
            packed(projections.stacked), packed(attention.o_proj), packed(layer.mlp.gate_up),
            packed(layer.mlp.down_proj), _weight(layer.post_attention_layernorm),
            _weight(attention.q_norm) if heads_normed else None, _weight(attention.k_norm) if heads_normed else None))
    return kernel.Decoder(*shape, layers, [_weight(layer.input_layernorm) for layer in forward.layers],
                          _weight(forward.norm))


def _weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach().contiguous()


def epsilon(norm: nn.Module) -> float:
    """An RMS norm's epsilon, under transformers' name or the drafters' one."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


class FusedBlock:
    """A draft head's `DecoderLayer.block` in one call (its `fast_block`): attention over the head's
    growing cache, residual, MLP. Other key stores (the fixed envelope's, training's) get the
    layer's own torch code."""

    def __init__(self, layer: DecoderLayer):
        kernel, attention, mlp = woq_kernel.kernel(), layer.self_attn, layer.mlp
        # the attention's shape and the layer's products as the kernel holds them (`FusedEagle3Step` shares them)
        self.shape = (attention.heads, attention.kv_heads, attention.head_dim, epsilon(layer.post_attention_layernorm),
                      attention.head_dim ** -0.5, woq_kernel.kernel_isa())
        self.layer = kernel.Layer(packed(attention.q_proj.stacked), packed(attention.o_proj),
                                  packed(QuantizedLinear.stacked([mlp.gate_proj, mlp.up_proj])),
                                  packed(mlp.down_proj), _weight(layer.post_attention_layernorm), None, None)
        self.block = kernel.Block(*self.shape, self.layer)
        # the shape of the layer's cache entries (GrowingKV.reserve takes it from a tensor)
        self.entries = torch.empty((1, attention.kv_heads, 0, attention.head_dim),
                                   dtype=layer.post_attention_layernorm.weight.dtype)

    def room(self, keys: HeadCache, rows: int) -> GrowingKV:
        """The head's one layer's entries (it attends as layer 0, `drafters.layers.Attention`), with
        room for `rows` more written in place (`GrowingKV.buffers`, then `extend`)."""
        if not keys.layers:
            keys.layers.append(GrowingKV())
        store = keys.layers[0]
        store.reserve(self.entries, self.entries, store.length + rows)
        return store

    def __call__(self, layer: DecoderLayer, attention_input, residual, cos, sin, mask, keys) -> torch.Tensor:
        if not isinstance(keys, HeadCache) or mask is None or mask.dtype != torch.bool:
            return layer.torch_block(attention_input, residual, cos, sin, mask, keys)
        m = attention_input.shape[1]
        store = self.room(keys, m)
        width = store.length + m  # the mask's columns: every position held, then the new ones
        key_buffer, value_buffer = store.buffers
        out = self.block.forward(attention_input[0], residual[0], cos, sin, key_buffer[0], value_buffer[0], 0, width,
                                 mask[0, 0].contiguous())
        store.extend(m)
        return out[None]


class FusedEagle3Step:
    """An EAGLE-3 head's draft step in one call (fc for target features, the prologue's norms, the
    layer over the head's growing cache) and its best next tokens in another (the final norm, the
    draft LM head, log-softmax, top-k): `GrowingHead`'s context pass, tree levels and top-k. In torch
    calls the step and its top-k took ~25 small calls around the products, ~0.5 ms of a 1.4 ms step
    on 2 Zen 3 cores. Its numbers only draft, and every draft is verified: they follow the torch
    code's arithmetic, not its every rounding (`kernels/extension.cpp`'s Eagle3Step). Built on the
    layer's `FusedBlock` (`fuse_head` first), whose products and cache room it shares."""

    def __init__(self, head: Eagle3Head):
        layer = head.midlayer
        self.block: FusedBlock = layer.fast_block
        self.embed_tokens = head.embed_tokens
        self.kernel_step = woq_kernel.kernel().Eagle3Step(
            *self.block.shape, packed(head.fc), self.block.layer, _weight(layer.input_layernorm),
            _weight(layer.hidden_norm), bool(layer.norm_before_residual), _weight(head.norm), packed(head.lm_head),
            head.rope.inv_freq("cpu").contiguous(), head.embed_tokens.weight.detach())

    @staticmethod
    def fits(head: nn.Module) -> bool:
        """Whether `head` is an EAGLE-3 head whose products are all specchat's quantized ones, its layer
        fused (`fuse_head`), on a CPU."""
        return (isinstance(head, Eagle3Head) and isinstance(head.midlayer.fast_block, FusedBlock)
                and isinstance(head.fc, QuantizedLinear) and isinstance(head.lm_head, QuantizedLinear))

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
             prefix: int, block: torch.Tensor | None, outputs: int | None = None) -> torch.Tensor:
        """The head's outputs for m rows (their features or the head's outputs [m, F], the next
        tokens and positions [m]); each row sees the cache's first `prefix` entries and those of the
        entries after them that `block` [m, entries] marks (None: causally, the rows being the last
        entries). The rows' entries are appended to the cache; the outputs are the last `outputs`
        rows' [outputs, H] (None: all): a one-layer head's earlier rows are needed only as entries, and
        stop at their keys and values (a context pass after a run of lookup steps feeds tens of rows)."""
        m = len(tokens)
        store = self.block.room(cache, m)
        keys, values = store.buffers
        out = self.kernel_step.step(hidden, self.embed_tokens(tokens), positions, keys[0], values[0], prefix,
                                    store.length + m - prefix, block, -1 if outputs is None else outputs)
        store.extend(m)
        return out

    def top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest draft-vocabulary ids after each output [r, H] and their log-probabilities, best first."""
        return self.kernel_step.top(outputs, k)

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
              prefix: int, block: torch.Tensor | None, outputs: int | None, k: int):
        """A draft level in one call: `step` (the tokens embedded in the kernel) and `top` of its
        outputs; returns the outputs [outputs, H], their k best log-probabilities and draft ids."""
        m = len(tokens)
        store = self.block.room(cache, m)
        keys, values = store.buffers
        result = self.kernel_step.draft(hidden, tokens, positions, keys[0], values[0], prefix, store.length + m - prefix,
                                        block, -1 if outputs is None else outputs, k)
        store.extend(m)
        return result


def fuse_head(head: nn.Module) -> None:
    """Give each of a head's decoder layers whose products are all specchat's quantized ones (their
    q, k and v stacked, `quantized.share_projections`) a `FusedBlock`."""
    for module in head.modules():
        if isinstance(module, DecoderLayer) and _fusable(module):
            module.fast_block = FusedBlock(module)


def _fusable(layer: DecoderLayer) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    return (isinstance(attention.q_proj, SharedProjection) and isinstance(attention.o_proj, QuantizedLinear)
            and all(isinstance(part, QuantizedLinear) for part in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            and attention.head_dim in HEAD_SIZES and attention.heads // attention.kv_heads <= MOST_HEADS_PER_KV_HEAD
            and attention.o_proj.low.device.type == "cpu")
