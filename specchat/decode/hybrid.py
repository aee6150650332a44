"""Hybrid drafting's bookkeeping on the host: the candidates a cycle could verify, and what the chat
has taught about lookup continuations (`LookupRates`) and about the head (`HeadTrust`).

With a lookup source (`--lookup on`), continuations of the newest tokens found in text already seen
join the head's candidates, as branches from the root that merge with the head's nodes where they
agree, scored by how often lookups of that strength were accepted so far. Which nodes are verified
is decided from the scores: the best `total_tokens - 1` of them, or, given the machine's
verify-cost curve, the head's own tree (what the head alone would verify) plus as many more nodes
as maximize expected tokens per second this cycle, so a long confident lookup chain gets verified
whole and a weak one adds nothing. The head's probabilities count as far as its drafts are
accepted in the chat (`HeadTrust`): under sampling fewer survive than the head is sure of, and its
budget and depth shrink with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specchat.decode.calibrate import Curve
from specchat.decode.tree import Cycle, DraftTree, Source
from specchat.decode.tree_shapes import CandidateTable

LOOKUP_BRANCHES = 2  # distinct lookup continuations attached per cycle
LOOKUP_TOKENS = 16  # the longest lookup chain (the verify budget decides how much of it is verified)


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
    info: dict = field(default_factory=dict)  # for the trace (`DraftTree.info`)
    evidence: list[int] = field(default_factory=list)  # per lookup node, its match's strength (else 0)

    @classmethod
    def from_table(cls, table: CandidateTable, info: dict) -> Candidates:
        """The table's nodes as host lists (one read of each tensor: the host's drafter)."""
        n = table.filled
        return cls(table.tokens[:n].tolist(), table.parents[:n].tolist(), table.depths[:n].tolist(),
                   table.logps[:n].exp().tolist(), table.scores[:n].tolist(), info=info)

    def add_chain(self, tokens: list[int], accept: float, evidence: int) -> None:
        """A lookup continuation from the root, each token accepted with probability `accept` given
        its parent; where the head proposed the same token under the same parent, the node is shared."""
        if not self.sources:
            self.sources = [Source.HEAD] * len(self.tokens)
            self.evidence = [0] * len(self.tokens)
        child = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens))}
        parent, score = -1, 0.0
        for depth, token in enumerate(tokens, start=1):
            score += math.log(accept)
            node = child.get((parent, token))
            if node is None:
                node = len(self.tokens)
                self.tokens.append(token), self.parents.append(parent), self.depths.append(depth)
                self.probs.append(accept), self.scores.append(score), self.sources.append(Source.LOOKUP)
                self.evidence.append(evidence)
                child[(parent, token)] = node
            else:
                self.sources[node] = Source.BOTH if self.sources[node] == Source.HEAD else self.sources[node]
                self.scores[node] = max(self.scores[node], score)
                self.evidence[node] = max(self.evidence[node], evidence)
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
        return self._tree(self.best(keep))

    def select_for_rate(self, curve: Curve, drafting_ms: float, max_nodes: int, kept: list[int] = (),
                        head_trust: float = 1.0) -> DraftTree:
        """The `kept` nodes and as many of the best others as maximize expected tokens (1 + the sum
        of the nodes' path probabilities, the head's alone scaled by `head_trust` <= 1) per
        millisecond of the cycle (drafting so far + verifying them all). `kept` must be a connected
        tree; the others join in rank order, so every node's parent is chosen before it."""
        value = [math.exp(score) * (head_trust if source == Source.HEAD else 1.0)
                 for score, source in zip(self.scores, self.sources or [Source.HEAD] * len(self.scores))]
        kept = list(kept)[:max_nodes]
        taken = set(kept)
        # Rank order keeps every parent before its children: a child's path probability never exceeds
        # its parent's, a trust <= 1 scales a head node and its head parent alike, and a shared
        # (BOTH) parent keeps its full value.
        ranked = kept + [i for i in self._ranked(value) if i not in taken]
        ranked = ranked[: max(len(kept), min(max_nodes, curve.largest - 1))]
        expected = 1.0 + sum(value[node] for node in kept)
        best, best_rate = len(kept), expected / (drafting_ms + curve.cost(len(kept) + 1))
        for count in range(len(kept) + 1, len(ranked) + 1):
            expected += value[ranked[count - 1]]
            rate = expected / (drafting_ms + curve.cost(count + 1))
            if rate > best_rate:
                best, best_rate = count, rate
        return self._tree(ranked[:best])

    def _tree(self, chosen: list[int]) -> DraftTree:
        chosen = sorted(chosen, key=lambda i: (self.depths[i], -self.scores[i], i))  # parents first, siblings by score
        slot = {node: position for position, node in enumerate(chosen)}
        return DraftTree(
            tokens=[int(self.tokens[i]) for i in chosen],
            parents=[slot[self.parents[i]] if self.parents[i] >= 0 else -1 for i in chosen],
            depths=[self.depths[i] for i in chosen],
            probs=[float(self.probs[i]) for i in chosen],
            info=dict(self.info),
            sources=[self.sources[i] for i in chosen] if self.sources else [],
            lookup_evidence=[self.evidence[i] for i in chosen] if self.evidence else [],
        )


class LookupRates:
    """How often a lookup token is accepted when its parent was, by the strength of its match
    (tokens of agreeing context): the lookup nodes' probabilities, learned as the chat goes.

    Starts from PRIOR (a weak belief of 1 in 2) and forgets slowly, so a chat that starts quoting
    its own text raises it within a few cycles.
    """

    BUCKETS = (1, 2, 3, 5, 8)  # evidence of at least this many tokens
    PRIOR = (1.0, 2.0)  # accepted, offered
    DECAY = 0.98

    def __init__(self):
        self.counts = [list(self.PRIOR) for _ in self.BUCKETS]

    def _bucket(self, evidence: int) -> int:
        return max(i for i, low in enumerate(self.BUCKETS) if evidence >= low or i == 0)

    def estimate(self, evidence: int) -> float:
        accepted, offered = self.counts[self._bucket(evidence)]
        return min(0.99, max(0.01, accepted / offered))

    def learn(self, cycle: Cycle) -> None:
        """Count, at every node of the accepted path (the root first), which of its lookup children
        were accepted: one at most, the others (and all below the path's end) were not."""
        tree, path = cycle.tree, cycle.accepted
        if not tree.sources:  # no lookup node this cycle
            return
        children = tree.children()
        for node, taken in zip([-1] + path, path + [None]):
            for c in children[node + 1]:
                if tree.sources[c] != Source.HEAD:
                    counts = self.counts[self._bucket(tree.lookup_evidence[c])]
                    counts[0] = counts[0] * self.DECAY + (c == taken)
                    counts[1] = counts[1] * self.DECAY + 1


class HeadTrust:
    """How far the head's path probabilities hold as acceptance rates in this chat: the head's
    accepted draft tokens over the summed path probabilities of the head's verified nodes.

    A trained head's confidence tracks its acceptance under greedy decoding (EAGLE-2, arXiv
    2406.16858, Fig. 6); under sampling fewer of its drafts survive than it is sure of, and every
    verified token costs the same, so the budget shrinks with the trust (`Curve.best_total_tokens`).
    Starts at full trust and forgets slowly; at most 1, so a head node never outranks its parent.
    """

    PRIOR = (4.0, 4.0)  # accepted, expected
    DECAY = 0.98
    FLOOR = 0.05

    def __init__(self):
        self.accepted, self.expected = self.PRIOR

    def factor(self) -> float:
        return min(1.0, max(self.FLOOR, self.accepted / self.expected))

    def learn(self, cycle: Cycle) -> None:
        """One cycle: the head-only nodes' path probabilities against how many of them were accepted."""
        tree = cycle.tree
        sources = tree.sources or [Source.HEAD] * len(tree)
        path: list[float] = []
        for parent, prob in zip(tree.parents, tree.probs):
            path.append(prob * (path[parent] if parent >= 0 else 1.0))
        expected = sum(p for p, source in zip(path, sources) if source == Source.HEAD)
        if expected <= 0:
            return
        accepted = sum(sources[node] == Source.HEAD for node in cycle.accepted)
        self.accepted = self.accepted * self.DECAY + accepted
        self.expected = self.expected * self.DECAY + expected
