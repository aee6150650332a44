"""KV storage that grows in place and is trimmed and compacted explicitly: the rule every cache follows.

Speculative decoding appends a whole draft tree to a cache and then keeps only the accepted path.
With storage that has spare room, both follow-ups are cheap: trimming only moves a length, and
compaction copies the accepted entries down next to the committed prefix. Nothing else changes
the length of a cache, so whoever owns it always knows what it holds.

`GrowingKV` is one layer's keys and values; `HeadCache` is a draft head's cache, one `GrowingKV`
per layer, which also attends. specchat's target cache wraps the same storage in transformers'
`Cache` API (`specchat.decode.runtime.cache`). `FixedHeadCache` is the head's cache for steps of fixed
shape (a CUDA graph replays them): allocated once, written at slots the step names, never trimmed;
its owner knows which entries count.
"""

from __future__ import annotations

import torch

from drafters.attention import attention

# Room is added in multiples of this many positions, so decoding one token at a time
# reallocates only once every CHUNK tokens.
CHUNK = 256


class GrowingKV:
    """One layer's keys and values [b, kv_heads, positions, d] in buffers with spare room at the end.

    `keys`/`values` are views of the used part; `capacity` is the size of the buffers behind them.
    """

    def __init__(self):
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self.keys = self.values = None

    @property
    def capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def _refresh_views(self) -> None:
        self.keys = self._key_buffer[:, :, : self.length]
        self.values = self._value_buffer[:, :, : self.length]

    def reserve(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        """Room for `needed` positions of entries shaped like `keys`/`values` ([b, kv_heads, *, d])."""
        if self._key_buffer is None:
            self._key_buffer = keys.new_empty((*keys.shape[:2], 0, keys.shape[3]))
            self._value_buffer = values.new_empty((*values.shape[:2], 0, values.shape[3]))
        if needed <= self.capacity:
            return
        new_capacity = -(-max(needed, 2 * self.capacity) // CHUNK) * CHUNK
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], new_capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add positions at the end; returns every key and value held."""
        added = keys.shape[-2]
        self.reserve(keys, values, self.length + added)
        self._key_buffer[:, :, self.length : self.length + added] = keys
        self._value_buffer[:, :, self.length : self.length + added] = values
        self.length += added
        self._refresh_views()
        return self.keys, self.values

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, for a forward that writes new entries in place (`extend`)."""
        return self._key_buffer, self._value_buffer

    def extend(self, added: int) -> None:
        """The next `added` positions were written into `buffers` in place (room `reserve`d first)."""
        assert self.length + added <= self.capacity, "extend past the reserved room"
        self.length += added
        self._refresh_views()

    def trim(self, length: int) -> None:
        """Keep the first `length` positions."""
        if self._key_buffer is not None and length < self.length:
            self.length = length
            self._refresh_views()

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus `start + keep`, in that order."""
        if keep.device.type == "cpu":
            # Entries already in place stay (on a CPU reading `keep` costs nothing, a copy does): a tree's
            # first nodes are often the accepted path (a chain), and often none was accepted.
            positions = keep.tolist()
            in_place = next((i for i, position in enumerate(positions) if position != i), len(positions))
            start, keep = start + in_place, keep[in_place:] - in_place
        if keep.numel():  # the gather on the right-hand side copies before the write: overlapping ranges are safe
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[:, :, start : start + keep.numel()] = buffer[:, :, start + keep]
        self.length = start + keep.numel()
        self._refresh_views()

    @property
    def nbytes(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.nbytes + self._value_buffer.nbytes


class HeadCache:
    """A draft head's KV cache at inference: one `GrowingKV` per layer, and attention over it.

    The owner changes its length only through `trim` and `compact`; head forwards append to it.
    """

    def __init__(self):
        self.layers: list[GrowingKV] = []

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def attend(self, layer_idx: int, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        while len(self.layers) <= layer_idx:
            self.layers.append(GrowingKV())
        k, v = self.layers[layer_idx].append(k, v)
        return attention(q, k, v, mask)

    def trim(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        for layer in self.layers:
            layer.trim(length)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        assert keep.numel() == 0 or int(keep.max()) < self.length - start, "compaction index out of range"
        for layer in self.layers:
            layer.compact(start, keep.to(layer.keys.device))

    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class FixedHeadCache:
    """A draft head's KV cache at a fixed capacity, for steps whose shapes never change (CUDA graphs).

    A step writes its entries to slots it names (a device tensor) and attends over the first `span`
    positions as its mask allows, so neither the context length nor what was accepted is read on
    the host; the owner keeps track of which entries are valid.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def at(self, slots: torch.Tensor, span: int) -> _FixedWindow:
        """The key store for one head step: writes at `slots`, attends over [0, span)."""
        assert span <= self.capacity, f"a span of {span} past the capacity of {self.capacity}"
        return _FixedWindow(self, slots, span)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)


class _FixedWindow:
    def __init__(self, cache: FixedHeadCache, slots: torch.Tensor, span: int):
        self.cache, self.slots, self.span = cache, slots, span

    def attend(self, layer_idx: int, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        while len(cache.keys) <= layer_idx:  # the first step, eager, allocates (never a captured one)
            cache.keys.append(k.new_zeros((*k.shape[:2], cache.capacity, k.shape[3])))
            cache.values.append(v.new_zeros((*v.shape[:2], cache.capacity, v.shape[3])))
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        keys[0].index_copy_(1, self.slots, k[0])
        values[0].index_copy_(1, self.slots, v[0])
        return attention(q, keys[:, :, : self.span], values[:, :, : self.span], mask)
