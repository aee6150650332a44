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
from specchat.engine import GenerationSettings
from specchat.tree import MC_SIM_7B_63, DraftTree

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
                 dynamic: DynamicTreeParams | None = None):
        self.head = head
        self.feature_layers = head.feature_layers(num_target_layers)
        self.static_paths = static_paths
        self.dynamic = dynamic or DynamicTreeParams()
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
    def propose(self, root: int, settings: GenerationSettings, max_depth: int, max_nodes: int) -> DraftTree:
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
              ancestor_entries: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Run the head on m tree nodes of one depth; returns their outputs and their cache entries."""
        m, cached = len(tokens), self.cache.length
        mask = torch.zeros(m, cached + m, dtype=torch.bool, device=tokens.device)
        mask[:, : self.consumed] = True
        for row, entries in enumerate(ancestor_entries):
            mask[row, entries] = True
            mask[row, cached + row] = True
        positions = torch.full((m,), self.consumed - 1 + depth, device=tokens.device)
        out = self.head(parent_hidden, tokens, positions, mask[None, None], self.cache)
        return out, list(range(cached, cached + m))

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
                out, entries = self._feed(
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
        """EAGLE-2: expand the top-k nodes by path probability, then keep the best nodes overall."""
        params = self.dynamic
        k, depth = params.top_k, min(params.depth, max_depth)
        logp = self.head.log_probs(root_hidden[None])[0]
        top_logp, top_ids = logp.topk(k)
        # Node table, level by level: target token, parent node, depth, log p(node | parent), log p(path).
        tokens, parents, depths = [self._to_target(top_ids)], [torch.full((k,), -1)], [torch.full((k,), 1)]
        logps, scores = [top_logp], [top_logp]
        beam = torch.arange(k)  # node indices to expand next
        beam_hidden = root_hidden.expand(k, -1)
        entries_of = {-1: []}
        count = k
        for level in range(1, depth):
            on_device = beam.to(root_hidden.device)
            flat_tokens, flat_scores = torch.cat(tokens), torch.cat(scores)
            ancestors = [entries_of[int(p)] for p in torch.cat(parents)[beam]]
            out, entries = self._feed(beam_hidden, flat_tokens[on_device], level, ancestors)
            for row, node in enumerate(beam.tolist()):
                entries_of[node] = ancestors[row] + [entries[row]]
            child_logp, child_ids = self.head.log_probs(out).topk(k, dim=-1)  # [k, k]
            child_scores = flat_scores[on_device][:, None] + child_logp
            tokens.append(self._to_target(child_ids).flatten())
            parents.append(beam.repeat_interleave(k))
            depths.append(torch.full((k * k,), level + 1))
            logps.append(child_logp.flatten())
            scores.append(child_scores.flatten())
            best = child_scores.flatten().topk(k).indices
            beam, beam_hidden = count + best.cpu(), out[best // k]
            count += k * k
        return _select(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(logps), torch.cat(scores),
                       min(params.total_tokens - 1, max_nodes))


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
