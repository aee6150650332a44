"""The target's KV cache for transformers' forward (`Target` over a model specchat's own forward
does not compute): `drafters.cache`'s growing storage behind transformers' `Cache` API.

The engine owns it and changes its length only through `trim` and `compact` (the rule is
`drafters.cache`'s: spare room at the end, so trimming moves a length and compaction copies the
accepted path down); the stock modeling code appends to it unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from drafters.cache import GrowingKV


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword `model.forward` (and so `generate`) takes its cache by: `cache` from transformers 5.24,
    `past_key_values` before (5.24 warns on it, 5.40 removes it; the GPU image has 5.17)."""
    return _cache_argument(type(model))


@functools.cache
def _cache_argument(model_class: type) -> str:  # (a signature read once per class, not per forward)
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class GrowingLayer(DynamicLayer):
    """One layer's keys and values as transformers reads them, stored in a `GrowingKV`."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.storage = GrowingKV()
        self.is_initialized = True

    @property
    def length(self) -> int:
        return self.storage.length if self.is_initialized else 0

    @property
    def capacity(self) -> int:
        return self.storage.capacity if self.is_initialized else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.storage.append(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def _sync(self) -> None:
        self.keys, self.values = self.storage.keys, self.storage.values

    def trim(self, length: int) -> None:
        if self.is_initialized:
            self.storage.trim(length)
            self._sync()

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.storage.compact(start, keep)
        self._sync()

    def crop(self, tokens_to_remove: int) -> None:
        self.trim(self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.trim(0)


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
        return sum(layer.storage.nbytes for layer in self.layers if layer.is_initialized)
