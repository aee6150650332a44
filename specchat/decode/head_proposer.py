"""Drafting with a draft head: the head's cache kept in step with the context, and the trees it grows.

`TreeProposer` runs the head; a tree shape decides what to draft with it:

- `StaticTree`  EAGLE-1: a fixed tree of child ranks, filled in level by level;
- `DynamicTree` EAGLE-2: expand the most probable nodes level by level, keep the best overall;
- `DeagleTree`  the EAGLE-2 tree, deepened only while DEAGLE's vote allows (`specchat.decode.deagle`);
- `JakiroTree`  the EAGLE-2 tree whose last level comes from the two-ahead output of the forward
  before it (a Jakiro head), one draft forward fewer.

A shape grows `Candidates`: every node it could verify, scored by the log-probability that its
whole path is accepted. With a lookup source (hybrid drafting, `--lookup on`), continuations of
the newest tokens found in text already seen join the same candidates, as branches from the root
that merge with the head's nodes where they agree, scored by how often lookups of that strength
were accepted so far (`LookupRates`). Which nodes are verified is decided from the scores: the
best `total_tokens - 1` of them, or, given the machine's verify-cost curve, the head's own tree
(what the head alone would verify) plus as many more nodes as maximize expected tokens per second
this cycle, so a long confident lookup chain gets verified whole and a weak one adds nothing.
The head's probabilities count as far as its drafts are accepted in the chat (`HeadTrust`):
under sampling fewer survive than the head is sure of, and its budget and depth shrink with them.

The head keeps its own KV cache. Entry j of it is the head's step on (the target's feature at
position j, the token at position j + 1), at RoPE position j, which is EAGLE's convention. After
the context pass over the newly committed positions, the last entry pairs the newest committed
feature with the root, and its output predicts the root's children. Tree nodes at depth d sit at
position (committed entries - 1 + d); their entries are appended while the tree grows and
trimmed away afterwards, since only committed context belongs in the cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specchat.decode.cache import causal_mask
from specchat.decode.calibrate import Curve
from specchat.decode.deagle import DeagleParams, DepthVote
from drafters import DraftHead
from drafters.cache import HeadCache
from specchat.decode.engine import GenerationSettings
from specchat.decode.lookup import LookupSource
from specchat.decode.tree import DraftTree

LOOKUP_BRANCHES = 2  # distinct lookup continuations attached per cycle
LOOKUP_TOKENS = 16  # the longest lookup chain (the verify budget decides how much of it is verified)

# EAGLE-2 (Li et al. 2024, arXiv 2406.16858) reference settings: 60 tokens verified per cycle
# (root included), 6 draft levels (the code's depth=5 counts expansions after the first level),
# top-10 expansion. EAGLE-3's reference uses 8 levels (depth=7).
PAPER_TOTAL_TOKENS, PAPER_DEPTH, PAPER_TOP_K = 60, 6, 10


@dataclass(frozen=True)
class DynamicTreeParams:
    total_tokens: int = PAPER_TOTAL_TOKENS  # tokens verified per cycle, the root included
    depth: int = PAPER_DEPTH  # most draft tokens on one path (tree levels)
    top_k: int = PAPER_TOP_K  # children per expanded node, and nodes expanded per level

    def __post_init__(self):
        if self.total_tokens < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError("total_tokens must be >= 2, depth and top_k >= 1")


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
        self._last: tuple[int, DraftTree] | None = None  # the latest cycle's root and tree, to learn from
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
        self._last = None
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

    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            if self._last is not None and tokens and tokens[0] == self._last[0]:
                self.rates.learn(self._last[1], tokens[1:])
                self.trust.learn(self._last[1], tokens[1:])
            self._last = None

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
            candidates = self.shape.grow(self, root_hidden, head_depth, max_nodes)
        finally:
            self.cache.trim(self.consumed)  # tree entries were scratch space
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
        tree.info["lookup_seconds"] = round(lookup_seconds, 6)
        tree.info["head_trust"] = round(trust, 3)
        self._last = (root, tree)
        return tree

    # -- the head's steps, for the tree shapes -----------------------------------------------

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

    def feed(self, parent_hidden: torch.Tensor, tokens: torch.Tensor, depth: int,
             ancestor_entries: list[list[int]], both: bool = False):
        """Run the head on m tree nodes of one depth, each attending to the context, its ancestors' entries and itself.

        Returns their outputs, their two-ahead outputs (when `both`, else None) and their cache entries.
        """
        m, cached = len(tokens), self.cache.length
        mask = torch.zeros(m, cached + m, dtype=torch.bool, device=tokens.device)
        mask[:, : self.consumed] = True
        for row, entries in enumerate(ancestor_entries):
            mask[row, entries] = True
            mask[row, cached + row] = True
        positions = torch.full((m,), self.consumed - 1 + depth, device=tokens.device)
        entries = list(range(cached, cached + m))
        if both:
            out, right = self.head.forward_both(parent_hidden, tokens, positions, mask[None, None], self.cache)
            return out, right, entries
        return self.head(parent_hidden, tokens, positions, mask[None, None], self.cache), None, entries

    def log_probs(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.head.log_probs(outputs)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        table = self.head.draft_to_target
        return draft_ids if table is None else table[draft_ids]


# ---------------------------------------------------------------------------------------------
# EAGLE-1


@dataclass(frozen=True)
class StaticTree:
    """EAGLE-1: a fixed tree of child ranks (paths from the root, e.g. `specchat.decode.tree.MC_SIM_7B_63`)."""

    paths: tuple[tuple[int, ...], ...]

    def check(self, head: DraftHead) -> None:
        pass

    def describe(self) -> str:
        return f"static, {len(self.paths)} draft tokens"

    def grow(self, drafter: TreeProposer, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> Candidates:
        """Fill the tree in level by level: the head runs once per level on the nodes that have children."""
        paths = sorted((p for p in self.paths if len(p) <= max_depth), key=lambda p: (len(p), p))[:max_nodes]
        index = {path: i for i, path in enumerate(paths)}
        tokens, probs = [0] * len(paths), [0.0] * len(paths)
        hidden_of, entries_of = {(): root_hidden}, {(): []}
        for depth in range(1, max(map(len, paths), default=0) + 1):
            level = [p for p in paths if len(p) == depth]
            parents = sorted({p[:-1] for p in level})
            if depth > 1:  # feed the parents (depth - 1 nodes with children) to get their outputs
                out, _, entries = drafter.feed(
                    torch.stack([hidden_of[p[:-1]] for p in parents]),
                    torch.tensor([tokens[index[p]] for p in parents], device=root_hidden.device),
                    depth - 1, [entries_of[p[:-1]] for p in parents])
                for row, parent in enumerate(parents):
                    hidden_of[parent], entries_of[parent] = out[row], entries_of[parent[:-1]] + [entries[row]]
            logp = drafter.log_probs(torch.stack([hidden_of[p] for p in parents]))
            top_logp, top_ids = logp.topk(max(p[-1] for p in level) + 1, dim=-1)
            top_tokens = drafter.to_target(top_ids).tolist()
            for path in level:
                row = parents.index(path[:-1])
                tokens[index[path]] = top_tokens[row][path[-1]]
                probs[index[path]] = float(top_logp[row, path[-1]].exp())
        parents = [index.get(p[:-1], -1) for p in paths]
        scores = []
        for node, parent in enumerate(parents):  # parents come first
            scores.append((scores[parent] if parent >= 0 else 0.0) + math.log(max(probs[node], 1e-30)))
        return Candidates(tokens, parents, [len(p) for p in paths], probs, scores)

    def verified(self, max_nodes: int) -> int:
        return min(len(self.paths), max_nodes)


# ---------------------------------------------------------------------------------------------
# EAGLE-2 and its variants


@dataclass
class Growth:
    """One cycle of a dynamic tree: every candidate node so far, and the beam to expand next."""

    table: _NodeTable
    beam: torch.Tensor  # node indices to expand next (on the CPU)
    beam_hidden: torch.Tensor | None  # the head's outputs at those nodes
    beam_scores: list[torch.Tensor]  # per depth, the path log-probabilities of the beam nodes
    entries_of: dict[int, list[int]] = field(default_factory=lambda: {-1: []})  # node -> its path's cache entries
    info: dict = field(default_factory=dict)  # what the trace should know (DEAGLE's votes)
    two_ahead: tuple | None = None  # Jakiro: (nodes fed, top-k of their two-ahead predictions)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: expand the top-k nodes by path probability, level by level, then keep the best nodes overall."""

    params: DynamicTreeParams = DynamicTreeParams()

    def check(self, head: DraftHead) -> None:
        pass

    def describe(self) -> str:
        p = self.params
        return f"total_tokens {p.total_tokens}, depth {p.depth}, tree_top_k {p.top_k}"

    def verified(self, max_nodes: int) -> int:
        return min(self.params.total_tokens - 1, max_nodes)

    def grow(self, drafter: TreeProposer, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> Candidates:
        return self._grow(drafter, root_hidden, max_depth, max_nodes)

    def _grow(self, drafter: TreeProposer, root_hidden: torch.Tensor, max_depth: int, max_nodes: int,
              stop=None) -> Candidates:
        """The EAGLE-2 loop; `stop(level, growth, keep)` may end the deepening before each level's forward."""
        k, depth = self.params.top_k, min(self.params.depth, max_depth)
        keep = self.verified(max_nodes)
        top_logp, top_ids = drafter.log_probs(root_hidden[None])[0].topk(k)
        table = _NodeTable()
        table.add(drafter.to_target(top_ids), torch.full((k,), -1), 1, top_logp, top_logp)
        growth = Growth(table, beam=torch.arange(k), beam_hidden=root_hidden.expand(k, -1), beam_scores=[top_logp])
        for level in range(1, depth):
            if stop is not None and stop(level, growth, keep):
                break
            child_logp, child_ids, out = self.children(drafter, growth, level, depth)  # each [k, k]
            child_scores = table.scores()[growth.beam.to(child_logp.device)][:, None] + child_logp
            first_child = len(table)
            table.add(drafter.to_target(child_ids).flatten(), growth.beam.repeat_interleave(k), level + 1,
                      child_logp.flatten(), child_scores.flatten())
            best = child_scores.flatten().topk(k).indices
            growth.beam = first_child + best.cpu()
            growth.beam_hidden = None if out is None else out[best // k]
            growth.beam_scores.append(child_scores.flatten()[best])
        return Candidates(table.tokens().tolist(), table.parents().tolist(), table.depths().tolist(),
                          table.logps().exp().tolist(), table.scores().tolist(), info=growth.info)

    def children(self, drafter: TreeProposer, growth: Growth, level: int, depth: int):
        """The top-k children of each beam node: (log-probabilities, draft ids, the beam's head outputs)."""
        out, _ = self.feed_beam(drafter, growth, level)
        child_logp, child_ids = drafter.log_probs(out).topk(self.params.top_k, dim=-1)
        return child_logp, child_ids, out

    @staticmethod
    def feed_beam(drafter: TreeProposer, growth: Growth, level: int, both: bool = False):
        """Run the head on the beam nodes (at depth `level`); returns their outputs (and two-ahead outputs)."""
        on_device = growth.beam.to(growth.beam_hidden.device)
        ancestors = [growth.entries_of[p] for p in growth.table.parents()[growth.beam].tolist()]
        out, right, entries = drafter.feed(growth.beam_hidden, growth.table.tokens()[on_device], level, ancestors, both)
        for row, node in enumerate(growth.beam.tolist()):
            growth.entries_of[node] = ancestors[row] + [entries[row]]
        return out, right


@dataclass(frozen=True)
class DeagleTree(DynamicTree):
    """DEAGLE: the EAGLE-2 tree, with a vote after each scored level that may stop the deepening."""

    deagle: DeagleParams = DeagleParams()

    def grow(self, drafter: TreeProposer, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> Candidates:
        vote = DepthVote(self.deagle)  # one per cycle

        def stop(level: int, growth: Growth, keep: int) -> bool:
            fired = vote.decide(level, growth.beam_scores[-1], growth.table.level_scores(level), growth.table.scores(),
                                torch.cat(growth.beam_scores), keep)
            if fired:
                growth.info.update(stop_depth=level, votes=fired)
            return bool(fired)

        candidates = self._grow(drafter, root_hidden, max_depth, max_nodes, stop)
        candidates.info.setdefault("stop_depth", min(self.params.depth, max_depth))
        candidates.info["depth_votes"] = vote.history
        return candidates


@dataclass(frozen=True)
class JakiroTree(DynamicTree):
    """Jakiro: the deepest level is not drafted by its own forward. The forward one level earlier
    also predicts two tokens ahead (`forward_both`), and those predictions become the children of
    the nodes expanded last. Trees of depth 1-2 grow as EAGLE-2's.
    """

    reference_attach: bool = False  # attach that level by row, as the reference code does

    def check(self, head: DraftHead) -> None:
        if not head.predicts_two_ahead:
            raise ValueError("a parallel last level needs a head that predicts two tokens ahead (Jakiro)")

    def children(self, drafter: TreeProposer, growth: Growth, level: int, depth: int):
        if depth < 3 or level < depth - 2:
            return super().children(drafter, growth, level, depth)
        if level == depth - 2:  # the last forward: also predict the level after next
            out, right = self.feed_beam(drafter, growth, level, both=True)
            growth.two_ahead = (growth.beam, drafter.log_probs(right).topk(self.params.top_k, dim=-1))
            child_logp, child_ids = drafter.log_probs(out).topk(self.params.top_k, dim=-1)
            return child_logp, child_ids, out
        child_logp, child_ids = self._attach_two_ahead(growth.beam, growth.table, growth.two_ahead)
        return child_logp, child_ids, None

    def _attach_two_ahead(self, beam: torch.Tensor, table: _NodeTable, two_ahead):
        """Children for the nodes of `beam` from the two-ahead predictions of their parents' forward.

        Parent-correct by default: a node gets the predictions made at its own parent. The
        reference implementation pairs them by row instead (`reference_attach`), which gives a
        node the predictions of whichever parent happened to sit in the same row.
        """
        parents_fed, (logp, ids) = two_ahead
        if self.reference_attach:
            rows = torch.arange(len(beam))
        else:
            row_of = {node: row for row, node in enumerate(parents_fed.tolist())}
            rows = torch.tensor([row_of[p] for p in table.parents()[beam].tolist()])
        rows = rows.to(logp.device)
        return logp[rows], ids[rows]


@dataclass
class Candidates:
    """Nodes a cycle could verify, parents before children, each scored by the log-probability that
    its whole path is accepted (a child's score never exceeds its parent's)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    probs: list[float]  # given the parent
    scores: list[float]
    sources: list[str] = field(default_factory=list)  # empty: all the head's
    info: dict = field(default_factory=dict)
    evidence: list[int] = field(default_factory=list)  # per lookup node, its match's strength (else 0)

    def add_chain(self, tokens: list[int], accept: float, evidence: int) -> None:
        """A lookup continuation from the root, each token accepted with probability `accept` given
        its parent; where the head proposed the same token under the same parent, the node is shared."""
        if not self.sources:
            self.sources = ["head"] * len(self.tokens)
            self.evidence = [0] * len(self.tokens)
        child = {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens))}
        parent, score = -1, 0.0
        for depth, token in enumerate(tokens, start=1):
            score += math.log(accept)
            node = child.get((parent, token))
            if node is None:
                node = len(self.tokens)
                self.tokens.append(token), self.parents.append(parent), self.depths.append(depth)
                self.probs.append(accept), self.scores.append(score), self.sources.append("lookup")
                self.evidence.append(evidence)
                child[(parent, token)] = node
            else:
                self.sources[node] = "both" if self.sources[node] == "head" else self.sources[node]
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
        value = [math.exp(score) * (head_trust if source == "head" else 1.0)
                 for score, source in zip(self.scores, self.sources or ["head"] * len(self.scores))]
        kept = list(kept)[:max_nodes]
        taken = set(kept)
        # Rank order keeps every parent before its children: a child's path probability never exceeds
        # its parent's, a trust <= 1 scales a head node and its head parent alike, and a shared
        # ("both") parent keeps its full value.
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
        info = dict(self.info)
        if self.evidence:
            info["lookup_evidence"] = [self.evidence[i] for i in chosen]
        return DraftTree(
            tokens=[int(self.tokens[i]) for i in chosen],
            parents=[slot[self.parents[i]] if self.parents[i] >= 0 else -1 for i in chosen],
            depths=[self.depths[i] for i in chosen],
            probs=[float(self.probs[i]) for i in chosen],
            info=info,
            sources=[self.sources[i] for i in chosen] if self.sources else [],
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

    def learn(self, tree: DraftTree, accepted_tokens: list[int]) -> None:
        """Count, at every node of the accepted path (the root first), which of its lookup children
        were accepted: one at most, the others (and all below the path's end) were not."""
        if not tree.sources:  # no lookup node this cycle
            return
        children, evidence = tree.children(), tree.info.get("lookup_evidence", [])
        path = tree.accepted_nodes(accepted_tokens)
        for node, taken in zip([-1] + path, path + [None]):
            for c in children[node + 1]:
                if tree.sources[c] != "head":
                    counts = self.counts[self._bucket(evidence[c])]
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

    def learn(self, tree: DraftTree, accepted_tokens: list[int]) -> None:
        """One cycle: the head-only nodes' path probabilities against how many of them were accepted."""
        sources = tree.sources or ["head"] * len(tree)
        path: list[float] = []
        for parent, prob in zip(tree.parents, tree.probs):
            path.append(prob * (path[parent] if parent >= 0 else 1.0))
        expected = sum(p for p, source in zip(path, sources) if source == "head")
        if expected <= 0:
            return
        accepted = sum(sources[node] == "head" for node in tree.accepted_nodes(accepted_tokens))
        self.accepted = self.accepted * self.DECAY + accepted
        self.expected = self.expected * self.DECAY + expected


class _NodeTable:
    """The candidate nodes of a dynamic tree, level by level (kept as per-level tensors)."""

    def __init__(self):
        self._tokens, self._parents, self._depths, self._logps, self._scores = [], [], [], [], []
        self._count = 0

    def add(self, tokens, parents, depth: int, logps, scores) -> None:
        self._tokens.append(tokens)
        self._parents.append(parents)
        self._depths.append(torch.full((len(tokens),), depth))
        self._logps.append(logps)
        self._scores.append(scores)
        self._count += len(tokens)

    def __len__(self) -> int:
        return self._count

    def tokens(self):
        return torch.cat(self._tokens)

    def parents(self):
        return torch.cat(self._parents)

    def depths(self):
        return torch.cat(self._depths)

    def logps(self):
        return torch.cat(self._logps)

    def scores(self):
        return torch.cat(self._scores)

    def level_scores(self, depth: int):
        return self._scores[depth - 1]
