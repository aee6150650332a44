"""The head on the growing layout (CPUs): its cache grows (`drafters.cache.HeadCache`); the context
pass feeds exactly the pending positions, a tree's entries are appended and trimmed away; DEAGLE's
vote stops drafting; the candidates are read once and selected on the host, by the verify-cost
curve where there is one, so that a CPU drafts and verifies only what pays at its cost.
"""

from __future__ import annotations

import time

import torch

from drafters import DraftHead
from drafters.cache import HeadCache
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.drafting.heads.proposer import LEVEL_DECAY, LEVEL_MS, HeadProposer
from specchat.decode.drafting.selection import GROWING_LOOKUP_TOKENS, Candidates
from specchat.decode.drafting.growth import CandidateTable, Growth, HostTable
from specchat.decode.drafting.shapes import DynamicTree, StaticTree, tree_budget
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.runtime.target import Target


class GrowingHead(HeadProposer):
    """The head with a growing cache, its trees selected on the host (see the module docstring)."""

    lookup_tree = True  # the host selection merges the paths
    reads_votes = True  # it stops drafting as soon as DEAGLE votes
    paced = True  # given a curve, a cycle may take a plain step or lookup alone (`Pace`)
    longest_lookup = GROWING_LOOKUP_TOKENS  # the rate rule verifies of a chain what pays

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options):
        super().__init__(head, target, shape, **options)
        self.cache = HeadCache()
        self.consumed = 0  # cache entries of committed context pairs
        self.pending_features: list[torch.Tensor] = []  # target features from position `consumed` on
        self.pending_tokens: list[int] = []  # the tokens at those positions
        # the positions the last pass fed, from `last_fed[0]` on: their features and tokens, which a
        # rewind into them needs to leave the newest kept position pending (`rewind_cache`)
        self.last_fed: tuple[int, torch.Tensor, list[int]] | None = None
        self.keep = self.depth = self.max_nodes = 0  # this cycle's budget
        self.head_trust = self.lookup_trust = 1.0  # this cycle's (`HeadTrust`, `ContradictedLookups`)
        self.level_ms = LEVEL_MS  # a draft level's cost, as measured (`narrow`)
        self.level_started: float | None = None
        self.last_read: tuple[CandidateTable, int, Candidates] | None = None  # (`read`)
        self.top_k = shape.most_children()  # what the fused context pass computes of the root's top-k

    def rewind_cache(self, length: int) -> int:
        keep = max(0, min(self.consumed, length - 1))  # entry j also used token j + 1, so j + 1 < length
        if keep < self.consumed:
            # Entry `keep` paired position keep's feature with a token that is no longer the next one,
            # but the feature itself still holds (the context up to it is kept): pending again, where
            # the last pass fed it, it pairs with the next root without a target forward to remake it
            # (staged drafting rewinds so whenever the target takes part of a chain).
            self.consumed = keep
            self.pending_features, self.pending_tokens = self._last_fed_at(keep) if keep < length else ([], [])
        else:
            n = max(0, length - self.consumed)
            rows = torch.cat(self.pending_features)[:n] if self.pending_features else None
            self.pending_features = [rows] if rows is not None and len(rows) else []
            self.pending_tokens = self.pending_tokens[:n]
        self.cache.trim(min(self.consumed, self.cache.length))
        return self.consumed + len(self.pending_tokens)

    def _last_fed_at(self, position: int) -> tuple[list[torch.Tensor], list[int]]:
        """Position `position`'s feature and token as the pending ones, where the last pass fed it; else none."""
        if self.last_fed is None or not self.last_fed[0] <= position < self.last_fed[0] + len(self.last_fed[2]):
            return [], []
        first, features, tokens = self.last_fed
        return [features[position - first : position - first + 1]], [tokens[position - first]]

    @torch.inference_mode()
    def pend(self, tokens: list[int], features: torch.Tensor) -> None:
        """A prompt's positions, fed through the head as the prompt is read (chunk by chunk), but the
        newest, which the cycle's context pass pairs with the root: their time is the reply's first
        token's, not its first cycle's, which the pace would weigh against the head for many cycles
        (a 1,100-token prompt's pass took 60-80 ms on the AVX2 path, four plain steps)."""
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)
        if len(self.pending_tokens) > 1:  # each but the newest, with the token after it
            self.feed_context(*self.take_pending(self.pending_tokens[1:]))

    def take_pending(self, next_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first len(`next_tokens`) pending positions, taken off the pending ones: their features,
        the tokens after them (`next_tokens`) and their positions, as the head's inputs."""
        count, pending = len(next_tokens), self.pending_features
        features = pending[0] if len(pending) == 1 else torch.cat(pending)
        self.last_fed = (self.consumed, features[:count], self.pending_tokens[:count])
        self.pending_features = [features[count:]] if count < len(features) else []
        self.pending_tokens = self.pending_tokens[count:]
        return (features[:count], torch.tensor(next_tokens, device=features.device),
                torch.arange(self.consumed, self.consumed + count, device=features.device))

    def feed_context(self, features: torch.Tensor, next_tokens: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """Committed positions into the head's cache after its `consumed` entries, the new rows seeing each
        other causally; returns the last row's output (the only one read)."""
        count = len(next_tokens)
        if self.fused is not None:
            out = self.fused.step(features, next_tokens, positions, self.cache, self.consumed, None, outputs=1)
        else:
            out = self.head(features, next_tokens, positions, causal_mask(self.consumed, count, features.device),
                            self.cache)
        self.consumed += count
        return out

    def commit(self, tree: DraftTree, acceptance, root: int, features: torch.Tensor) -> None:
        self.pending_features.append(features)

    def confirm(self, tokens: list[int]) -> None:
        self.pending_tokens.extend(tokens)

    def budget(self, max_depth: int, max_nodes: int) -> int:
        """This cycle's budget within the room: with a verify-cost curve the rate rules size the tree
        (`narrow`, `select`), within the shape's depth; else `tree_budget`. None without room for a
        draft token."""
        if max_depth < 1:
            return 0
        self.max_nodes = max_nodes
        if self.curve is not None:  # `keep`: the head's best node, verified every head cycle
            self.head_trust, self.lookup_trust = self.trust.factor(), self.contradicted.factor()
            self.keep, self.depth = 1, self.shape.depth_for(max_depth)
        else:
            self.head_trust = self.lookup_trust = 1.0
            self.keep, self.depth = tree_budget(self.shape, max_depth, max_nodes)
        return self.keep

    def chains(self) -> None:
        pass  # read where the candidates are selected (`select`)

    def context_pass(self, root: int, span: None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Feed the pending (feature, next token) pairs; return the output that predicts the root's
        children, with its top-k where the fused step computed them in the same call (else None)."""
        features, next_tokens, positions = self.take_pending(self.pending_tokens[1:] + [root])
        if self.fused is None or not self.shape.grows_on_host:
            return self.feed_context(features, next_tokens, positions)[-1], None
        # with its top-k, which the host growth reads
        out, logps, ids = self.fused.draft(features, next_tokens, positions, self.cache, self.consumed, None,
                                           outputs=1, k=self.top_k)
        self.consumed += len(next_tokens)
        return out[-1], (logps, ids)

    def grow(self, context: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]) -> CandidateTable | HostTable:
        """The shape's table from the context pass's output (and top-k), grown on host lists where the
        shape has that form (each level is read anyway)."""
        root_hidden, root_top = context
        try:
            if self.shape.grows_on_host:
                return self.shape.grow_on_host(self, root_hidden, self.depth, self.max_nodes, root_top)
            return self.shape.grow(self, root_hidden, self.depth, self.max_nodes)
        finally:
            self.cache.trim(self.consumed)  # tree entries were scratch space

    def narrow(self, growth: Growth, beam: torch.Tensor, depth: int) -> torch.Tensor:
        """`narrow_on_host` of a growth on tensors."""
        nodes = beam.tolist()
        kept = set(self.narrow_on_host(growth.table, nodes, depth))
        return beam[[row for row, node in enumerate(nodes) if node in kept]]

    def narrow_on_host(self, table: CandidateTable | HostTable, beam: list[int], depth: int) -> list[int]:
        """With a verify-cost curve, the beam nodes whose expansion is expected to pay: each one the
        cycle would verify now (`Candidates.rate_choice`) whose best child, expected to be accepted as
        often as the node was given its parent, adds more tokens than its share of the cycle's time:
        one more draft level (as measured) and one more verified row. A CPU verifies few nodes (on two
        AVX2 cores each costs a sixth of a forward), so most cycles draft one or two levels, not the
        shape's whole depth (EAGLE-2's beam fills every level: a tree of which one node was verified
        cost 7 ms of drafting, 40% of a plain step, on a Zen 3)."""
        now = time.perf_counter()
        if self.level_started is not None:  # the level just scored: its forward, LM head, top-k and this rule
            self.level_ms = LEVEL_DECAY * self.level_ms + (1 - LEVEL_DECAY) * 1000 * (now - self.level_started)
        self.level_started = now
        if self.curve is None:
            return beam
        candidates = self.read(table)
        drafting_ms = 1000 * (now - self.started)
        choice = candidates.rate_choice(self.curve, drafting_ms, self.max_nodes, kept=candidates.best(1),
                                        head_trust=self.head_trust, lookup_trust=self.lookup_trust)
        count = len(choice.nodes)
        marginal = self.level_ms + self.curve.cost(count + 2) - self.curve.cost(count + 1)
        worth = choice.expected * marginal / choice.milliseconds  # the tokens a further level must add
        chosen, probs = set(choice.nodes), candidates.probs
        return [node for node in beam if node in chosen and choice.values[node] * probs[node] > worth]

    def read(self, table: CandidateTable | HostTable) -> Candidates:
        """The table's candidates with the cycle's lookup chains, read once while the table stays as it
        is: the rule after the last level drafted (`narrow`) and the selection see the same table."""
        if self.last_read is None or self.last_read[0] is not table or self.last_read[1] != table.filled:
            self.last_read = (table, table.filled, self.candidates(table))
        return self.last_read[2]

    def select(self, table: CandidateTable | HostTable) -> DraftTree:
        """The table read once; with a verify-cost curve the head's best node and as many more (the
        head's and lookup chains') as pay at this machine's cost (`Candidates.offer_for_rate`), else
        the best `keep` nodes."""
        self.level_started = None
        candidates, self.last_read = self.read(table), None
        self.trace = self.shape.trace(table)
        if self.curve is None:
            self.offer = candidates.offer(self.keep)
        else:
            drafting_ms = 1000 * (time.perf_counter() - self.started)
            self.offer = candidates.offer_for_rate(self.curve, drafting_ms, self.max_nodes, kept=candidates.best(1),
                                                   head_trust=self.head_trust, lookup_trust=self.lookup_trust)
        self.drafted_trust = self.head_trust
        return candidates.tree_of(self.offer.chosen)

    def level_inputs(self, tokens, level: int, first_entry: int, entries: torch.Tensor):
        """A tree level's positions and, of this cycle's entries, those its nodes attend to."""
        m = len(tokens)
        assert self.cache.length == self.consumed + first_entry, "tree entries are appended in feeding order"
        return torch.full((m,), self.consumed - 1 + level, device=tokens.device), entries[:, : first_entry + m]

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        positions, seen = self.level_inputs(tokens, level, first_entry, entries)
        if self.fused is not None and not both:
            return self.fused.step(hidden, tokens, positions, self.cache, self.consumed, seen.contiguous()), None
        context = torch.ones(len(tokens), self.consumed, dtype=torch.bool, device=tokens.device)
        mask = torch.cat([context, seen], dim=1)[None, None]
        if both:
            return self.head.forward_both(hidden, tokens, positions, mask, self.cache)
        return self.head(hidden, tokens, positions, mask, self.cache), None

    def top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().top(outputs, k) if self.fused is None else self.fused.top(outputs, k)

    def feed_top(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, k: int):
        """The fused step and its top-k in one kernel call (`FusedEagle3Step.draft`)."""
        if self.fused is None:
            return super().feed_top(hidden, tokens, level, first_entry, entries, k)
        positions, seen = self.level_inputs(tokens, level, first_entry, entries)
        return self.fused.draft(hidden, tokens, positions, self.cache, self.consumed, seen.contiguous(), outputs=None,
                                k=k)

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        return bool(fired)
