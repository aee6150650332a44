"""Draft trees: the data structure, static tree shapes, and the record of one cycle.

A draft tree grows from the root, the newest token (not yet in the target's cache). Nodes are
stored parents-before-children, and siblings in decreasing draft probability, which is the order
in which verification tries them. The target verifies the root and every node in one forward:
each node attends to the cached context, to its ancestors and to itself (tree attention), at the
position its depth gives it (`specchat.decode.verify.verify_inputs` builds that forward's inputs).

Plain data, no tensors: the lookup drafter and the method registry use it before torch loads.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: a sampled draft carries its distributions q
    import torch

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
    chain that spelled a head node's path). The codes are the fixed envelope's too (`FixedTree.sources`)."""

    HEAD = 0
    LOOKUP = 1
    BOTH = 2


@dataclass
class DraftTree:
    """Draft tokens arranged as a tree (a chain is a tree whose parents are i - 1).

    Attributes:
        tokens: target-vocabulary ids of the draft nodes, parents before children.
        parents: index in `tokens` of each node's parent; -1 for children of the root.
        depths: 1 for children of the root, 2 for their children, ...
        probs: the draft's probability of each node given its parent (no temperature).
        q: [n, vocab] distributions the tokens were *sampled* from (a draft model under
            sampling), or None for deterministic drafts (top-k, lookup).
        info: method-specific facts for the trace only (DEAGLE's stop depth and votes).
        sources: per node, what proposed it (`Source`); empty: all one drafter's.
        lookup_evidence: with `sources`, per node the strength of the lookup match that proposed
            it (tokens of agreeing context; 0 for the head's own nodes).
        lookup_seconds: the cycle's time spent finding lookup continuations.
        head_trust: the hybrid drafter's trust in the head this cycle (`hybrid.HeadTrust`), if any.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    probs: list[float]
    q: torch.Tensor | None = None
    info: dict = field(default_factory=dict)
    sources: list[Source] = field(default_factory=list)
    lookup_evidence: list[int] = field(default_factory=list)
    lookup_seconds: float = 0.0
    head_trust: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], probs: list[float] | None = None, source: Source | None = None) -> DraftTree:
        """A chain: each token the child of the one before."""
        n = len(tokens)
        return cls(tokens=list(tokens), parents=list(range(-1, n - 1)), depths=list(range(1, n + 1)),
                   probs=list(probs) if probs is not None else [1.0] * n,
                   sources=[source] * n if source is not None else [])

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


@dataclass
class Cycle:
    """One draft → verify cycle, as written to the trace and drawn by /tree."""

    root: int
    tree: DraftTree
    accepted: list[int]  # indices into tree.tokens, root to leaf
    bonus: int
    forward_seconds: float = 0.0  # the verify forward's wall time (what the cost curve learns from)

    def record(self) -> dict:
        return {
            "root": self.root, "tokens": self.tree.tokens, "parents": self.tree.parents,
            "probs": [round(p, 6) for p in self.tree.probs], "depths": self.tree.depths,
            "accepted": self.accepted, "bonus": self.bonus, **self._lookup_record(), **self.tree.info,
        }

    def _lookup_record(self) -> dict:
        tree, record = self.tree, {}
        if tree.sources:
            record["sources"] = [source.name.lower() for source in tree.sources]
            if tree.lookup_evidence:
                record["lookup_evidence"] = tree.lookup_evidence
        if tree.lookup_seconds:
            record["lookup_seconds"] = round(tree.lookup_seconds, 6)
        if tree.head_trust is not None:
            record["head_trust"] = round(tree.head_trust, 3)
        return record


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
