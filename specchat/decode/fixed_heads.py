"""Drafting with a draft head on the fixed envelope (`specchat.decode.fixed_engine`): the tree shapes
of `specchat.decode.tree_shapes`, grown on the device at a fixed shape, with no host read.

The head's cache (`drafters.cache.FixedHeadCache`) is laid out as on the host (`head_proposer`):
entry j pairs the target's feature at position j with the token at j + 1. A cycle's draft step
first runs the *context pass*: the positions the previous cycle committed (the root and the
accepted path: `pending`, at most depth + 1 rows, padded to that), then the tree's levels, whose
entries sit after the context pass's rows and are overwritten by the next cycle. Only the counts
(`consumed`, `pending`) come from the host, as inputs; the features and tokens of the committed
positions never leave the device (`commit`). Prompts go through the head eagerly (`start`).

Which nodes are verified: the best `total_tokens - 1` by path score, chosen on the device
(`select_fixed`); with a lookup source (hybrid), the lookup continuations the host found join the
candidates first (`merge_lookup`), merged with the head's nodes where they agree, as on the host.
"""

from __future__ import annotations

import time

import torch

from drafters import DraftHead
from drafters.cache import FixedHeadCache
from specchat.decode.engine import PREFILL_CHUNK
from specchat.decode.envelope import MAX_TREE_ROWS, Envelope, FixedTree, HostInputs, causal_block, pick, window_mask
from specchat.decode.hybrid import LOOKUP_BRANCHES, LOOKUP_TOKENS, LookupRates
from specchat.decode.lookup import LookupSource
from specchat.decode.tree import Cycle, Source
from specchat.decode.tree_shapes import CandidateTable, DynamicTree, Growth, HeadSteps, StaticTree
from specchat.decode.verify import FixedAcceptance


class FixedTreeProposer:
    """Proposes draft trees of one shape with a draft head, on the fixed envelope."""

    def __init__(self, head: DraftHead, num_target_layers: int, shape: StaticTree | DynamicTree, envelope: Envelope,
                 lookup: LookupSource | None = None, lookup_tokens: int = LOOKUP_TOKENS):
        shape.check(head)
        self.head, self.shape, self.envelope, self.lookup = head, shape, envelope, lookup
        self.feature_layers = head.feature_layers(num_target_layers)
        device = next(head.parameters()).device
        self.head_depth = shape.depth_for(MAX_TREE_ROWS)
        self.nodes = shape.verified(MAX_TREE_ROWS - 1)  # verified per cycle
        self.lookup_tokens = lookup_tokens if lookup is not None else 0
        self.depth = max(self.head_depth, self.lookup_tokens)  # the deepest node (a lookup chain's)
        self.rows = self.depth + 1  # positions a cycle commits at most: the context pass's rows
        self.reach = self.rows + shape.entries(self.head_depth)  # head entries past the context
        self.cache = FixedHeadCache(envelope.capacity + self.reach)
        self.inputs = HostInputs(device, "consumed", "pending")
        self.pending_features: torch.Tensor | None = None  # [rows, F], allocated at the first prompt
        self.pending_tokens = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.consumed = self.pending = 0  # host copies: committed entries; committed positions not yet fed
        self.waiting: list[tuple[list[int], torch.Tensor]] = []  # prompt rows not yet fed (tokens, features)
        if lookup is not None:
            self.rates = LookupRates()
            # per branch b: its tokens "b:j", then every branch's length "b", then its evidence "evidence b"
            self.chains = HostInputs(device, *(f"{b}:{j}" for b in range(LOOKUP_BRANCHES)
                                               for j in range(self.lookup_tokens)), *map(str, range(LOOKUP_BRANCHES)),
                                     *(f"evidence {b}" for b in range(LOOKUP_BRANCHES)))
            self.accept = HostInputs(device, *map(str, range(LOOKUP_BRANCHES)), dtype=torch.float32)
            self._lookup_seconds = 0.0

    def describe(self) -> str:
        return self.shape.describe() + (", with lookup (hybrid)" if self.lookup is not None else "") + \
            ", fixed-shape steps"

    # -- host side ---------------------------------------------------------------------------------

    def rewind(self, length: int) -> int:
        if self.lookup is not None:
            self.lookup.rewind(length)
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

    def forget(self) -> None:
        if self.lookup is not None:
            self.lookup.forget()

    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        self.waiting.append((list(tokens), features))
        if self.lookup is not None:
            self.lookup.observe(tokens)

    @torch.inference_mode()
    def start(self, root: torch.Tensor) -> None:
        """Feed every committed position but the newest through the head (eagerly, in chunks); the
        newest stays pending: the first cycle's context pass pairs it with the root."""
        features = ([self.pending_features[: self.pending]] if self.pending else []) + [f for _, f in self.waiting]
        tokens = ([self.pending_tokens[: self.pending]] if self.pending else []) + \
            [torch.tensor(t, device=root.device) for t, _ in self.waiting]
        features, tokens = torch.cat(features), torch.cat(tokens)
        if self.pending_features is None:
            self.pending_features = features.new_zeros(self.rows, features.shape[1])
        for begin in range(0, len(tokens) - 1, PREFILL_CHUNK):
            end = min(begin + PREFILL_CHUNK, len(tokens) - 1)
            self._feed_context(features[begin:end], tokens[begin + 1 : end + 1])
        self.pending_features[0], self.pending_tokens[0] = features[-1], tokens[-1]
        self.pending, self.waiting = 1, []

    def _feed_context(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Committed (feature, next token) pairs through the head, eagerly, padded to a bucket."""
        count, rows = len(next_tokens), self.envelope.rows_for(len(next_tokens))
        at = torch.tensor(self.consumed, device=features.device)
        slots = at + torch.arange(rows, device=features.device)
        span = self.envelope.span_for(self.consumed + rows)
        padded = torch.cat([features, features.new_zeros(rows - count, features.shape[1])])
        tokens = torch.cat([next_tokens, next_tokens.new_zeros(rows - count)])
        self.head(padded, tokens, slots, window_mask(causal_block(rows, at.device), at, at, span),
                  self.cache.at(slots, span))
        self.consumed += count

    def prepare(self, root: int) -> int:
        self.inputs.write(consumed=self.consumed, pending=self.pending)
        if self.lookup is not None:
            started = time.perf_counter()
            found = self.lookup.matches(root, self.lookup_tokens, LOOKUP_BRANCHES)
            chains = {str(b): 0 for b in range(LOOKUP_BRANCHES)}
            for b, match in enumerate(found):
                chains[str(b)], chains[f"evidence {b}"] = len(match.tokens), match.evidence
                chains.update({f"{b}:{j}": token for j, token in enumerate(match.tokens)})
            self.chains.write(**chains)
            accept = {str(b): 1.0 for b in range(LOOKUP_BRANCHES)}  # 1: no chain (its log is 0, never NaN)
            accept.update({str(b): self.rates.estimate(match.evidence) for b, match in enumerate(found)})
            self.accept.write(**accept)
            self._lookup_seconds = time.perf_counter() - started
        return self.envelope.rows_for(self.nodes + 1) - 1

    def committed(self, tokens: list[int], cycle: Cycle) -> None:
        self.consumed += self.pending  # the cycle's context pass fed them
        self.pending = len(tokens)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            self.rates.learn(cycle)
            cycle.tree.lookup_seconds = self._lookup_seconds

    # -- device side (captured) --------------------------------------------------------------------

    def draft(self, nodes: int, root: torch.Tensor, length: torch.Tensor, span: int, sampling, rng) -> FixedTree:
        root_hidden, context_end = self._context_pass(root, span)
        table = self.shape.grow(FixedSteps(self, context_end, span), root_hidden, self.head_depth, self.nodes)
        if self.lookup is None:
            return select_fixed(table, self.nodes, self.depth)
        count = LOOKUP_BRANCHES * self.lookup_tokens
        chains = self.chains.device[:count].view(LOOKUP_BRANCHES, self.lookup_tokens)
        lengths, evidence = self.chains.device[count:].view(2, LOOKUP_BRANCHES)
        return select_fixed(merge_lookup(table, chains, lengths, self.accept.device.log(), self.head_depth, evidence),
                            self.nodes, self.depth)

    def _context_pass(self, root: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending positions through the head; the output that predicts the root's children,
        and where the committed entries end then."""
        consumed, count = self.inputs["consumed"], self.inputs["pending"]
        rows = torch.arange(self.rows, device=root.device)
        slots = consumed + rows
        next_tokens = torch.where(rows == count - 1, root, self.pending_tokens.roll(-1))
        mask = window_mask(causal_block(self.rows, root.device), consumed, consumed, span)
        out = self.head(self.pending_features, next_tokens, slots, mask, self.cache.at(slots, span))
        return pick(out, count - 1), consumed + count

    def commit(self, tree: FixedTree, acceptance: FixedAcceptance, root: torch.Tensor, features: torch.Tensor) -> None:
        self.pending_features.copy_(features)
        self.pending_tokens.copy_(torch.cat([root, tree.tokens[acceptance.path]]))


class FixedSteps(HeadSteps):
    """The head's steps on the fixed envelope (`tree_shapes.HeadSteps`): a tree's entries go to
    fixed slots after the context pass's rows; DEAGLE's vote drops the levels after it."""

    def __init__(self, proposer: FixedTreeProposer, context_end: torch.Tensor, span: int):
        super().__init__(proposer.head)
        self.proposer, self.context_end, self.span = proposer, context_end, span

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        p = self.proposer
        m = len(tokens)
        base = p.inputs["consumed"] + p.rows
        slots = base + first_entry + torch.arange(m, device=tokens.device)
        mask = window_mask(entries, self.context_end, base, self.span)
        positions = (self.context_end - 1 + level).expand(m)
        window = p.cache.at(slots, self.span)
        if both:
            return p.head.forward_both(hidden, tokens, positions, mask, window)
        return p.head(hidden, tokens, positions, mask, window), None

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        growth.alive = ~fired if growth.alive is None else growth.alive & ~fired
        return False


def select_fixed(table: CandidateTable, keep: int, depth: int) -> FixedTree:
    """The `keep` best candidates by score as a tree (`Candidates.select` on the device): ties go to
    the earlier node, which the table's level order makes the shallower, so a parent ranks before
    its children; a node without a score, or whose parent was not kept, is invalid."""
    keep = min(keep, len(table.scores))
    chosen = table.scores.sort(descending=True, stable=True).indices[:keep].sort().values  # parents first
    position = torch.full_like(table.parents, -1)
    position[chosen] = torch.arange(keep, device=chosen.device)
    parents = table.parents[chosen]
    mapped = torch.where(parents >= 0, position[parents.clamp(min=0)], -1)
    valid = table.scores[chosen].isfinite() & ((parents < 0) | (mapped >= 0))
    hybrid = table.sources is not None
    return FixedTree(table.tokens[chosen], mapped, table.depths[chosen], valid, table.logps[chosen].exp(), depth,
                     sources=table.sources[chosen] if hybrid else None,
                     evidence=table.evidence[chosen] if hybrid else None)


def merge_lookup(table: CandidateTable, chains: torch.Tensor, lengths: torch.Tensor, log_accept: torch.Tensor,
                 head_depth: int, evidence: torch.Tensor) -> CandidateTable:
    """The head's candidates joined by lookup chains [branches, L] (`lengths` of them real, each token
    accepted with probability exp(`log_accept`) given its parent, found with `evidence` tokens of
    agreeing context): `Candidates.add_chain` on the device. A chain's prefix that some head node's
    path spells merges into it (BOTH, the better score, the stronger evidence); the rest hangs below
    as lookup nodes. Along a chain the score is
    s_j = max(head score of the node it merged with, s_{j-1} + log_accept), s_{-1} = 0."""
    device = chains.device
    branches, length = chains.shape
    size = len(table.tokens)
    # Every head node's path as tokens by depth (-1 past its depth).
    levels = torch.arange(head_depth, device=device)
    paths = torch.full((size, head_depth), -1, device=device)
    current = torch.arange(size, device=device)
    for _ in range(head_depth):
        on = current >= 0
        node = current.clamp(min=0)
        at = on[:, None] & (levels[None, :] == table.depths[node][:, None] - 1)
        paths = torch.where(at, table.tokens[node][:, None], paths)
        current = torch.where(on, table.parents[node], current)
    # Chain position j merges with the head node whose path is chain[:j + 1].
    positions = torch.arange(length, device=device)
    real = positions[None, :] < lengths[:, None]  # [branches, L]
    width = min(length, head_depth)
    prefixes = torch.where(levels[None, None, :width] <= positions[None, :, None], chains[:, None, :width], -1)
    spelled = (paths[None, None, :, :width] == prefixes[:, :, None, :]).all(-1)  # [branches, L, size]
    spelled &= (table.depths[None, None, :] == positions[None, :, None] + 1) & table.scores.isfinite()
    spelled &= real[:, :, None] & (positions < head_depth)[None, :, None]
    merged, merged_node = spelled.any(-1), spelled.byte().argmax(-1)
    head_score = torch.where(merged, table.scores[merged_node], float("-inf"))
    steps = (positions[:, None] - positions[None, :]).float()  # [j, i]: j - i
    reach = head_score[:, None, :] + steps[None] * log_accept[:, None, None]
    reach = reach.masked_fill(steps[None] < 0, float("-inf")).amax(-1)
    scores = torch.maximum(reach, (positions + 1).float()[None, :] * log_accept[:, None])  # [branches, L]
    # The head nodes a chain merged with: the better score, BOTH, the stronger evidence.
    target = torch.where(merged, merged_node, size).flatten()  # `size`: a slot that absorbs the rest
    head_scores = torch.cat([table.scores, table.scores.new_full((1,), float("-inf"))])
    head_scores = head_scores.scatter_reduce(0, target, scores.flatten(), "amax")[:size]
    chain_evidence = evidence[:, None].expand(branches, length).flatten()
    head_evidence = torch.full((size + 1,), -1, device=device).scatter_reduce(0, target, chain_evidence, "amax")[:size]
    head_sources = torch.where(head_evidence >= 0, int(Source.BOTH), int(Source.HEAD))
    # The chain positions that did not merge: new nodes, each under the one before (or its merge).
    new = real & ~merged
    flat = size + torch.arange(branches * length, device=device).view(branches, length)
    before = torch.where(merged, merged_node, flat).roll(1, dims=1)
    parents = torch.where(positions[None, :] == 0, -1, before)
    return CandidateTable(
        tokens=torch.cat([table.tokens, chains.flatten()]),
        parents=torch.cat([table.parents, parents.flatten()]),
        depths=torch.cat([table.depths, (positions + 1).expand(branches, length).flatten()]),
        logps=torch.cat([table.logps, log_accept[:, None].expand(branches, length).flatten()]),
        scores=torch.cat([head_scores, scores.masked_fill(~new, float("-inf")).flatten()]),
        filled=size + branches * length,
        sources=torch.cat([head_sources, torch.full((branches * length,), int(Source.LOOKUP), device=device)]),
        evidence=torch.cat([head_evidence.clamp(min=0), chain_evidence]),
    )
