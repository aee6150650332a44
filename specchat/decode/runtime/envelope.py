"""The fixed layout's envelope: decoding steps whose shapes never change, so that a GPU can replay them.

A small model's decoding step on a GPU is launch-bound: hundreds of kernels of microseconds each,
with Python between them (the 0.5B ran at ~25 tok/s eager on an H100, docs/bench-gpu). A CUDA
graph replays a whole step in one launch, but only a step whose shapes and addresses are fixed
and which never waits on the host. So, on the fixed envelope:

- the target's KV cache is allocated once at its capacity, and a step attends over a *span* of it
  (a few sizes: powers of two) with the valid positions given by the mask; the context length
  reaches the step as a tensor;
- a verify forward runs at a *bucket* of rows (powers of two): a tree is padded to its bucket with
  invalid nodes that nothing may accept (`specchat.decode.drafting.tree.DraftTree.valid`);
- the tree is built, verified and accepted on the device, and the accepted path is compacted in
  the cache there; the host reads one record per cycle (the accepted ids, with the tree for the
  statistics) and nothing else;
- what the host tells a step reaches it as `HostInputs`, declared fields the step reads as tensors.

Everything here works on any device (the tests run it on a CPU); `specchat.decode.runtime.graphs`
captures the steps on CUDA and `specchat.decode.engine.fixed` drives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SMALLEST_SPAN = 256  # attention windows: powers of two from here to the capacity
LARGEST_BUCKET = 512  # rows in one forward: a prefill chunk at most (see PREFILL_CHUNK)
MAX_TREE_ROWS = 256  # a verified tree (root included) fits the bucket below this
KV_MEMORY_SHARE = 0.25  # on CUDA the target's cache takes at most this share of the free memory


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (high,)


@dataclass(frozen=True)
class Envelope:
    """The shapes every step takes: its rows (`buckets`) and attention window (`spans`)."""

    capacity: int  # positions the target's cache holds
    buckets: tuple[int, ...] = powers_of_two(1, LARGEST_BUCKET)
    spans: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.spans:
            object.__setattr__(self, "spans", powers_of_two(min(SMALLEST_SPAN, self.capacity), self.capacity))

    @classmethod
    def for_target(cls, max_context: int, bytes_per_position: int, free_bytes: int | None) -> Envelope:
        """Room for the model's whole context and a step's rows past it, unless the device's free
        memory (`free_bytes`, None on a CPU) holds less: then as much as KV_MEMORY_SHARE of it."""
        capacity = max_context + LARGEST_BUCKET
        if free_bytes is not None:
            capacity = min(capacity, int(free_bytes * KV_MEMORY_SHARE) // bytes_per_position)
        if capacity < 2 * LARGEST_BUCKET:
            raise ValueError(f"room for {capacity} positions is too little for the fixed envelope")
        return cls(capacity)

    @property
    def max_context(self) -> int:
        """The longest context: a step's rows past it still fit."""
        return self.capacity - LARGEST_BUCKET

    def rows_for(self, rows: int) -> int:
        """The bucket a forward of `rows` rows is padded to."""
        for bucket in self.buckets:
            if bucket >= rows:
                return bucket
        raise ValueError(f"{rows} rows in one forward: the fixed envelope takes at most {self.buckets[-1]}")

    def span_for(self, positions: int) -> int:
        """The attention window that covers the first `positions` positions."""
        for span in self.spans:
            if span >= positions:
                return span
        raise ValueError(f"{positions} positions: the cache holds {self.capacity}")


class Fields:
    """A record's declaration: named fields of fixed shapes, laid end to end in one flat buffer."""

    def __init__(self, **shapes: int | tuple[int, ...]):
        self.shapes = {name: shape if isinstance(shape, tuple) else (shape,) for name, shape in shapes.items()}
        self.slices, offset = {}, 0
        for name, shape in self.shapes.items():
            self.slices[name] = slice(offset, offset + math.prod(shape))
            offset += math.prod(shape)
        self.size = offset

    def split(self, flat) -> dict:
        """Each field's part of `flat` (a tensor or array: views in the field's shape; a list: flat slices)."""
        if isinstance(flat, list):
            return {name: flat[part] for name, part in self.slices.items()}
        return {name: flat[part].reshape(self.shapes[name]) for name, part in self.slices.items()}


class HostInputs:
    """Values the host writes before a step and the step reads as device tensors (a field of shape ()
    as a 0-d one), declared as `Fields`: one copy from pinned memory, queued without waiting (the
    step that reads them runs after it)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long, **shapes: int | tuple[int, ...]):
        self.fields = Fields(**shapes)
        self.host = torch.zeros(self.fields.size, dtype=dtype, pin_memory=device.type == "cuda")
        self.device = torch.zeros(self.fields.size, dtype=dtype, device=device)
        self.values = self.fields.split(self.host.numpy())  # writes here touch no tensor operation
        self.views = self.fields.split(self.device)

    def write(self, **values) -> None:
        """Set the named fields and queue the copy: a number, or a (nested) list that fills a field from
        its start (what it leaves keeps 0)."""
        for name, value in values.items():
            _fill(self.values[name], value)
        self.device.copy_(self.host, non_blocking=True)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["views"][name]
        except KeyError:
            raise AttributeError(name) from None


def _fill(field, value) -> None:
    if field.ndim == 0 or not isinstance(value, (list, tuple)):
        field[...] = value
        return
    field[...] = 0
    if field.ndim == 1:
        field[: len(value)] = value
    else:
        for row, part in zip(field, value):
            _fill(row, part)


def pick(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t[index]` for a 0-d index tensor, on the device: plain indexing reads such an index on the
    host (an `item()`) when the tensor is on a CPU."""
    return t.index_select(0, index.reshape(1))[0]


def window_mask(block: torch.Tensor, context: torch.Tensor, offset: torch.Tensor, span: int) -> torch.Tensor:
    """[1, 1, m, span] (True = may attend) for m rows of one step: every position before `context`,
    and in the `block.shape[1]` positions from `offset` on, those `block` [m, w] marks.

    `context` and `offset` are 0-d tensors: the step's shapes do not depend on them."""
    m, width = block.shape
    relative = torch.arange(span, device=block.device) - offset
    inside = (relative >= 0) & (relative < width)
    marked = block[:, relative.clamp(0, width - 1)] & inside
    before = torch.arange(span, device=block.device) < context
    return (before | marked)[None, None]


@dataclass
class Window:
    """Where a step's new rows go in a fixed-capacity cache and what they see: each row at slot (and
    position) `at` + row, seeing the positions before `at` and the new rows up to itself, in an
    attention window of `span` positions. Every padded-window forward of the fixed layout takes one."""

    slots: torch.Tensor  # [rows]
    mask: torch.Tensor  # [1, 1, rows, span]
    span: int

    @classmethod
    def causal(cls, at: torch.Tensor, rows: int, span: int) -> Window:
        """`at` a 0-d device tensor: the step's shapes do not depend on it."""
        block = torch.ones(rows, rows, dtype=torch.bool, device=at.device).tril()
        return cls(at + torch.arange(rows, device=at.device), window_mask(block, at, at, span), span)

    @classmethod
    def prompt(cls, envelope: Envelope, at: int, count: int, device) -> Window:
        """`count` prompt rows from position `at` (eager, not captured), padded to their bucket."""
        rows = envelope.rows_for(count)
        return cls.causal(torch.tensor(at, device=device), rows, envelope.span_for(at + rows))

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [count, ...] with zero rows appended up to the window's."""
        if len(rows) == len(self.slots):
            return rows
        return torch.cat([rows, rows.new_zeros(len(self.slots) - len(rows), *rows.shape[1:])])

    def forward(self, model, ids: torch.Tensor, cache, **options):
        """`model.forward_at` (a `Target`) on `ids` [rows] in this window; `options`: logits_for, feature_layers."""
        return model.forward_at(self.pad(ids)[None], cache, positions=self.slots[None], slots=self.slots,
                                span=self.span, mask=self.mask, **options)
