"""KV caches owned by the engine: they grow in place and are trimmed and compacted explicitly.

Speculative decoding appends a whole draft tree to the cache and then keeps only the accepted
path. With storage that has spare room, both follow-ups are cheap: trimming only moves a length,
and compaction copies the accepted entries down next to the committed prefix. Nothing else
changes the length of a cache, so whoever owns it always knows what it holds.

`KVCache` plugs into the transformers `Cache` API, so the stock Llama/Qwen2 modeling code writes
into it unchanged; the draft heads (`specchat.drafters`) use the same class for their own cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Room is added in multiples of this many positions, so decoding one token at a time
# reallocates only once every CHUNK tokens.
CHUNK = 256


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in buffers with spare room at the end.

    `keys`/`values` are views of the used part, which is what the transformers attention code
    reads; `capacity` is the size of the buffers behind them.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self._value_buffer = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        self.length = 0
        self.is_initialized = True
        self._refresh_views()

    @property
    def capacity(self) -> int:
        return self._key_buffer.shape[-2] if self.is_initialized else 0

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = -(-max(needed, 2 * self.capacity) // CHUNK) * CHUNK
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], new_capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        added = key_states.shape[-2]
        self._reserve(self.length + added)
        self._key_buffer[:, :, self.length : self.length + added] = key_states
        self._value_buffer[:, :, self.length : self.length + added] = value_states
        self.length += added
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def trim(self, length: int) -> None:
        if self.is_initialized and length < self.length:
            self.length = length
            self._refresh_views()

    def compact(self, start: int, keep: torch.Tensor) -> None:
        # The gather on the right-hand side copies before the write, so overlapping ranges are safe.
        for buffer in (self._key_buffer, self._value_buffer):
            buffer[:, :, start : start + keep.numel()] = buffer[:, :, start + keep]
        self.length = start + keep.numel()
        self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        self.trim(self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0
            self._refresh_views()


class KVCache(Cache):
    """A growable, trimmable cache for one sequence (batch size 1).

    The owner changes its length only through `trim` and `compact`; model forwards append to it.
    """

    def __init__(self):
        super().__init__(layer_class_to_replicate=GrowingLayer)

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def trim(self, length: int) -> None:
        """Keep the first `length` positions and drop the rest."""
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        for layer in self.layers:
            layer.trim(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus `start + keep` (in that order) and drop everything else.

        Args:
            start: the committed prefix, left untouched.
            keep: increasing offsets (a long tensor) into the entries after `start`.
        """
        assert keep.numel() == 0 or int(keep.max()) < self.length - start, "compaction index out of range"
        keep = keep.to(self.layers[0].device) if self.layers else keep
        for layer in self.layers:
            layer.compact(start, keep)

    def nbytes(self) -> int:
        return sum(
            layer._key_buffer.nbytes + layer._value_buffer.nbytes for layer in self.layers if layer.is_initialized
        )


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[1, 1, new, cached + new] (True = may attend): everything cached plus the causal triangle of the new positions."""
    mask = torch.ones(new, cached + new, dtype=torch.bool, device=device)
    mask[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return mask[None, None]
