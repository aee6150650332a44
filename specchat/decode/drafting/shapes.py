"""What a draft head drafts in a cycle: the tree shapes, grown as tensors of fixed size.

- `StaticTree`  EAGLE-1: a fixed tree of child ranks, filled in level by level;
- `DynamicTree` EAGLE-2: expand the most probable nodes level by level, keep the best overall;
- `DeagleTree`  the EAGLE-2 tree, deepened only while DEAGLE's vote allows (`specchat.decode.drafting.deagle`);
- `JakiroTree`  the EAGLE-2 tree whose last level comes from the two-ahead output of the forward
  before it (a Jakiro head), one draft forward fewer.

A shape grows a `CandidateTable` (`specchat.decode.drafting.growth`): every node the cycle could
verify, level by level, each scored by the log-probability that its whole path is accepted. It
runs the head through `HeadSteps`, which the layout provides (`specchat.decode.drafting.heads`): the growing layout's appends the
tree's entries to the head's growing cache and stops when DEAGLE's vote says so; the fixed
layout's writes them at fixed slots and drafts to the full depth, dropping the levels after the
vote, so that no step waits on the host. The shapes' arithmetic is one and the same for both, and
so are the trees. How large a cycle's tree is, on either layout, is `tree_budget`'s.

The head's cache entries of a cycle's tree: every node a level feeds gets one, in feeding order
(`first_entry` + row); a fed node attends to the context, to its ancestors' entries and to its own
(`entries`, a [rows, tree entries] mask), at position (context - 1 + its depth).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from drafters import DraftHead
from specchat.decode.drafting.deagle import DeagleParams, DepthTrace, DepthVote
from specchat.decode.drafting.growth import CandidateTable, Growth, HeadSteps, HostTable

# EAGLE-2 (Li et al. 2024, arXiv 2406.16858) reference settings: 60 tokens verified per cycle
# (root included), 6 draft levels (the code's depth=5 counts expansions after the first level),
# top-10 expansion. EAGLE-3's reference uses 8 levels (depth=7).
PAPER_TOTAL_TOKENS, PAPER_DEPTH, PAPER_TOP_K = 60, 6, 10


def tree_budget(shape: StaticTree | DynamicTree, max_depth: int, max_nodes: int) -> tuple[int, int]:
    """How many nodes a cycle verifies and how deep the head drafts where no verify-cost curve sizes the
    tree (the fixed layout, a GPU): the shape's budget within the room (`max_depth` levels and
    `max_nodes` nodes: the growing layout's reply and context room, the fixed layout's largest tree).
    With a curve the growing layout's rate rules size it instead (`heads.GrowingHead.narrow`)."""
    return shape.verified(max_nodes), shape.depth_for(max_depth)


@dataclass(frozen=True)
class DynamicTreeParams:
    total_tokens: int = PAPER_TOTAL_TOKENS  # tokens verified per cycle, the root included
    depth: int = PAPER_DEPTH  # most draft tokens on one path (tree levels)
    top_k: int = PAPER_TOP_K  # children per expanded node, and nodes expanded per level

    def __post_init__(self):
        if self.total_tokens < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError("total_tokens must be >= 2, depth and top_k >= 1")


# ---------------------------------------------------------------------------------------------
# EAGLE-1


@dataclass(frozen=True)
class _StaticLevel:
    """How one level of a static tree is filled (indices precomputed from the paths)."""

    start: int  # table index of the level's first node
    parents: tuple[int, ...]  # table index of each node's parent (-1: the root)
    rows: tuple[int, ...]  # each node's parent's row among the outputs (the previous level's fed nodes)
    ranks: tuple[int, ...]  # each node's child rank
    fed: tuple[int, ...]  # table indices of the previous level's nodes that have children (fed first)
    fed_rows: tuple[int, ...]  # their parents' rows among the outputs before (entries and hidden states)
    first_entry: int


@dataclass(frozen=True)
class StaticTree:
    """EAGLE-1: a fixed tree of child ranks (paths from the root, e.g. `specchat.decode.drafting.tree.MC_SIM_7B_63`)."""

    paths: tuple[tuple[int, ...], ...]
    grows_on_host = False  # (`DynamicTree.grow_on_host`)

    def check(self, head: DraftHead) -> None:
        pass

    def describe(self) -> str:
        return f"static, {len(self.paths)} draft tokens"

    def trace(self, table: CandidateTable) -> DepthTrace | None:
        """What the trace should know of a cycle's tree beyond its nodes (the growing layout's drafter)."""
        return None

    def verified(self, max_nodes: int) -> int:
        return min(len(self.paths), max_nodes)

    def most_children(self) -> int:
        """The most children a node gets: the largest k the shape asks of `HeadSteps.top`."""
        return max((path[-1] for path in self.paths), default=0) + 1

    def depth_for(self, max_depth: int) -> int:
        return min(max((len(p) for p in self.paths), default=0), max_depth)

    def entries(self, depth: int) -> int:
        return sum(len(level.fed) for level in self._plan(depth, len(self.paths))[1:])

    @functools.lru_cache(maxsize=64)
    def _plan(self, max_depth: int, max_nodes: int) -> tuple[_StaticLevel, ...]:
        paths = sorted((p for p in self.paths if len(p) <= max_depth), key=lambda p: (len(p), p))[:max_nodes]
        index = {path: i for i, path in enumerate(paths)}
        levels, previous_fed, entry = [], [()], 0  # the root's output is row 0 of the first level's outputs
        for depth in range(1, max((len(p) for p in paths), default=0) + 1):
            level = [p for p in paths if len(p) == depth]
            fed = sorted({p[:-1] for p in level})  # the nodes (of depth - 1) whose children this level holds
            row_of = {p: row for row, p in enumerate(fed)}
            before = {p: row for row, p in enumerate(previous_fed)}
            levels.append(_StaticLevel(
                start=index[level[0]], parents=tuple(index.get(p[:-1], -1) for p in level),
                rows=tuple(row_of[p[:-1]] for p in level), ranks=tuple(p[-1] for p in level),
                fed=tuple(index[p] for p in fed) if depth > 1 else (),
                fed_rows=tuple(before[p[:-1]] for p in fed) if depth > 1 else (), first_entry=entry))
            entry += len(levels[-1].fed)
            previous_fed = fed
        return tuple(levels)

    def grow(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> CandidateTable:
        """Fill the tree in level by level: the head runs once per level on the nodes that have children."""
        plan = self._plan(max_depth, max_nodes)
        device = root_hidden.device
        size = sum(len(level.parents) for level in plan)
        table = CandidateTable.allocate(size, device)
        entries_total = sum(len(level.fed) for level in plan)
        outputs = root_hidden[None]  # the outputs that predict this level's nodes, by row
        out_entries = torch.zeros(1, entries_total, dtype=torch.bool, device=device)
        for depth, level in enumerate(plan, start=1):
            if depth > 1:  # feed the nodes with children, each with its parent's output
                fed, fed_rows = _on(device, level.fed), _on(device, level.fed_rows)
                own = level.first_entry + torch.arange(len(level.fed), device=device)
                entries = out_entries[fed_rows] | torch.nn.functional.one_hot(own, entries_total).bool()
                outputs, _ = steps.feed(outputs[fed_rows], table.tokens[fed], depth - 1, level.first_entry, entries)
                out_entries = entries
            top_logp, top_ids = steps.top(outputs, max(level.ranks) + 1)
            rows, ranks = _on(device, level.rows), _on(device, level.ranks)
            parents = _on(device, level.parents)
            logps = top_logp[rows, ranks]
            base = torch.where(parents >= 0, table.scores[parents.clamp(min=0)], 0.0)
            table.write(level.start, steps.to_target(top_ids[rows, ranks]), parents, depth, logps, base + logps)
        return table


@functools.lru_cache(maxsize=1024)
def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _on(device, values: tuple[int, ...]) -> torch.Tensor:
    """A plan's indices as a tensor on `device`, made once (a captured step may not copy from the host)."""
    return _on_device(values, torch.device(device))


# ---------------------------------------------------------------------------------------------
# EAGLE-2 and its variants


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: expand the top-k nodes by path probability, level by level, then keep the best nodes overall."""

    params: DynamicTreeParams = DynamicTreeParams()
    grows_on_host = True  # `grow_on_host`: the same tree on host lists, for a layout that reads each level

    def check(self, head: DraftHead) -> None:
        pass

    def describe(self) -> str:
        p = self.params
        return f"total_tokens {p.total_tokens}, depth {p.depth}, tree_top_k {p.top_k}"

    def trace(self, table: CandidateTable) -> DepthTrace | None:
        return None

    def verified(self, max_nodes: int) -> int:
        return min(self.params.total_tokens - 1, max_nodes)

    def most_children(self) -> int:
        return self.params.top_k

    def depth_for(self, max_depth: int) -> int:
        return min(self.params.depth, max_depth)

    def entries(self, depth: int) -> int:
        return (depth - 1) * self.params.top_k

    def grow(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> CandidateTable:
        return self._grow(steps, root_hidden, max_depth, max_nodes)

    def _grow(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int,
              stop=None) -> CandidateTable:
        """The EAGLE-2 loop; `stop(level, growth, keep)` votes before each level's forward (DEAGLE)."""
        k, depth = self.params.top_k, self.depth_for(max_depth)
        keep, device = self.verified(max_nodes), root_hidden.device
        top_logp, top_ids = (best[0] for best in steps.top(root_hidden[None], k))
        table = CandidateTable.allocate(k + (depth - 1) * k * k, device)
        table.write(0, steps.to_target(top_ids), -1, 1, top_logp, top_logp)
        growth = Growth(table, beam=torch.arange(k, device=device), beam_hidden=root_hidden.expand(k, -1),
                        beam_entries=torch.zeros(k, self.entries(depth), dtype=torch.bool, device=device),
                        beam_scores=[top_logp])
        if depth > 1:  # the first beam narrowed as each later one is (below)
            growth.beam = steps.narrow(growth, growth.beam, 1)
            growth.beam_hidden = growth.beam_hidden[: len(growth.beam)]
            growth.beam_entries = growth.beam_entries[: len(growth.beam)]
            growth.beam_scores = [top_logp[growth.beam]]
        for level in range(1, depth):
            if not len(growth.beam) or stop is not None and steps.stops(stop(level, growth, keep), growth):
                break
            child_logp, child_ids, out = self.children(steps, growth, level, depth)  # each [beam, k]
            child_scores = table.scores[growth.beam][:, None] + child_logp
            if growth.alive is not None:
                child_scores = child_scores.masked_fill(~growth.alive, float("-inf"))
            first_child = k + (level - 1) * k * k
            table.write(first_child, steps.to_target(child_ids).flatten(),
                        growth.beam[:, None].expand(-1, k).flatten(), level + 1, child_logp.flatten(),
                        child_scores.flatten())
            best = child_scores.flatten().topk(k).indices
            best = steps.narrow(growth, first_child + best, level + 1) - first_child if level + 1 < depth else best
            if not len(best):
                break
            growth.parent_rows = best // k
            growth.beam = first_child + best
            growth.beam_hidden = None if out is None else out[growth.parent_rows]
            growth.beam_entries = growth.beam_entries[growth.parent_rows]
            growth.beam_scores.append(child_scores.flatten()[best])
        return table

    def grow_on_host(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int,
                     root_top: tuple[torch.Tensor, torch.Tensor] | None = None,
                     vote: DepthVote | None = None) -> HostTable:
        """`_grow` on host lists, for the growing layout, which reads every level anyway (its rate rules
        and DEAGLE's vote): each level's top-k is read once, and the scores, the beam and each fed
        node's entries are kept in Python, where on tensors each took a small torch call (~30 a level,
        ~0.5 ms a cycle on a Zen 3 core). The same tree as `_grow` (a test holds them equal): the
        table's nodes in the same order, less the padding of levels not drafted. `root_top`: the top
        k (or more) after `root_hidden` where the step that gave it computed them (else `steps.top`)."""
        k, depth = self.params.top_k, self.depth_for(max_depth)
        keep, device = self.verified(max_nodes), root_hidden.device
        top_logp, top_ids = (best[0, :k] for best in (root_top or steps.top(root_hidden[None], k)))
        scores = top_logp.tolist()
        table = HostTable(steps.to_target_on_host(top_ids.tolist()), [-1] * k, [1] * k, list(scores), list(scores),
                          vote)
        beam, beam_scores = list(range(k)), [scores]
        if depth > 1:
            beam = steps.narrow_on_host(table, beam, 1)
            beam_scores = [[scores[node] for node in beam]]
        outputs, rows = root_hidden[None], [0] * len(beam)  # the outputs that predicted the beam, by row
        paths: list[list[int]] = [[] for _ in beam]  # each beam node's ancestors' entries this cycle
        entries_fed = 0
        for level in range(1, depth):
            if not beam:
                break
            if vote is not None:
                level_scores = table.scores[len(table.scores) - (k if level == 1 else len(beam_scores[-2]) * k):]
                if steps.stops(vote.decide_on_host(level, beam_scores[-1], level_scores, table.scores,
                                                   [s for depth_scores in beam_scores for s in depth_scores], keep),
                               None):
                    break
            m = len(beam)
            width = entries_fed + m
            mask = [[False] * width for _ in beam]
            for row, path in enumerate(paths):
                for entry in path:
                    mask[row][entry] = True
                mask[row][entries_fed + row] = True
            hidden = outputs.index_select(0, torch.tensor(rows, device=device))
            out, child_logp, child_ids = steps.feed_top(hidden, torch.tensor([table.tokens[node] for node in beam],
                                                                             device=device),
                                                        level, entries_fed, torch.tensor(mask, device=device), k)
            child_logp, child_ids = child_logp.tolist(), [steps.to_target_on_host(ids) for ids in child_ids.tolist()]
            first_child = table.filled
            child_scores = [table.scores[node] + logp for node, logps in zip(beam, child_logp) for logp in logps]
            table.write([token for ids in child_ids for token in ids], [node for node in beam for _ in range(k)],
                        level + 1, [logp for logps in child_logp for logp in logps], child_scores)
            best = sorted(range(len(child_scores)), key=lambda i: -child_scores[i])[:k]
            if level + 1 < depth:
                best = [node - first_child for node in steps.narrow_on_host(table, [first_child + i for i in best],
                                                                           level + 1)]
            if not best:
                break
            parent_rows = [i // k for i in best]
            paths = [paths[row] + [entries_fed + row] for row in parent_rows]
            entries_fed += m
            beam, outputs, rows = [first_child + i for i in best], out, parent_rows
            beam_scores.append([child_scores[i] for i in best])
        return table

    def children(self, steps: HeadSteps, growth: Growth, level: int, depth: int):
        """The top-k children of each beam node: (log-probabilities, draft ids, the beam's head outputs)."""
        out, _ = self.feed_beam(steps, growth, level)
        child_logp, child_ids = steps.top(out, self.params.top_k)
        return child_logp, child_ids, out

    def feed_beam(self, steps: HeadSteps, growth: Growth, level: int, both: bool = False):
        """Run the head on the beam nodes (at depth `level`); returns their outputs (and two-ahead outputs)."""
        first_entry = growth.entries_fed  # (level - 1) * k where every beam is whole
        own = first_entry + torch.arange(len(growth.beam), device=growth.beam.device)
        growth.beam_entries = growth.beam_entries | torch.nn.functional.one_hot(own, growth.beam_entries.shape[1]).bool()
        growth.entries_fed += len(growth.beam)
        return steps.feed(growth.beam_hidden, growth.table.tokens[growth.beam], level, first_entry,
                          growth.beam_entries, both)


@dataclass(frozen=True)
class DeagleTree(DynamicTree):
    """DEAGLE: the EAGLE-2 tree, with a vote after each scored level that may stop the deepening."""

    deagle: DeagleParams = DeagleParams()

    def grow(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int) -> CandidateTable:
        vote = DepthVote(self.deagle, on_host=steps.reads_votes)  # one per cycle
        k = self.params.top_k

        def stop(level: int, growth: Growth, keep: int) -> torch.Tensor:
            scores = growth.table.scores
            level_scores = scores[:k] if level == 1 else scores[k + (level - 2) * k * k : k + (level - 1) * k * k]
            return vote.decide(level, growth.beam_scores[-1], level_scores, scores, torch.cat(growth.beam_scores), keep)

        table = self._grow(steps, root_hidden, max_depth, max_nodes, stop)
        table.vote = vote
        return table

    def grow_on_host(self, steps: HeadSteps, root_hidden: torch.Tensor, max_depth: int, max_nodes: int,
                     root_top: tuple[torch.Tensor, torch.Tensor] | None = None,
                     vote: DepthVote | None = None) -> HostTable:
        return super().grow_on_host(steps, root_hidden, max_depth, max_nodes, root_top,
                                    DepthVote(self.deagle, on_host=True))

    def trace(self, table: CandidateTable) -> DepthTrace:
        """The cycle's depth and votes, for the trace (the growing layout's drafter: reads the votes)."""
        k = self.params.top_k
        history = table.vote.history()
        if isinstance(table, HostTable):  # no padding: its deepest node's depth
            drafted = max(table.depths)
        else:
            drafted = -(-(table.filled - k) // (k * k)) + 1  # levels drafted (a narrowed beam fills a level in part)
        fired = len(history) == drafted  # a vote after the last level drafted: it fired
        return DepthTrace(drafted, history, history[-1].votes if fired else None)


@dataclass(frozen=True)
class JakiroTree(DynamicTree):
    """Jakiro: the deepest level is not drafted by its own forward. The forward one level earlier
    also predicts two tokens ahead (`forward_both`), and those predictions become the children of
    the nodes expanded last. Trees of depth 1-2 grow as EAGLE-2's.
    """

    reference_attach: bool = False  # attach that level by row, as the reference code does
    grows_on_host = False  # its last level comes from the level before's two-ahead outputs (`_grow`'s)

    def check(self, head: DraftHead) -> None:
        if not head.predicts_two_ahead:
            raise ValueError("a parallel last level needs a head that predicts two tokens ahead (Jakiro)")

    def entries(self, depth: int) -> int:
        return max(depth - 2, 0) * self.params.top_k if depth >= 3 else super().entries(depth)

    def children(self, steps: HeadSteps, growth: Growth, level: int, depth: int):
        if depth < 3 or level < depth - 2:
            return super().children(steps, growth, level, depth)
        if level == depth - 2:  # the last forward: also predict the level after next
            out, right = self.feed_beam(steps, growth, level, both=True)
            growth.two_ahead = steps.top(right, self.params.top_k)
            child_logp, child_ids = steps.top(out, self.params.top_k)
            return child_logp, child_ids, out
        return (*self._attach_two_ahead(growth), None)

    def _attach_two_ahead(self, growth: Growth):
        """Children for the beam from the two-ahead predictions of their parents' forward.

        Parent-correct by default: a node gets the predictions made at its own parent. The
        reference implementation pairs them by row instead (`reference_attach`), which gives a
        node the predictions of whichever parent happened to sit in the same row.
        """
        logp, ids = growth.two_ahead
        rows = torch.arange(len(growth.beam), device=logp.device) if self.reference_attach else growth.parent_rows
        return logp[rows], ids[rows]
