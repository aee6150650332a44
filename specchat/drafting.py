"""Drafting with a draft head: the EAGLE-1 static tree and the EAGLE-2 dynamic tree.

The head keeps its own KV cache. Entry j of it is the head's step on (the target's feature at
position j, the token at position j + 1), at RoPE position j, which is EAGLE's convention. After
the context pass over the newly committed positions, the last entry pairs the newest committed
feature with the root, and its output predicts the root's children. Tree nodes at depth d sit at
position (committed entries - 1 + d); their entries are appended while the tree grows and
trimmed away afterwards, since only committed context belongs in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.cache import KVCache
from specchat.deagle import DeagleParams, DepthVote
from specchat.engine import GenerationSettings
from specchat.tree import DraftTree

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
    """Proposes draft trees with a draft head (see `drafters/`)."""

    def __init__(self, head, num_target_layers: int, static_paths: tuple | None = None,
                 dynamic: DynamicTreeParams | None = None, deagle: DeagleParams | None = None,
                 parallel_last_level: bool = False, reference_attach: bool = False):
        """
        Args:
            static_paths: draft this fixed tree (EAGLE-1) instead of a dynamic one.
            dynamic: the EAGLE-2 tree budget.
            deagle: stop deepening by DEAGLE's vote (see `specchat.deagle`).
            parallel_last_level: Jakiro: the last level comes from the two-ahead output of the
                forward before it (needs a head with `forward_both`).
            reference_attach: Jakiro: attach that level by row, as the reference code does.
        """
        if parallel_last_level and not hasattr(head, "forward_both"):
            raise ValueError("a parallel last level needs a head that predicts two tokens ahead (Jakiro)")
        self.head = head
        self.feature_layers = head.feature_layers(num_target_layers)
        self.static_paths = static_paths
        self.dynamic = dynamic or DynamicTreeParams()
        self.deagle = deagle
        self.parallel_last_level = parallel_last_level
        self.reference_attach = reference_attach
        self.cache = KVCache()
        self.consumed = 0  # cache entries of committed context pairs
        self.pending_features: list[torch.Tensor] = []  # target features from position `consumed` on
        self.pending_tokens: list[int] = []  # the tokens at those positions

    # -- Proposer protocol -----------------------------------------------------------------

    def rewind(self, length: int) -> int:
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

    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)

    @torch.inference_mode()
    def propose(self, root: int, settings: GenerationSettings, rng, max_depth: int, max_nodes: int) -> DraftTree:
        root_hidden = self._context_pass(root)
        try:
            if self.static_paths is not None:
                return self._grow_static(root_hidden, max_depth, max_nodes)
            return self._grow_dynamic(root_hidden, max_depth, max_nodes)
        finally:
            self.cache.trim(self.consumed)  # tree entries were scratch space

    # -- drafting --------------------------------------------------------------------------

    def _context_pass(self, root: int) -> torch.Tensor:
        """Feed the pending (feature, next token) pairs; return the output that predicts the root's children."""
        features = torch.cat(self.pending_features)
        device = features.device
        count = len(self.pending_tokens)
        next_tokens = torch.tensor(self.pending_tokens[1:] + [root], device=device)
        positions = torch.arange(self.consumed, self.consumed + count, device=device)
        mask = torch.ones(count, self.consumed + count, dtype=torch.bool, device=device)
        mask[:, self.consumed:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
        out = self.head(features, next_tokens, positions, mask[None, None], self.cache)
        self.consumed += count
        self.pending_features, self.pending_tokens = [], []
        return out[-1]

    def _feed(self, parent_hidden: torch.Tensor, tokens: torch.Tensor, depth: int,
              ancestor_entries: list[list[int]], both: bool = False):
        """Run the head on m tree nodes of one depth.

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

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        table = self.head.draft_to_target
        return draft_ids if table is None else table[draft_ids]

    def _grow_static(self, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> DraftTree:
        """EAGLE-1: a fixed tree of child ranks, filled in level by level."""
        paths = sorted((p for p in self.static_paths if len(p) <= max_depth), key=lambda p: (len(p), p))[:max_nodes]
        index = {path: i for i, path in enumerate(paths)}
        tokens, probs = [0] * len(paths), [0.0] * len(paths)
        hidden_of, entries_of = {(): root_hidden}, {(): []}
        for depth in range(1, max(map(len, paths), default=0) + 1):
            level = [p for p in paths if len(p) == depth]
            parents = sorted({p[:-1] for p in level})
            if depth > 1:  # feed the parents (depth - 1 nodes with children) to get their outputs
                out, _, entries = self._feed(
                    torch.stack([hidden_of[p[:-1]] for p in parents]),
                    torch.tensor([tokens[index[p]] for p in parents], device=root_hidden.device),
                    depth - 1, [entries_of[p[:-1]] for p in parents])
                for row, parent in enumerate(parents):
                    hidden_of[parent], entries_of[parent] = out[row], entries_of[parent[:-1]] + [entries[row]]
            rows = torch.stack([hidden_of[p] for p in parents])
            logp = self.head.log_probs(rows)
            top_logp, top_ids = logp.topk(max(p[-1] for p in level) + 1, dim=-1)
            top_tokens = self._to_target(top_ids).tolist()
            for path in level:
                row = parents.index(path[:-1])
                tokens[index[path]] = top_tokens[row][path[-1]]
                probs[index[path]] = float(top_logp[row, path[-1]].exp())
        return DraftTree(tokens=tokens, parents=[index.get(p[:-1], -1) for p in paths],
                         depths=[len(p) for p in paths], probs=probs)

    def _grow_dynamic(self, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> DraftTree:
        """EAGLE-2: expand the top-k nodes by path probability, then keep the best nodes overall.

        With `parallel_last_level` (Jakiro) the deepest level is not drafted by its own forward:
        the forward one level earlier also predicts two tokens ahead, and those predictions become
        the children of the nodes expanded last. With `deagle`, a vote after each level may stop
        the deepening early.
        """
        params = self.dynamic
        k, depth = params.top_k, min(params.depth, max_depth)
        keep = min(params.total_tokens - 1, max_nodes)
        logp = self.head.log_probs(root_hidden[None])[0]
        top_logp, top_ids = logp.topk(k)
        table = _NodeTable()
        table.add(self._to_target(top_ids), torch.full((k,), -1), 1, top_logp, top_logp)
        beam = torch.arange(k)  # node indices to expand next
        beam_hidden = root_hidden.expand(k, -1)
        beam_scores = [top_logp]  # per depth, the scores of the nodes kept for expansion
        entries_of = {-1: []}
        parallel = self.parallel_last_level and depth >= 3
        vote = DepthVote(self.deagle) if self.deagle else None
        info, two_ahead = {}, None
        for level in range(1, depth):
            if vote is not None:
                fired = vote.decide(level, beam_scores[-1], table.level_scores(level), table.scores(),
                                    torch.cat(beam_scores), keep)
                if fired:
                    info.update(stop_depth=level, votes=fired)
                    break
            if parallel and level == depth - 1:
                child_logp, child_ids = self._attach_two_ahead(beam, table, two_ahead)
            else:
                on_device = beam.to(root_hidden.device)
                ancestors = [entries_of[p] for p in table.parents()[beam].tolist()]
                out, right, entries = self._feed(beam_hidden, table.tokens()[on_device], level, ancestors,
                                                 both=parallel and level == depth - 2)
                for row, node in enumerate(beam.tolist()):
                    entries_of[node] = ancestors[row] + [entries[row]]
                if right is not None:
                    two_ahead = (beam, self.head.log_probs(right).topk(k, dim=-1))
                child_logp, child_ids = self.head.log_probs(out).topk(k, dim=-1)  # [k, k]
            child_scores = table.scores()[beam.to(child_logp.device)][:, None] + child_logp
            first_child = len(table)
            table.add(self._to_target(child_ids).flatten(), beam.repeat_interleave(k), level + 1,
                      child_logp.flatten(), child_scores.flatten())
            best = child_scores.flatten().topk(k).indices
            beam, beam_hidden = first_child + best.cpu(), (None if parallel and level == depth - 1 else out[best // k])
            beam_scores.append(child_scores.flatten()[best])
        else:
            if vote is not None:
                info["stop_depth"] = depth
        if vote is not None:
            info["depth_votes"] = vote.history
        tree = _select(table.tokens(), table.parents(), table.depths(), table.logps(), table.scores(), keep)
        tree.info = info
        return tree

    def _attach_two_ahead(self, beam: torch.Tensor, table: "_NodeTable", two_ahead):
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

def _select(tokens, parents, depths, logps, scores, keep: int) -> DraftTree:
    """Keep the `keep` best nodes by path probability (ties: shallower first), as a connected tree.

    A child's path probability never exceeds its parent's, and ties go to the shallower node, so
    every kept node's parent is kept too; listing them by (depth, -score) puts parents first and
    siblings in decreasing probability.
    """
    score, depth = scores.tolist(), depths.tolist()
    order = sorted(range(len(score)), key=lambda i: (-score[i], depth[i], i))[:keep]
    order.sort(key=lambda i: (depth[i], -score[i], i))
    slot = {node: position for position, node in enumerate(order)}
    parent = parents.tolist()
    return DraftTree(
        tokens=[int(tokens[i]) for i in order],
        parents=[slot[parent[i]] if parent[i] >= 0 else -1 for i in order],
        depths=[depth[i] for i in order],
        probs=[float(logps[i].exp()) for i in order],
    )


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
