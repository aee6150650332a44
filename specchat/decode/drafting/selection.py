"""Which of a head's candidates a cycle verifies, joined by lookup continuations (hybrid drafting),
valued as the chat has taught (`specchat.decode.drafting.trust`).

The selection is the best nodes by path score, and the merge of a lookup chain into the head's
nodes is the same rule on both layouts, in two forms: on the host over lists (`Candidates`: the
growing layout reads the head's table once and decides there, without the tensor operations a
device form would add to every CPU cycle) and on the device (`select_fixed`, `merge_lookup`: the
fixed layout decides inside its draft step, which may not read the host). Rate-based selection
(`Candidates.select_for_rate`, below) is the growing layout's alone: it times the cycle's drafting
on the host.

With a lookup source (`--lookup on`), continuations of the newest tokens found in text already seen
join the head's candidates, as branches from the root that merge with the head's nodes where they
agree, scored by how often lookups of that strength were accepted so far. Which nodes are verified
is decided from the scores: the best `total_tokens - 1` of them, or, given the machine's
verify-cost curve, the head's own tree (what the head alone would verify) plus as many more nodes
as maximize expected tokens per second this cycle, so a long confident lookup chain gets verified
whole and a weak one adds nothing. The head's probabilities count as far as its drafts are
accepted in the chat (`HeadTrust`): under sampling fewer survive than the head is sure of, and its
budget and depth shrink with them. A node's children count one acceptance at most together (one
token follows it), and a lookup node where the head drafted another child counts as often as such
nodes are accepted (`ContradictedLookups`; `Candidates.values`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specchat.decode.runtime.calibrate import Curve
from specchat.decode.drafting.growth import CandidateTable, HostTable
from specchat.decode.drafting.tree import DraftTree, Offer, Source

LOOKUP_BRANCHES = 2  # distinct lookup continuations attached per cycle on the fixed layout
LOOKUP_TOKENS = 16  # the longest lookup chain (the verify budget decides how much of it is verified)
# A head's on the growing layout (CPUs), whose rate rule verifies of a chain only what pays at this machine's
# cost: a copy under way ran into 16 (a rewrite's chains accepted whole, cycle after cycle); 32 decoded
# rewrite10 4.6% and edit10 5.2% faster on a Zen 4, rewrite10 2.4% on its AVX2 path (one interleaved run each).
GROWING_LOOKUP_TOKENS = 32


@dataclass(frozen=True)
class RateChoice:
    """The nodes a cycle verifies at this machine's cost (`Candidates.rate_choice`), with the cycle they
    make: expected tokens (the bonus included) and milliseconds (drafting so far and verifying)."""

    nodes: list[int]
    expected: float
    milliseconds: float
    values: list[float]  # every candidate's expected acceptance (`Candidates.values`)


@dataclass
class Candidates:
    """Nodes a cycle could verify, parents before children, each scored by the log-probability that
    its whole path is accepted (a child's score never exceeds its parent's)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    probs: list[float]  # given the parent
    scores: list[float]
    sources: list[Source] = field(default_factory=list)  # empty: all the head's
    evidence: list[int] = field(default_factory=list)  # per lookup node, its match's strength (else 0)
    shares: list[float] = field(default_factory=list)  # per lookup node, its continuation's share (else 1)
    # `values` by (head trust, lookup trust), until a chain is added: a cycle's rate rule after its last
    # draft level and its selection value the same candidates
    _values: dict[tuple[float, float], list[float]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_table(cls, table: CandidateTable | HostTable) -> Candidates:
        """The table's nodes as host lists (one read of each tensor, or copies of a host table's lists:
        the growing layout's drafter)."""
        if isinstance(table, HostTable):
            return cls(list(table.tokens), list(table.parents), list(table.depths),
                       [math.exp(logp) for logp in table.logps], list(table.scores))
        n = table.filled
        return cls(table.tokens[:n].tolist(), table.parents[:n].tolist(), table.depths[:n].tolist(),
                   table.logps[:n].exp().tolist(), table.scores[:n].tolist())

    def add_chain(self, tokens: list[int], accepts: list[float], evidences: list[int],
                  shares: list[float] | None = None) -> None:
        """A lookup continuation from the root, token j accepted with probability `accepts[j]` given its
        parent, found with `evidences[j]` tokens of agreeing context and taken by `shares[j]` of the
        occurrences weighed (`LookupRates.along`; None: all of them); where the head or an earlier chain
        proposed the same token under the same parent, the node is shared."""
        shares = [1.0] * len(tokens) if shares is None else shares
        self._values.clear()
        if not self.sources:
            self.sources = [Source.HEAD] * len(self.tokens)
            self.evidence = [0] * len(self.tokens)
            self.shares = [1.0] * len(self.tokens)
        child = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens))}
        parent, score = -1, 0.0
        for depth, (token, accept, evidence, share) in enumerate(zip(tokens, accepts, evidences, shares), start=1):
            score += math.log(accept)
            node = child.get((parent, token))
            if node is None:
                node = len(self.tokens)
                self.tokens.append(token), self.parents.append(parent), self.depths.append(depth)
                self.probs.append(accept), self.scores.append(score), self.sources.append(Source.LOOKUP)
                self.evidence.append(evidence), self.shares.append(share)
                child[(parent, token)] = node
            else:
                head_only = self.sources[node] == Source.HEAD  # its evidence and share were placeholders
                self.sources[node] = Source.BOTH if head_only else self.sources[node]
                self.scores[node] = max(self.scores[node], score)
                self.evidence[node] = evidence if head_only else max(self.evidence[node], evidence)
                self.shares[node] = share if head_only else max(self.shares[node], share)
            parent, score = node, self.scores[node]

    def _ranked(self, values: list[float] | None = None) -> list[int]:
        """Nodes by score (or by `values`, which must not rise from parent to child); ties go to the
        shallower node, so every parent ranks before its children."""
        values = self.scores if values is None else values
        return sorted(range(len(self.tokens)), key=lambda i: (-values[i], self.depths[i], i))

    def best(self, keep: int) -> list[int]:
        """The `keep` best nodes (a connected tree: a parent ranks before its children)."""
        return self._ranked()[:keep]

    def select(self, keep: int) -> DraftTree:
        """The `keep` best nodes, as a tree."""
        return self.tree_of(self.best(keep))

    def offer(self, keep: int) -> Offer:
        """`select`'s choice, as what the trace records (`tree_of` its chosen nodes is the tree)."""
        return self._offer(None, self.best(keep))

    def values(self, head_trust: float = 1.0, lookup_trust: float = 1.0) -> list[float]:
        """Each node's expected acceptance: its path probability, the head's alone scaled by
        `head_trust`; a lookup node the head contradicts (the head drafted another child of its
        parent) counts `lookup_trust` as often given its parent, and a node's children count at
        most one acceptance together (siblings exclude each other: one token follows a node), each
        scaled with its subtree."""
        if (head_trust, lookup_trust) in self._values:
            return self._values[(head_trust, lookup_trust)]
        sources = self.sources or [Source.HEAD] * len(self.scores)
        alone = [math.exp(score) * (head_trust if source == Source.HEAD else 1.0)
                 for score, source in zip(self.scores, sources)]
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        given = [0.0] * len(alone)  # each node's acceptance given its parent's
        for parent, nodes in children.items():
            above = 1.0 if parent < 0 else alone[parent]
            for node in nodes:
                given[node] = alone[node] / above if above > 0 else 0.0
            if lookup_trust < 1.0 and any(sources[node] != Source.LOOKUP for node in nodes):
                for node in nodes:
                    if sources[node] == Source.LOOKUP:
                        given[node] *= lookup_trust
            total = sum(given[node] for node in nodes)
            if total > 1.0:
                for node in nodes:
                    given[node] /= total
        value = [0.0] * len(alone)
        for node, parent in enumerate(self.parents):  # parents come before their children
            value[node] = given[node] * (1.0 if parent < 0 else value[parent])
        self._values[(head_trust, lookup_trust)] = value
        return value

    def rate_choice(self, curve: Curve, drafting_ms: float, max_nodes: int, kept: list[int] = (),
                    head_trust: float = 1.0, lookup_trust: float = 1.0, probe: bool = False) -> RateChoice:
        """The `kept` nodes and as many of the best others as maximize expected tokens (1 + the sum
        of the nodes' values, `values`) per millisecond of the cycle (drafting so far + verifying them
        all). `kept` must be a connected tree; the others join in rank order, so every node's parent
        is chosen before it. `probe`: this is the cycle's verified set, which the curve may now and
        then make larger to learn what a size it rules out costs (`Curve.probe`)."""
        value = self.values(head_trust, lookup_trust)
        kept = list(kept)[:max_nodes]
        taken = set(kept)
        # Rank order keeps every parent before its children: a child's value is its parent's times
        # its acceptance given the parent, at most 1 (`values`).
        ranked = kept + [i for i in self._ranked(value) if i not in taken]
        ranked = ranked[: max(len(kept), min(max_nodes, curve.largest - 1))]
        expected = 1.0 + sum(value[node] for node in kept)
        expecteds = {len(kept) + 1: expected}  # by tokens verified, the root included
        for count in range(len(kept) + 1, len(ranked) + 1):
            expected += value[ranked[count - 1]]
            expecteds[count + 1] = expected
        rates = {n: tokens / (drafting_ms + curve.cost(n)) for n, tokens in expecteds.items()}
        best = max(rates, key=lambda n: (rates[n], -n))  # ties: the smaller tree
        if probe:
            best = curve.probe(expecteds, drafting_ms, best)
        return RateChoice(ranked[:best - 1], expecteds[best], expecteds[best] / rates[best], value)

    def select_for_rate(self, curve: Curve, drafting_ms: float, max_nodes: int, kept: list[int] = (),
                        head_trust: float = 1.0, lookup_trust: float = 1.0) -> DraftTree:
        """The nodes `rate_choice` takes, as the cycle's tree."""
        return self.tree_of(self.offer_for_rate(curve, drafting_ms, max_nodes, kept, head_trust, lookup_trust).chosen)

    def offer_for_rate(self, curve: Curve, drafting_ms: float, max_nodes: int, kept: list[int] = (),
                       head_trust: float = 1.0, lookup_trust: float = 1.0) -> Offer:
        """`select_for_rate`'s choice, as what the trace records (`tree_of` its chosen nodes is the tree)."""
        choice = self.rate_choice(curve, drafting_ms, max_nodes, kept, head_trust, lookup_trust, probe=True)
        return self._offer(choice.values, choice.nodes)

    def _offer(self, values: list[float] | None, chosen: list[int]) -> Offer:
        return Offer(self.tokens, self.parents, self.sources, values, self._tree_order(chosen))

    def _tree_order(self, chosen: list[int]) -> list[int]:
        """Parents first, siblings by score (the order verification tries them in)."""
        return sorted(chosen, key=lambda i: (self.depths[i], -self.scores[i], i))

    def tree_of(self, chosen: list[int]) -> DraftTree:
        """The nodes `chosen`, as a tree."""
        chosen = self._tree_order(chosen)
        slot = {node: position for position, node in enumerate(chosen)}
        return DraftTree(
            tokens=[int(self.tokens[i]) for i in chosen],
            parents=[slot[self.parents[i]] if self.parents[i] >= 0 else -1 for i in chosen],
            depths=[self.depths[i] for i in chosen],
            probs=[float(self.probs[i]) for i in chosen],
            sources=[self.sources[i] for i in chosen] if self.sources else [],
            evidence=[self.evidence[i] for i in chosen] if self.evidence else [],
            shares=[self.shares[i] for i in chosen] if self.shares else [],
        )


def select_fixed(table: CandidateTable, keep: int, depth: int) -> DraftTree:
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
    return DraftTree(table.tokens[chosen], mapped, table.depths[chosen], table.logps[chosen].exp(), valid=valid,
                     depth=depth, sources=table.sources[chosen] if hybrid else None,
                     evidence=table.evidence[chosen] if hybrid else None)


def merge_lookup(table: CandidateTable, chains: torch.Tensor, lengths: torch.Tensor, log_accept: torch.Tensor,
                 head_depth: int, evidence: torch.Tensor) -> CandidateTable:
    """The head's candidates joined by lookup chains [branches, L] (`lengths` of them real, token j of
    a chain accepted with probability exp(`log_accept`[:, j]) given its parent, found with
    `evidence`[:, j] tokens of agreeing context): `Candidates.add_chain` on the device. A chain's
    prefix that some head node's path spells merges into it (BOTH, the better score, the stronger
    evidence); the rest hangs below as lookup nodes. Along a chain the score is
    s_j = max(head score of the node it merged with, s_{j-1} + log_accept_j), s_{-1} = 0, which with
    C_j the sum of log_accept up to j is max(C_j, max over merges i <= j of head score_i + C_j - C_i)."""
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
    along = log_accept.cumsum(1)  # C_j
    after = (positions[:, None] >= positions[None, :])  # [j, i]: a merge at i reaches j
    reach = head_score[:, None, :] + along[:, :, None] - along[:, None, :]
    reach = reach.masked_fill(~after[None], float("-inf")).amax(-1)
    scores = torch.maximum(reach, along)  # [branches, L]
    # The head nodes a chain merged with: the better score, BOTH, the stronger evidence.
    target = torch.where(merged, merged_node, size).flatten()  # `size`: a slot that absorbs the rest
    head_scores = torch.cat([table.scores, table.scores.new_full((1,), float("-inf"))])
    head_scores = head_scores.scatter_reduce(0, target, scores.flatten(), "amax")[:size]
    chain_evidence = evidence.flatten()
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
        logps=torch.cat([table.logps, log_accept.flatten()]),
        scores=torch.cat([head_scores, scores.masked_fill(~new, float("-inf")).flatten()]),
        filled=size + branches * length,
        sources=torch.cat([head_sources, torch.full((branches * length,), int(Source.LOOKUP), device=device)]),
        evidence=torch.cat([head_evidence.clamp(min=0), chain_evidence]),
    )
