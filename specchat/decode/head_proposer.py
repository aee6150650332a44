"""Drafting with a draft head on the host's engine: the head's cache kept in step with the context,
and the tree shapes (`specchat.decode.tree_shapes`) grown with it.

The head keeps its own KV cache. Entry j of it is the head's step on (the target's feature at
position j, the token at position j + 1), at RoPE position j, which is EAGLE's convention. After
the context pass over the newly committed positions, the last entry pairs the newest committed
feature with the root, and its output predicts the root's children. Tree nodes at depth d sit at
position (committed entries - 1 + d); their entries are appended while the tree grows and
trimmed away afterwards, since only committed context belongs in the cache.

With a lookup source (hybrid drafting), the head's candidates are joined by lookup continuations
(`specchat.decode.hybrid`). The fixed envelope's head drafter is `specchat.decode.fixed_heads`.
"""

from __future__ import annotations

import time

import torch

from drafters import DraftHead
from drafters.cache import HeadCache
from specchat.decode.cache import causal_mask
from specchat.decode.calibrate import Curve
from specchat.decode.engine import GenerationSettings
from specchat.decode.hybrid import LOOKUP_BRANCHES, LOOKUP_TOKENS, Candidates, HeadTrust, LookupRates
from specchat.decode.lookup import LookupSource
from specchat.decode.tree import Cycle, DraftTree
from specchat.decode.tree_shapes import DynamicTree, Growth, HeadSteps, StaticTree


class TreeProposer:
    """Proposes draft trees of one shape with a draft head (see `drafters`)."""

    def __init__(self, head: DraftHead, num_target_layers: int, shape: StaticTree | DynamicTree,
                 lookup: LookupSource | None = None, curve: Curve | None = None, lookup_tokens: int = LOOKUP_TOKENS):
        """
        Args:
            lookup: also draft from text already seen (hybrid trees).
            curve: the verify-cost curve; with a lookup source, each cycle verifies the number of
                nodes that maximizes expected tokens per second (else the shape's budget).
            lookup_tokens: the longest lookup chain.
        """
        shape.check(head)
        self.head = head
        self.shape = shape
        self.lookup, self.curve, self.lookup_tokens = lookup, curve, lookup_tokens
        self.rates = LookupRates()
        self.trust = HeadTrust()
        self.feature_layers = head.feature_layers(num_target_layers)
        self.cache = HeadCache()
        self.consumed = 0  # cache entries of committed context pairs
        self.pending_features: list[torch.Tensor] = []  # target features from position `consumed` on
        self.pending_tokens: list[int] = []  # the tokens at those positions

    def describe(self) -> str:
        return self.shape.describe() + (", with lookup (hybrid)" if self.lookup is not None else "")

    # -- Proposer protocol -----------------------------------------------------------------

    def rewind(self, length: int) -> int:
        if self.lookup is not None:
            self.lookup.rewind(length)
        keep = max(0, min(self.consumed, length - 1))  # entry j also used token j + 1, so j + 1 < length
        if keep < self.consumed:
            self.consumed = keep
            self.pending_features, self.pending_tokens = [], []
        else:
            n = max(0, length - self.consumed)
            rows = torch.cat(self.pending_features)[:n] if self.pending_features else None
            self.pending_features = [rows] if rows is not None and len(rows) else []
            self.pending_tokens = self.pending_tokens[:n]
        self.cache.trim(min(self.consumed, self.cache.length))
        return self.consumed + len(self.pending_tokens)

    def forget(self) -> None:
        if self.lookup is not None:  # the acceptance rates stay: they describe the head and the model, not the text
            self.lookup.forget()

    def observe(self, tokens: list[int], features: torch.Tensor, cycle: Cycle | None = None) -> None:
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            if cycle is not None:
                self.rates.learn(cycle)
                self.trust.learn(cycle)
        if self.curve is not None and cycle is not None and cycle.forward_seconds:
            self.curve.observe(len(cycle.tree) + 1, 1000 * cycle.forward_seconds)

    @torch.inference_mode()
    def propose(self, root: int, settings: GenerationSettings, rng, max_depth: int, max_nodes: int) -> DraftTree:
        started = time.perf_counter()
        keep, head_depth = self.shape.verified(max_nodes), max_depth
        trust = self.trust.factor() if self.lookup is not None and self.curve is not None else 1.0
        trusted = max(1, self.curve.best_total_tokens(trust) - 1) if trust < 1 else keep
        if trusted < keep:  # fewer of the head's drafts survive than it is sure of (sampling): a smaller
            keep, head_depth = trusted, min(max_depth, trusted + 1)  # tree, drafted one level past it at most
        root_hidden = self._context_pass(root)
        try:
            table = self.shape.grow(HostSteps(self), root_hidden, head_depth, max_nodes)
        finally:
            self.cache.trim(self.consumed)  # tree entries were scratch space
        candidates = Candidates.from_table(table, self.shape.trace(table))
        if self.lookup is None:
            return candidates.select(keep)
        heads_tree = candidates.best(keep)  # what `--lookup off` verifies (at full trust): it stays whole, lookup only adds
        looked_up = time.perf_counter()
        for match in self.lookup.matches(root, min(self.lookup_tokens, max_depth), LOOKUP_BRANCHES):
            candidates.add_chain(match.tokens, self.rates.estimate(match.evidence), match.evidence)
        lookup_seconds = time.perf_counter() - looked_up
        if self.curve is None:
            tree = candidates.select(keep)
        else:
            drafting_ms = 1000 * (time.perf_counter() - started)
            tree = candidates.select_for_rate(self.curve, drafting_ms, max_nodes, kept=heads_tree, head_trust=trust)
        tree.lookup_seconds, tree.head_trust = lookup_seconds, trust
        return tree

    def _context_pass(self, root: int) -> torch.Tensor:
        """Feed the pending (feature, next token) pairs; return the output that predicts the root's children."""
        features = torch.cat(self.pending_features)
        count = len(self.pending_tokens)
        next_tokens = torch.tensor(self.pending_tokens[1:] + [root], device=features.device)
        positions = torch.arange(self.consumed, self.consumed + count, device=features.device)
        out = self.head(features, next_tokens, positions, causal_mask(self.consumed, count, features.device), self.cache)
        self.consumed += count
        self.pending_features, self.pending_tokens = [], []
        return out[-1]


class HostSteps(HeadSteps):
    """The head's steps for the host's drafter (`tree_shapes.HeadSteps`): a tree's entries are
    appended to the head's growing cache, in feeding order, and DEAGLE's vote is read and obeyed."""

    def __init__(self, proposer: TreeProposer):
        super().__init__(proposer.head)
        self.proposer = proposer

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        p = self.proposer
        m = len(tokens)
        assert p.cache.length == p.consumed + first_entry, "tree entries are appended in feeding order"
        context = torch.ones(m, p.consumed, dtype=torch.bool, device=tokens.device)
        mask = torch.cat([context, entries[:, : first_entry + m]], dim=1)[None, None]
        positions = torch.full((m,), p.consumed - 1 + level, device=tokens.device)
        if both:
            return p.head.forward_both(hidden, tokens, positions, mask, p.cache)
        return p.head(hidden, tokens, positions, mask, p.cache), None

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        return bool(fired)
