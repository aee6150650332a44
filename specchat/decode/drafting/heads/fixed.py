"""The head on the fixed layout (CUDA, captured steps): its cache has a fixed capacity
(`drafters.cache.FixedHeadCache`); the context pass runs at depth + 1 rows from slots the host's
counts give (`consumed`, `pending`), a tree's entries sit after them and are overwritten next cycle;
the head drafts to its full depth, DEAGLE's vote dropping the levels after it; selection and lookup
merging run on the device. The features and tokens of committed positions never leave the device;
prompts go through the head eagerly, in the first cycle's `prepare`. A captured step may not read
the host, hence one shape every cycle.
"""

from __future__ import annotations

import torch

from drafters import DraftHead
from drafters.cache import FixedHeadCache
from specchat.decode.drafting.heads.proposer import PROMPT_CHUNK, HeadProposer
from specchat.decode.drafting.selection import LOOKUP_BRANCHES, LOOKUP_TOKENS, merge_lookup, select_fixed
from specchat.decode.drafting.growth import CandidateTable, Growth
from specchat.decode.drafting.shapes import DynamicTree, StaticTree, tree_budget
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.runtime.envelope import MAX_TREE_ROWS, HostInputs, Window, pick, window_mask
from specchat.decode.runtime.target import Target


class FixedHead(HeadProposer):
    """The head in a fixed-capacity cache, its trees selected on the device (see the module docstring):
    one budget every cycle, the largest tree the envelope verifies, whatever the room (acceptance stops
    at the room instead)."""

    described = ", fixed-shape steps"
    lookup_tree = False  # LOOKUP_BRANCHES chains with distinct first tokens: the draft step merges them
    longest_lookup = LOOKUP_TOKENS  # each chain's rows in the bucket
    paced = False  # it verifies a whole bucket every step

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options):
        super().__init__(head, target, shape, **options)
        self.envelope = envelope = target.envelope
        self.keep, self.head_depth = tree_budget(shape, MAX_TREE_ROWS, MAX_TREE_ROWS - 1)
        self.depth = max(self.head_depth, self.lookup_tokens)  # the deepest node (a lookup chain's)
        self.rows = self.depth + 1  # positions a cycle commits at most: the context pass's rows
        self.reach = self.rows + shape.entries(self.head_depth)  # head entries past the context
        self.cache = FixedHeadCache(envelope.capacity + self.reach)
        # With the target's forward compiled (`--compile on`), the head's layer is too: its steps are
        # captured alike, and its draft levels are as many small kernels as a target step's layers.
        self.layer = torch.compile(head, dynamic=True) if target.compiled else head
        self.layer_both = torch.compile(head.forward_both, dynamic=True) if target.compiled else head.forward_both
        device = next(head.parameters()).device
        self.inputs = HostInputs(device, consumed=(), pending=())
        self.pending_features: torch.Tensor | None = None  # [rows, F], allocated at the first prompt
        self.pending_tokens = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.consumed = self.pending = 0  # host copies: committed entries; committed positions not yet fed
        self.waiting: list[tuple[list[int], torch.Tensor]] = []  # prompt rows not yet fed (tokens, features)
        self.context_end, self.span = None, 0  # this draft step's: where the committed entries end, its window
        if self.lookup is not None:
            shape = (LOOKUP_BRANCHES, self.lookup_tokens)
            self.lookups = HostInputs(device, tokens=shape, lengths=LOOKUP_BRANCHES, evidence=shape)
            self.accept = HostInputs(device, torch.float32, rates=shape)

    def rewind_cache(self, length: int) -> int:
        keep = max(0, min(self.consumed, length - 1))  # entry j also used token j + 1
        if keep < self.consumed:
            self.consumed, self.pending, self.waiting = keep, 0, []
        rows = max(0, length - self.consumed)
        self.pending = min(self.pending, rows)
        waiting, left = [], rows - self.pending
        for tokens, features in self.waiting:
            if left > 0:
                waiting.append((tokens[:left], features[:left]))
            left -= len(tokens)
        self.waiting = waiting
        return self.consumed + self.pending + sum(len(tokens) for tokens, _ in self.waiting)

    def pend(self, tokens: list[int], features: torch.Tensor) -> None:
        self.waiting.append((list(tokens), features))

    def budget(self, max_depth: int, max_nodes: int) -> int:
        if self.waiting:
            self._feed_prompt()
        self.inputs.write(consumed=self.consumed, pending=self.pending)
        return self.envelope.rows_for(self.keep + 1) - 1

    def _feed_prompt(self) -> None:
        """Feed every committed position but the newest through the head (eagerly, in chunks); the
        newest stays pending: the cycle's context pass pairs it with the root."""
        pending = [(self.pending_tokens[: self.pending], self.pending_features[: self.pending])] if self.pending else []
        waiting = [(torch.tensor(tokens, device=self.pending_tokens.device), rows) for tokens, rows in self.waiting]
        tokens, features = (torch.cat(parts) for parts in zip(*pending, *waiting))
        if self.pending_features is None:
            self.pending_features = features.new_zeros(self.rows, features.shape[1])
        for begin in range(0, len(tokens) - 1, PROMPT_CHUNK):
            end = min(begin + PROMPT_CHUNK, len(tokens) - 1)
            window = Window.prompt(self.envelope, self.consumed, end - begin, tokens.device)
            self.head(window.pad(features[begin:end]), window.pad(tokens[begin + 1 : end + 1]), window.slots,
                      window.mask, self.cache.at(window.slots, window.span))
            self.consumed += end - begin
        self.pending_features[0], self.pending_tokens[0] = features[-1], tokens[-1]
        self.pending, self.waiting = 1, []

    def chains(self) -> None:
        """The cycle's lookup chains, for the draft step to merge (a missing token's rate 1: its log is 0, never NaN)."""
        matches = self.matches
        self.lookups.write(tokens=[match.tokens for match in matches], lengths=[len(match.tokens) for match in matches],
                           evidence=[evidences for _, evidences, _ in self.along])
        rates = [accepts + [1.0] * (self.lookup_tokens - len(accepts)) for accepts, _, _ in self.along]
        self.accept.write(rates=rates + [[1.0] * self.lookup_tokens] * (LOOKUP_BRANCHES - len(matches)))

    def context_pass(self, root: torch.Tensor, span: int) -> torch.Tensor:
        """The pending positions through the head (at its fixed rows); the output that predicts the root's children."""
        consumed, count = self.inputs.consumed, self.inputs.pending
        window = Window.causal(consumed, self.rows, span)
        rows = torch.arange(self.rows, device=root.device)
        next_tokens = torch.where(rows == count - 1, root, self.pending_tokens.roll(-1))
        out = self.layer(self.pending_features, next_tokens, window.slots, window.mask,
                         self.cache.at(window.slots, span))
        self.context_end, self.span = consumed + count, span
        return pick(out, count - 1)

    def grow(self, root_hidden: torch.Tensor) -> CandidateTable:
        return self.shape.grow(self, root_hidden, self.head_depth, self.keep)

    def select(self, table: CandidateTable) -> DraftTree:
        if self.lookup is not None:
            lookups = self.lookups
            table = merge_lookup(table, lookups.tokens, lookups.lengths, self.accept.rates.log(), self.head_depth,
                                 lookups.evidence)
        return select_fixed(table, self.keep, self.depth)

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        m = len(tokens)
        base = self.inputs.consumed + self.rows
        slots = base + first_entry + torch.arange(m, device=tokens.device)
        mask = window_mask(entries, self.context_end, base, self.span)
        positions = (self.context_end - 1 + level).expand(m)
        window = self.cache.at(slots, self.span)
        if both:
            return self.layer_both(hidden, tokens, positions, mask, window)
        return self.layer(hidden, tokens, positions, mask, window), None

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        growth.alive = ~fired if growth.alive is None else growth.alive & ~fired
        return False

    def commit(self, tree: DraftTree, acceptance, root: torch.Tensor, features: torch.Tensor) -> None:
        self.pending_features.copy_(features)
        self.pending_tokens.copy_(torch.cat([root, tree.tokens[acceptance.path]]))

    def confirm(self, tokens: list[int]) -> None:
        self.consumed += self.pending  # the cycle's context pass fed them
        self.pending = len(tokens)
