"""What hybrid drafting learns in a chat: how often lookup continuations are accepted by the strength
of their match (`LookupRates`), how far the head's probabilities hold (`HeadTrust`), and how often a
lookup node is accepted where the head drafted another child of its parent (`ContradictedLookups`).
`specchat.decode.drafting.selection` values the candidates by them. Imports no torch.
"""

from __future__ import annotations

import bisect

from specchat.decode.drafting.lookup import Match
from specchat.decode.drafting.tree import Cycle, Source


class LookupRates:
    """How often a lookup token is accepted when its parent was, by the strength of its match
    (tokens of agreeing context): the lookup nodes' probabilities, learned as the chat goes.

    A token that only some of the weighed occurrences went on with (its share, `lookup.paths`) is
    as likely as its share says: its estimate is the strength's rate times the share, and the rate
    is learned per unit of share (each offer counts its share), so the two stay calibrated together.
    Starts from PRIOR (a weak belief of 1 in 2) and forgets slowly, so a chat that starts quoting
    its own text raises it within a few cycles.
    """

    BUCKETS = (1, 2, 3, 5, 8, 13)  # evidence of at least this many tokens (a chain's grows along it: `along`)
    PRIOR = (1.0, 2.0)  # accepted, offered
    DECAY = 0.98

    def __init__(self):
        self.counts = [list(self.PRIOR) for _ in self.BUCKETS]

    def _bucket(self, evidence: int) -> int:
        return max(0, bisect.bisect_right(self.BUCKETS, evidence) - 1)

    def estimate(self, evidence: int, share: float = 1.0) -> float:
        accepted, offered = self.counts[self._bucket(evidence)]
        return min(0.99, max(0.01, share * accepted / offered))

    def along(self, match: Match) -> tuple[list[float], list[int], list[float]]:
        """Per token of a continuation, its acceptance estimate, its evidence and its share: the
        evidence is the match's, grown by the tokens before it in the chain (a token is tried only
        where they were accepted, and then they agree too), so a long copy is trusted more the
        further it goes."""
        evidences = [match.evidence + j for j in range(len(match.tokens))]
        shares = list(match.shares) or [1.0] * len(match.tokens)
        return [self.estimate(evidence, share) for evidence, share in zip(evidences, shares)], evidences, shares

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
                    counts = self.counts[self._bucket(tree.evidence[c])]
                    counts[0] = counts[0] * self.DECAY + (c == taken)
                    counts[1] = counts[1] * self.DECAY + (tree.shares[c] if tree.shares else 1.0)


class Trust:
    """Accepted drafts over what their estimates expected, decayed: how far a source's estimates
    hold as acceptance rates in this chat (`factor`). Starts at full trust and forgets slowly; at
    most 1, so a trusted node never outranks its parent. Its kinds say what they count (`learn`)."""

    PRIOR = (4.0, 4.0)  # accepted, expected
    DECAY = 0.98
    FLOOR = 0.05

    def __init__(self):
        self.accepted, self.expected = self.PRIOR

    def factor(self) -> float:
        return min(1.0, max(self.FLOOR, self.accepted / self.expected))

    def count(self, accepted: float, expected: float) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.expected = self.expected * self.DECAY + expected


class HeadTrust(Trust):
    """How far the head's path probabilities hold as acceptance rates in this chat: the head's
    accepted draft tokens over the summed path probabilities of the head's verified nodes, once a
    cycle.

    A trained head's confidence tracks its acceptance under greedy decoding (EAGLE-2, arXiv
    2406.16858, Fig. 6); under sampling fewer of its drafts survive than it is sure of, and every
    verified token costs the same, so fewer of its nodes pay (`Candidates.rate_choice`).
    """

    def learn(self, cycle: Cycle) -> None:
        """One cycle: the head-only nodes' path probabilities against how many of them were accepted."""
        tree = cycle.tree
        sources = tree.sources or [Source.HEAD] * len(tree)
        path: list[float] = []
        for parent, prob in zip(tree.parents, tree.probs):
            path.append(prob * (path[parent] if parent >= 0 else 1.0))
        expected = sum(p for p, source in zip(path, sources) if source == Source.HEAD)
        if expected > 0:
            self.count(sum(sources[node] == Source.HEAD for node in cycle.accepted), expected)


class ContradictedLookups(Trust):
    """How far a lookup node's acceptance estimate holds where the head drafted another child of its
    parent: such nodes' acceptance against their estimates (given their parents), node by node, at
    nodes the cycle reached. `LookupRates` learns from every lookup node; where the head disagrees
    the continuation is less often the text's (a low-copy10 trace on a Zen 3: 67 of 91.6 expected,
    where lookup-only trees took 132 of 127.7)."""

    def learn(self, cycle: Cycle) -> None:
        tree, path = cycle.tree, cycle.accepted
        if not tree.sources:
            return
        children = tree.children()
        for node, taken in zip([-1] + path, path + [None]):
            siblings = children[node + 1]
            if all(tree.sources[c] == Source.LOOKUP for c in siblings):
                continue
            for c in siblings:
                if tree.sources[c] == Source.LOOKUP:
                    self.count(c == taken, tree.probs[c])
