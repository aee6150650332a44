"""specchat's own forward pass over a loaded Llama-family decoder, with the KV cache as two tensors
and a length: what `torch.compile(fullgraph=True)` captures without a break (`--compile`), one
decoder layer at a time, every layer running the same compiled graphs.

transformers' forward is general (any cache class, mask builders, output records, hooks); on a CPU
that Python costs ~8 ms of a ~21 ms decode step of the 0.5B (the linear layers take ~13; measured
with torch's profiler, docs/cpu-runtime.md), and under torch.compile it breaks the graph at the
growing cache. This forward computes what the stock Llama / Qwen2 / Qwen3 / Mistral layers compute
by calling the loaded modules (norms, projections — specchat's quantized ones included — MLPs and
the rotary embedding), so no weight is copied and any quantization the modules carry still
applies. Every layer's keys and values live in one pair of buffers [layers, kv_heads, capacity,
d] that grows by `drafters.cache`'s rule (`LayerKV`); the forward writes the new entries in place
and attends over the first `length + n`. With the length an argument, one compiled graph serves
every context length and every number of new tokens (dynamic shapes).

The fixed layout (`specchat.decode.runtime.envelope`) calls the same layers through `DecoderForward.at`:
the cache is allocated once at its full capacity, the new entries go to slots given as a tensor,
and attention reads a fixed span of the buffers with the valid positions named by the mask, so a
step's shapes never depend on the context length and a CUDA graph can replay it (compiled or not).
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.attention import attention
from drafters.cache import GrowingKV
from specchat.decode.runtime import cpu_decoder, woq_kernel
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.runtime.quantized import SharedProjection

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # decoders whose layers compute what `_layer` does


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `DecoderForward` cannot run `model` (then transformers' forward does), or None."""
    config = model.config.get_text_config()
    if config.model_type not in FAMILIES:
        return f"{config.model_type} is not one of the families specchat's forward computes ({', '.join(FAMILIES)})"
    sliding = getattr(config, "use_sliding_window", getattr(config, "sliding_window", None))
    layer_types = getattr(config, "layer_types", None) or ()
    if sliding or any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention"
    decoder = model.get_decoder()
    if not all(hasattr(decoder, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the decoder's modules are not laid out as transformers' Llama family lays them out"
    return None


class LayerKV:
    """The target's KV cache for `DecoderForward`: every layer's keys and values in one `GrowingKV`
    (its batch dimension is the layer). The owner changes its length only through `trim` and
    `compact`, as with `specchat.decode.runtime.transformers_cache.KVCache`; forwards extend it."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int | None = None):
        """`capacity`: allocate that many positions now and never grow (the fixed envelope's cache)."""
        self.storage = GrowingKV()
        self._shape = torch.empty((num_layers, kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.fixed_capacity = capacity
        if capacity is not None:
            # Zeros, not whatever the allocator held: steps attend over a span of it with the unwritten
            # positions masked, and a masked position's value still meets its zero weight (0 * NaN = NaN).
            for buffer in self.reserve(capacity):
                buffer.zero_()

    @property
    def length(self) -> int:
        return self.storage.length

    def reserve(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.fixed_capacity is None or needed <= self.fixed_capacity, "a fixed cache does not grow"
        self.storage.reserve(self._shape, self._shape, needed)
        return self.storage.buffers

    def extend(self, added: int) -> None:
        self.storage.extend(added)

    def trim(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        self.storage.trim(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        assert keep.numel() == 0 or int(keep.max()) < self.length - start, "compaction index out of range"
        self.storage.compact(start, keep.to(self._shape.device))

    def gather_rows(self, start: torch.Tensor, keep: torch.Tensor) -> None:
        """Copy positions `start + keep` to `start, start + 1, ...` on the device (`start` a 0-d tensor),
        leaving the length to the owner: the fixed envelope's compaction, with no host read."""
        for buffer in self.storage.buffers:
            buffer.index_copy_(2, start + torch.arange(len(keep), device=keep.device), buffer.index_select(2, start + keep))

    def nbytes(self) -> int:
        return self.storage.nbytes


class Projections(nn.Module):
    """An attention's q, k and v projections: one call where specchat stacked them into one
    quantized layer (`quantized.share_projections`), three otherwise."""

    def __init__(self, attention_module: nn.Module):
        super().__init__()
        q = attention_module.q_proj
        self.stacked = q.stacked if isinstance(q, SharedProjection) else None
        if self.stacked is None:
            self.q, self.k, self.v = q, attention_module.k_proj, attention_module.v_proj
        else:
            self.sizes = [part.columns.stop - part.columns.start for part in
                          (q, attention_module.k_proj, attention_module.v_proj)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.stacked is None:
            return self.q(x), self.k(x), self.v(x)
        return self.stacked(x).split(self.sizes, dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers' Llama applies it (rotate_half, in x's dtype)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def own(t: torch.Tensor) -> torch.Tensor:
    """`t` as an inference tensor of its own: a compiled graph's guards tell views (they check the
    base's size) and tensors made outside inference mode from the rest, and would compile again."""
    return t if t._base is None and t.is_inference() else t.clone()


class DecoderForward:
    """The forward pass of a loaded Llama-family causal LM's decoder, eager or compiled."""

    def __init__(self, model: nn.Module, compile: bool = False):
        config = model.config.get_text_config()
        decoder = model.get_decoder()
        self.embed_tokens, self.layers, self.norm = decoder.embed_tokens, decoder.layers, decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.projections = [Projections(layer.self_attn) for layer in self.layers]
        self.scaling = self.layers[0].self_attn.scaling
        self.activation = getattr(config, "hidden_act", None)
        # Qwen3 normalizes each head's query and key before the rotation
        self.normalizes_heads = hasattr(self.layers[0].self_attn, "q_norm")
        embedding = self.embed_tokens.weight
        self.dtype, self.device = embedding.dtype, embedding.device
        self.compiled = compile
        if compile:
            woq_kernel.prepare_compiling()
        # One decoder layer is compiled, not the whole forward: every layer runs the same graphs (its
        # modules' weights and its part of the caches are their inputs), which compile in a layer's
        # time rather than the whole depth's (the whole 24-layer forward was still compiling its first
        # step shapes after 150 s on an H200's host, 2026-11-26; on two CPU cores a runtime check's
        # compiling fell from ~200 s to ~20 s). dynamic: the cached length and the number of new tokens
        # vary every call, so one graph serves them all (a first prefill, one token, several tokens).
        self._layer_step = torch.compile(self._layer, fullgraph=True, dynamic=True) if compile else self._layer
        # Quantized layers on a CPU: the whole forward as one call into the kernel's extension.
        self.fused = None if cpu_decoder.unfused_reason(self) else cpu_decoder.build(self)

    def new_cache(self, capacity: int | None = None) -> LayerKV:
        return LayerKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

    def __call__(self, input_ids: torch.Tensor, cache: LayerKV, positions: torch.Tensor | None,
                 mask: torch.Tensor | None, feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final normed hidden states [n, hidden] of `input_ids` [1, n] on top of `cache` (which
        it extends by n), and the hidden states `feature_layers` names (0 = embeddings, i = output
        of layer i - 1; the last layer's index gives the final normed state)."""
        start, n = cache.length, input_ids.shape[1]
        keys, values = cache.reserve(start + n)
        if positions is None:
            positions = torch.arange(start, start + n, device=input_ids.device)[None]
        if self.fused is not None and (mask is None or mask.dtype == torch.bool):
            return self._fused(input_ids, cache, positions, mask, feature_layers)
        if mask is None and (self.compiled or n > 1):  # compiled: always a mask, so one graph serves
            mask = causal_mask(start, n, input_ids.device)  # plain and tree steps; eager one-token steps need none
        if self.compiled:
            input_ids, positions, mask = map(own, (input_ids, positions, mask))
        final, hidden = self._forward(input_ids, positions, mask, keys, values, start)
        cache.extend(n)
        return final, [hidden[i] for i in feature_layers]

    def _fused(self, input_ids, cache: LayerKV, positions, mask, feature_layers):
        """`__call__` in one call into the extension. The engine's masks show every new row the whole
        cached prefix (`verify_inputs`, `causal_mask`): only their part over the new rows is passed."""
        start, n = cache.length, input_ids.shape[1]
        keys, values = cache.storage.buffers
        block = None if mask is None else mask[0, 0, :, start:].contiguous()
        final, features = self.fused.forward(*self.fused_inputs(input_ids, positions), keys, values, start, block,
                                             list(feature_layers))
        cache.extend(n)
        return final, features

    def fused_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the extension's `Decoder` takes of `input_ids` [1, n] at `positions` [1, n]: the embedded
        tokens [n, H] and their rotary angles cos and sin [n, d] (each row its own)."""
        x = self.embed_tokens(input_ids)[0]
        cos, sin = self.rotary_emb(x, positions)
        return x, cos[0], sin[0]

    def at(self, input_ids: torch.Tensor, cache: LayerKV, positions: torch.Tensor, mask: torch.Tensor,
           slots: torch.Tensor, span: int, feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The fixed envelope's forward: `input_ids` [1, n] at `positions` [1, n], their entries written
        to `slots` [n] (a device tensor), attending over the first `span` positions as `mask`
        [1, 1, n, span] allows. The cache's length is the caller's to set. The envelope captures
        whole steps, this forward among them: compiled, as inductor's fused kernels."""
        keys, values = cache.storage.buffers
        if self.compiled:
            input_ids, positions, mask, slots = map(own, (input_ids, positions, mask, slots))
        final, hidden = self._forward(input_ids, positions, mask, keys, values, slots, span)
        return final, [hidden[i] for i in feature_layers]

    def _forward(self, input_ids, positions, mask, keys, values, start, span: int | None = None):
        """The final normed state and every feature a drafter may ask for (index i as in `__call__`):
        all of them, rather than the ones asked for, so that no drafter's choice makes another graph.

        `start` is where the new entries go: an int (the next `n` positions, attending over the first
        `start + n`), or a tensor of slots with the attended `span` given (the fixed envelope)."""
        x = self.embed_tokens(input_ids)  # [1, n, hidden]
        cos, sin = self.rotary_emb(x, positions)  # [1, n, d]
        cos, sin = cos[:, None], sin[:, None]
        hidden = []
        for index, layer in enumerate(self.layers):
            hidden.append(x[0])  # the input of layer i is feature i
            x = self._layer_step(layer, self.projections[index], x, cos, sin, mask, keys[index], values[index], start,
                                 span)
        final = self.norm(x)[0]
        return final, hidden + [final]

    def _layer(self, layer, projections, x, cos, sin, mask, keys, values, start, span):
        """One decoder layer: attention (writing the new keys and values into this layer's `keys` and
        `values` [kv_heads, capacity, d]) and MLP."""
        x = x + self._attention(layer, projections, layer.input_layernorm(x), cos, sin, mask, keys, values, start, span)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _attention(self, layer, projections, x, cos, sin, mask, keys, values, start, span):
        module = layer.self_attn
        n = x.shape[1]
        q, k, v = projections(x)
        q = q.view(1, n, self.heads, self.head_dim)
        k = k.view(1, n, self.kv_heads, self.head_dim)
        if self.normalizes_heads:
            q, k = module.q_norm(q), module.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if span is None:  # the growing cache: the next n positions
            span = start + n
            keys[:, start:span] = k[0]
            values[:, start:span] = v[0]
        else:  # the fixed envelope: slots on the device
            keys.index_copy_(1, start, k[0])
            values.index_copy_(1, start, v[0])
        out = attention(q, keys[None, :, :span], values[None, :, :span], mask, self.scaling)  # [1, heads, n, d]
        return module.o_proj(out.transpose(1, 2).reshape(1, n, self.heads * self.head_dim))
