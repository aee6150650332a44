"""Which drafted tokens the target accepts, without changing what the target would say.

Notation as in the papers: p is the target's processed distribution (temperature, top-k, top-p
applied; a point mass on the argmax when greedy), q the draft's.

Deterministic drafts (EAGLE trees, prompt lookup) are point-mass proposals, so the recursive
rejection rule of SpecInfer (Miao et al. 2024) with q = 1 applies: going down the tree, try the
children of the current node in order; accept child x with probability p(x) / sum(p); on
rejection set p(x) = 0 and try the next sibling; when every child is rejected, draw the bonus
token from what is left of p. Every token is then distributed exactly as p, whatever process
proposed the candidates — so the rule is lossless for any drafter, and when greedy it reduces
to following the argmax. For point-mass drafts it has an equivalent form, which both layouts
run: draw the target's own token y ~ p at a row, follow the first child whose token is y, and
when none is, y is the bonus. With distinct sibling tokens child x is then accepted with
probability p(x), as with the recursive rule, and a bonus y is a draw from p with the children's
mass removed, renormalized: the recursive rule's bonus. Every committed token is a draw from p
given the tokens before it, so the committed tokens are distributed as plain sampling's; greedy,
y is the argmax.

Sampled chains (a draft model at temperature > 0) use the standard rule instead (Leviathan et
al. 2023, Algorithm 1; Chen et al. 2023): accept x with probability min(1, p(x) / q(x)), and on
rejection draw from norm(max(0, p - q)).

The rules run in two forms, one per layout. The growing layout's (`accept`, `follow`: the
reference) walks the tree on the host, drawing y at each row it visits (greedy: every row's choice
in one read), which costs a CPU cycle no tensor operation beyond them. The fixed layout's
(`accept_fixed`, `follow_fixed`) runs on the device without a host read, at a fixed shape: it
draws y at every row at once (each row's draw independent, each row visited at most once, so the
unvisited rows' draws change nothing), padding nodes (`DraftTree.valid`) are never accepted and
acceptance stops at the reply's room (`limit`), so a tree never changes shape near the end. Given
the same draws, the two forms accept the same path and bonus (tests/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.decode.acceptance.sampling import SamplingParams, argmax, draw_rows, sample, sample_rows, target_probs
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.runtime.envelope import pick


@dataclass
class Acceptance:
    path: list[int]  # accepted node indices, root to leaf
    bonus: int  # the token the target adds after them (correction or extension)


def _uniform(rng: torch.Generator | None) -> float:
    return float(torch.rand((), generator=rng))


def accept(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, rng: torch.Generator | None,
           choices: list[int] | None = None) -> Acceptance:
    """Walk the tree (host lists) with the target's logits; row 0 belongs to the root, row i + 1 to node i.
    Greedy, `choices` are the rows' argmaxes if the caller has them already."""
    if tree.q is not None:
        return accept_sampled_chain(tree, logits, sampling, rng)
    if sampling.greedy:
        # Every row's choice in one read, not one device-to-host wait per row on a GPU (on a CPU the
        # rows the walk never reaches cost little: one pass each over the vocabulary).
        choices = argmax(logits) if choices is None else choices
        return follow(tree, choices.__getitem__)
    logits = logits.float()  # once for all rows the walk samples from
    return follow(tree, lambda row: sample(target_probs(logits[row], sampling), rng))  # y ~ p, at rows visited


def follow(tree: DraftTree, choice) -> Acceptance:
    """The point-mass rule (module docstring) on the host, the reference of `follow_fixed`: from the
    root, the first child whose token is its row's `choice(row)` (the target's token there), until
    no child is; that row's choice is the bonus."""
    children = tree.children()
    path: list[int] = []
    row = 0
    while True:
        drawn = choice(row)
        chosen = next((c for c in children[row] if tree.tokens[c] == drawn), None)
        if chosen is None:
            return Acceptance(path, drawn)
        path.append(chosen)
        row = chosen + 1


def _draw_residual(p: torch.Tensor, logits: torch.Tensor, rng) -> int:
    mass = float(p.sum())
    if mass <= 0:  # only rounding can empty p (all of it sat on rejected tokens); fall back to the mode
        return int(logits.argmax())
    return sample(p / mass, rng)


def accept_sampled_chain(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, rng) -> Acceptance:
    """Standard speculative sampling over a chain drawn from q (tree.q[i] is the draft's distribution at node i)."""
    path: list[int] = []
    for node, x in enumerate(tree.tokens):
        p = target_probs(logits[node], sampling)
        q = tree.q[node].float()
        if _uniform(rng) * float(q[x]) < float(p[x]):  # accept with probability min(1, p(x)/q(x))
            path.append(node)
            continue
        residual = (p - q).clamp_min(0)
        return Acceptance(path, _draw_residual(residual, logits[node], rng))
    return Acceptance(path, sample(target_probs(logits[len(tree.tokens)], sampling), rng))


@dataclass
class FixedAcceptance:
    """`Acceptance` as device tensors: how many nodes were accepted, which (depth by depth), the bonus."""

    count: torch.Tensor  # 0-d: accepted draft tokens
    path: torch.Tensor  # [tree.depth] node at each depth of the path (meaningless past `count`)
    bonus: torch.Tensor  # 0-d: the target's token after the path

    def kept_rows(self) -> torch.Tensor:
        """[tree.depth + 1] the verify rows of the root and the path, as the cache compacts them."""
        return torch.cat([self.path.new_zeros(1), self.path + 1])


def accept_fixed(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, rng, limit: torch.Tensor,
                 ancestors: torch.Tensor | None = None) -> FixedAcceptance:
    """`accept` on the device for a tree of device tensors: no host read, no shape that depends on the
    draft. Nodes deeper than `limit` (a 0-d tensor) are never accepted. `ancestors`:
    `ancestor_mask(tree)`, if the caller has it already (the verify step's mask is made of it)."""
    if tree.q is not None:
        return accept_fixed_chain(tree, logits, sampling, rng, limit)
    drawn = draw_rows(logits, sampling, rng)  # the target's token at every row (module docstring)
    return follow_fixed(tree, drawn, limit, ancestor_mask(tree) if ancestors is None else ancestors)


def follow_fixed(tree: DraftTree, drawn: torch.Tensor, limit: torch.Tensor, ancestors: torch.Tensor) -> FixedAcceptance:
    """`follow` on the device, every row's token `drawn` [n + 1] at once: a node is on the path when
    it and each of its ancestors is the first child of its parent matching the parent row's token."""
    matched = tree.valid & (tree.depths <= limit) & (tree.tokens == drawn[tree.parents + 1])
    matched &= ~(earlier_siblings(tree) & matched[None, :]).any(-1)  # the first matching child only
    on_path = matched & ~(ancestors & ~matched[None, :]).any(-1)  # it and all its ancestors matched
    reached = torch.where(on_path, tree.depths, 0)
    count, last = reached.max(), reached.argmax()
    path_nodes = pick(ancestors, last) & (count > 0)
    levels = torch.arange(1, tree.depth + 1, device=drawn.device)
    path = (path_nodes[None, :] & (tree.depths[None, :] == levels[:, None])).byte().argmax(-1)
    bonus = pick(drawn, torch.where(count > 0, last + 1, 0))
    return FixedAcceptance(count, path, bonus)


def accept_fixed_chain(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, rng, limit: torch.Tensor
                       ) -> FixedAcceptance:
    """`accept_sampled_chain` on the device. A node the chain could not try (past `limit`, or
    invalid) ends it without a rejection: the bonus is then drawn from p itself."""
    k, device = len(tree), logits.device
    nodes = torch.arange(k, device=device)
    p = target_probs(logits, sampling)  # [k + 1, V]
    q = tree.q.float()
    tried = tree.valid & (tree.depths <= limit)
    u = torch.rand(k, generator=rng, device=device)
    accepted = tried & (u * q[nodes, tree.tokens] < p[nodes, tree.tokens])  # with probability min(1, p/q)
    count = accepted.long().cumprod(0).sum()
    row = count.clamp(max=k - 1)
    rejected = (count < k) & pick(tried, row)
    residual = torch.where(rejected, (pick(p, row) - pick(q, row)).clamp_min(0), pick(p, count))
    drawn = sample_rows(residual[None], rng)[0]
    bonus = torch.where(residual.sum() > 0, drawn, pick(logits, count).float().argmax())  # see _draw_residual
    return FixedAcceptance(count, nodes[: tree.depth], bonus)  # a chain's path: its first nodes


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[n, n] bool of a device tree: row i marks node i and its ancestors (a fixed number of steps, no host read)."""
    n, device = len(tree), tree.tokens.device
    marks = torch.eye(n, dtype=torch.bool, device=device)
    current = tree.parents
    for _ in range(tree.depth - 1):
        has_parent = current >= 0
        marks |= torch.nn.functional.one_hot(current.clamp(min=0), n).bool() & has_parent[:, None]
        current = torch.where(has_parent, tree.parents[current.clamp(min=0)], current)
    return marks


def earlier_siblings(tree: DraftTree) -> torch.Tensor:
    """[n, n] bool of a device tree: row i marks the siblings stored before node i (tried before it)."""
    n, device = len(tree), tree.tokens.device
    before = torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal=-1)
    return before & (tree.parents[:, None] == tree.parents[None, :])
