"""Draft trees, one type for both layouts: the data structure, the record of one cycle, EAGLE-1's static trees.

A draft tree grows from the root, the newest token (not yet in the target's cache). Nodes are
stored parents-before-children, and siblings in decreasing draft probability, which is the order
in which verification tries them. The target verifies the root and every node in one forward:
each node attends to the cached context, to its ancestors and to itself (tree attention), at the
position its depth gives it (each layout builds that forward's inputs: `engine.growing.verify_inputs`
on the host, `engine.fixed.verify_rows` on the device; `acceptance.verify` reads its logits).

Imports no torch: statistics read its types before torch loads.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specchat.decode.drafting.pace import Arm

if TYPE_CHECKING:  # only for annotations: the fixed layout's arrays, a sampled draft's q, DEAGLE's trace
    import torch

    from specchat.decode.drafting.deagle import DepthTrace

# The EAGLE-1 static tree `mc_sim_7b_63` (also Medusa's): each path lists child ranks from the
# root, e.g. (0, 1) = the second most likely child of the most likely first token. 25 nodes
# (26 tokens verified with the root), depth 5, nodes per depth 4, 8, 8, 3, 2.
MC_SIM_7B_63 = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)
STATIC_TREES = {"mc_sim_7b_63": MC_SIM_7B_63}

# Cycles (per 1,000) in which each MC_SIM_7B_63 node was accepted, in its order: measured with
# the bundled EAGLE head on Qwen2.5-Coder-0.5B-Instruct over the first 20 AlpacaEval prompts
# (`specchat run … --method eagle --static-tree mc_sim_7b_63 --trace`, 1,093 cycles, temperature 0).
# It ranks the nodes when the tree is trimmed to a smaller verify budget (a CPU's 16 tokens).
MC_SIM_7B_63_ACCEPTED = (
    291, 91, 57, 43,
    79, 13, 18, 9, 5, 4, 3, 4,
    14, 9, 4, 2, 1, 1, 0, 0,
    3, 3, 1,
    1, 2,
)


def trim_static_tree(paths, nodes: int, accepted) -> tuple[tuple[int, ...], ...]:
    """The `nodes` paths most often accepted (`accepted[i]` for `paths[i]`), as a tree.

    A node is accepted only with its parent, so the most accepted nodes already form a tree;
    ties go to the shallower node, which keeps that true.
    """
    order = sorted(range(len(paths)), key=lambda i: (-accepted[i], len(paths[i]), paths[i]))
    kept: list[tuple[int, ...]] = []
    for i in order:
        if len(kept) == nodes:
            break
        if len(paths[i]) == 1 or paths[i][:-1] in kept:
            kept.append(paths[i])
    return tuple(sorted(kept, key=lambda path: (len(path), path)))


class Source(enum.IntEnum):
    """What proposed a node of a hybrid tree: the draft head, a lookup continuation, or both (a lookup
    chain that spelled a head node's path). Codes, so that the fixed layout's trees hold them as tensors."""

    HEAD = 0
    LOOKUP = 1
    BOTH = 2


@dataclass
class DraftTree:
    """Draft tokens arranged as a tree (a chain is a tree whose parents are i - 1), on either layout.

    The per-node arrays (tokens, parents, depths, probs, sources, evidence) are Python lists on the
    growing layout and in every record; on the fixed layout, between its draft step and the cycle's
    one read, they are device tensors of a bucket's size, the nodes past the drafted ones marked
    invalid (`valid`), and `depth` bounds the nodes' depths (the accepted path's length in the record).

    Attributes:
        tokens: target-vocabulary ids of the draft nodes, parents before children.
        parents: index in `tokens` of each node's parent; -1 for children of the root.
        depths: 1 for children of the root, 2 for their children, ...
        probs: the draft's probability of each node given its parent (no temperature).
        q: [n, vocab] distributions the tokens were *sampled* from (a draft model under
            sampling), or None for deterministic drafts (top-k, lookup).
        sources: per node, what proposed it (`Source`); empty (None on the device): all one drafter's.
        evidence: with `sources`, per node the strength of the lookup match that proposed it (tokens of
            agreeing context; 0 for the head's own nodes).
        shares: with `sources` on the growing layout, per node the share of the weighed lookup
            occurrences that went on with it (`lookup.paths`; 1 for the head's own nodes); empty: 1 each.
        valid: the fixed layout's [n] bool (None: every node is real).
        depth: the fixed layout's bound on the depths (0: not bounded).

    How the tree came to be (what drafted it, the time lookup took, DEAGLE's votes) is the cycle's
    record, not the tree's: `Cycle`.
    """

    tokens: list[int] | torch.Tensor
    parents: list[int] | torch.Tensor
    depths: list[int] | torch.Tensor
    probs: list[float] | torch.Tensor
    q: torch.Tensor | None = None
    sources: list[Source] | torch.Tensor | None = field(default_factory=list)
    evidence: list[int] | torch.Tensor | None = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    valid: torch.Tensor | None = None
    depth: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], probs: list[float] | None = None, source: Source | None = None) -> DraftTree:
        """A chain: each token the child of the one before."""
        n = len(tokens)
        return cls(tokens=list(tokens), parents=list(range(-1, n - 1)), depths=list(range(1, n + 1)),
                   probs=list(probs) if probs is not None else [1.0] * n,
                   sources=[source] * n if source is not None else [])

    @classmethod
    def device_chain(cls, tokens: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor | None = None,
                     q: torch.Tensor | None = None, source: Source | None = None) -> DraftTree:
        """`chain` on the device (the fixed layout's): `valid` marks the real tokens. Tensor methods only,
        so this module still loads without torch."""
        ones = tokens.new_ones(len(tokens))
        depths = ones.cumsum(0)
        return cls(tokens, depths - 2, depths, ones.float() if probs is None else probs, q=q, valid=valid,
                   depth=len(tokens), sources=None if source is None else tokens.new_full(tokens.shape, int(source)),
                   evidence=None)

    def children(self) -> list[list[int]]:
        """children()[0] are the root's children; children()[i + 1] are node i's; in stored order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for node, parent in enumerate(self.parents):
            kids[parent + 1].append(node)
        return kids

    def ancestors(self) -> list[list[int]]:
        """Per node, the indices of its ancestors (root to parent) and itself."""
        lines: list[list[int]] = []
        for node, parent in enumerate(self.parents):
            assert parent < node, "tree nodes must come after their parents"
            lines.append((lines[parent] if parent >= 0 else []) + [node])
        return lines


@dataclass(frozen=True)
class Offer:
    """What a cycle's tree was chosen from (`Cycle.offer`, for the trace): every candidate
    (`selection.Candidates`' lists), the acceptance the selection expected of each (its path's;
    None where it ranked by score alone), and which of them the tree holds, in the tree's order. At
    temperature 0 the answer says which candidates the target would have accepted, so a trace of
    offers shows how well the selection chose, which the verified tree alone cannot."""

    tokens: list[int]
    parents: list[int]
    sources: list[Source]  # empty: all the head's
    values: list[float] | None
    chosen: list[int]  # candidate indices, in the tree's node order

    def record(self) -> dict:
        record = {"tokens": self.tokens, "parents": self.parents, "verified": self.chosen}
        if self.values is not None:
            record["values"] = [round(value, 6) for value in self.values]
        if self.sources:
            record["sources"] = [source.name.lower() for source in self.sources]
        return {"candidates": record}


@dataclass
class Cycle:
    """One draft → verify cycle, as written to the trace and drawn by /tree (the tree's arrays are lists).
    The proposer says how it drafted the tree when the cycle is committed (`Proposer.committed`)."""

    root: int
    tree: DraftTree
    accepted: list[int]  # indices into tree.tokens, root to leaf
    bonus: int
    forward_seconds: float = 0.0  # the verify forward's wall time (what the cost curve learns from)
    arm: Arm | None = None  # what drafted the tree (`pace.Arm`: the head's tree, lookup alone, a draft model)
    lookup_seconds: float = 0.0  # the cycle's time spent finding lookup continuations
    head_trust: float | None = None  # the hybrid drafter's trust in the head this cycle (`trust.HeadTrust`), if any
    trace: DepthTrace | None = None  # what the trace should know beyond the nodes (DEAGLE's votes), if anything
    offer: Offer | None = None  # the candidates the tree was chosen from (the growing layout's hybrid drafter)

    def record(self) -> dict:
        tree = self.tree
        record = {"root": self.root, "tokens": tree.tokens, "parents": tree.parents,
                  "probs": [round(p, 6) for p in tree.probs], "depths": tree.depths, "accepted": self.accepted,
                  "bonus": self.bonus}
        if tree.sources:
            record["sources"] = [source.name.lower() for source in tree.sources]
            if tree.evidence:
                record["lookup_evidence"] = tree.evidence
            if tree.shares:
                record["lookup_shares"] = [round(share, 3) for share in tree.shares]
        if self.lookup_seconds:
            record["lookup_seconds"] = round(self.lookup_seconds, 6)
        if self.head_trust is not None:
            record["head_trust"] = round(self.head_trust, 3)
        if self.arm is not None and len(tree):  # a plain step's empty tree: drafted by nothing (as stats reads it)
            record["arm"] = self.arm.value
        return (record | (self.trace.record() if self.trace is not None else {})
                | (self.offer.record() if self.offer is not None else {}))


def parse_static_tree(spec: str) -> tuple[tuple[int, ...], ...]:
    """A static tree by name (see STATIC_TREES) or as a JSON list of rank paths, checked."""
    if spec in STATIC_TREES:
        return STATIC_TREES[spec]
    try:
        paths = tuple(tuple(int(r) for r in path) for path in json.loads(spec))
    except (ValueError, TypeError) as error:
        raise ValueError(f"a static tree is one of {', '.join(STATIC_TREES)} or a JSON list of rank paths") from error
    known = set()
    for path in sorted(paths, key=len):
        if not path or min(path) < 0:
            raise ValueError(f"bad static tree path {list(path)}: ranks are non-negative and paths non-empty")
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"static tree path {list(path)} has no parent path {list(path[:-1])}")
        known.add(path)
    if len(known) != len(paths):
        raise ValueError("a static tree lists a path twice")
    return paths
