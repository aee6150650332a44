"""The fixed envelope: decoding steps whose shapes never change, so that a GPU can replay them.

A small model's decoding step on a GPU is launch-bound: hundreds of kernels of microseconds each,
with Python between them (the 0.5B ran at ~25 tok/s eager on an H100, docs/bench-gpu). A CUDA
graph replays a whole step in one launch, but only a step whose shapes and addresses are fixed
and which never waits on the host. So, on the fixed envelope:

- the target's KV cache is allocated once at its capacity, and a step attends over a *span* of it
  (a few sizes: powers of two) with the valid positions given by the mask; the context length
  reaches the step as a tensor;
- a verify forward runs at a *bucket* of rows (powers of two): a tree is padded to its bucket with
  invalid nodes that nothing may accept (`FixedTree`);
- the tree is built, verified and accepted on the device, and the accepted path is compacted in
  the cache there; the host reads one record per cycle (the accepted ids, with the tree for the
  statistics) and nothing else.

Everything here works on any device (the tests run it on a CPU); `specchat.decode.graphs`
captures the steps on CUDA and `specchat.decode.fixed_engine` drives them.
"""

from __future__ import annotations

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


class HostInputs:
    """Integers the host writes before a step and the step reads as 0-d device tensors: one copy
    from pinned memory, queued without waiting (the step that reads them runs after it)."""

    def __init__(self, device: torch.device, *names: str, dtype: torch.dtype = torch.long):
        self.index = {name: i for i, name in enumerate(names)}
        self.host = torch.zeros(len(names), dtype=dtype, pin_memory=device.type == "cuda")
        self.device = torch.zeros(len(names), dtype=dtype, device=device)
        self.values = self.host.numpy()  # writes here touch no tensor operation

    def write(self, **values: float) -> None:
        for name, value in values.items():
            self.values[self.index[name]] = value
        self.device.copy_(self.host, non_blocking=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device[self.index[name]]


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


def causal_block(rows: int, device) -> torch.Tensor:
    return torch.ones(rows, rows, dtype=torch.bool, device=device).tril()


@dataclass
class FixedTree:
    """A draft tree of a fixed number of nodes, on the device, parents before children.

    Padding nodes (and nodes a drafter could not fill) are invalid: they are verified with the rest
    but never accepted. Acceptance also stops at `limit` (a 0-d tensor: the reply's room), so a
    tree never needs to change shape near the end of a reply.

    Attributes:
        tokens, parents, depths: as `specchat.decode.tree.DraftTree`'s (parent -1: the root's child).
        valid: [n] bool.
        probs: [n] the draft's probability of each node given its parent (records, /tree).
        depth: no node is deeper (static: the length of the accepted-path record).
        sources: [n] `specchat.decode.tree.Source` codes (hybrid trees), or None: all the drafter's own.
        evidence: [n] with `sources`, the strength of the lookup match behind each node (0: none).
        q: [n, vocab] the distributions a sampled chain was drawn from (sps), or None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    probs: torch.Tensor
    depth: int
    sources: torch.Tensor | None = None
    evidence: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def chain(cls, tokens: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor | None = None,
              q: torch.Tensor | None = None) -> FixedTree:
        n, device = tokens.shape[0], tokens.device
        return cls(tokens, torch.arange(-1, n - 1, device=device), torch.arange(1, n + 1, device=device), valid,
                   torch.ones(n, device=device) if probs is None else probs, n, q=q)

    def padded(self, nodes: int) -> FixedTree:
        """The same tree with invalid nodes appended up to `nodes` (children of the root, token 0)."""
        extra = nodes - len(self)
        if extra == 0:
            return self
        assert extra > 0, "a tree is padded to at least its size"
        device = self.tokens.device

        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([t, torch.full((extra,), fill, dtype=t.dtype, device=device)])

        return FixedTree(grow(self.tokens, 0), grow(self.parents, -1), grow(self.depths, 1), grow(self.valid, False),
                         grow(self.probs, 0.0), self.depth, None if self.sources is None else grow(self.sources, 0),
                         None if self.evidence is None else grow(self.evidence, 0),
                         None if self.q is None else torch.cat([self.q, self.q.new_zeros(extra, self.q.shape[1])]))

    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: row i marks node i and its ancestors (a fixed number of steps, no host read)."""
        n, device = len(self), self.tokens.device
        marks = torch.eye(n, dtype=torch.bool, device=device)
        current = self.parents
        for _ in range(self.depth - 1):
            has_parent = current >= 0
            marks |= torch.nn.functional.one_hot(current.clamp(min=0), n).bool() & has_parent[:, None]
            current = torch.where(has_parent, self.parents[current.clamp(min=0)], current)
        return marks

    def earlier_siblings(self) -> torch.Tensor:
        """[n, n] bool: row i marks the siblings stored before node i (tried before it)."""
        n, device = len(self), self.tokens.device
        before = torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal=-1)
        return before & (self.parents[:, None] == self.parents[None, :])


def verify_rows(tree: FixedTree, root: torch.Tensor, length: torch.Tensor, span: int, ancestors: torch.Tensor):
    """The target forward's inputs for verifying `tree` after `root` ([1]) at context `length`:
    ids, positions [1, n + 1], mask [1, 1, n + 1, span] and the cache slots [n + 1] they go to.
    Row 0 is the root, row i + 1 node i (as `specchat.decode.verify.verify_inputs`); `ancestors` is
    `tree.ancestors()`."""
    n, device = len(tree), root.device
    ids = torch.cat([root, tree.tokens])[None]
    positions = (length + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths]))[None]
    block = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    block[:, 0].fill_(True)  # (assigning a Python value makes a host tensor of it first: not in a step)
    block[1:, 1:] = ancestors
    slots = length + torch.arange(n + 1, device=device)
    return ids, positions, window_mask(block, length, length, span), slots
