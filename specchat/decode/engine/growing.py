"""The growing layout: exact sizes, and a target cache that grows by each step's rows. What CPUs run.

A step's tensors are exactly as large as its rows: a prefill chunk, one token, or the root and a
draft tree's nodes, whose entries are appended to the cache (`specchat.decode.runtime.cache`'s storage
keeps spare room at its end). After verification the accepted path's entries are compacted down
next to the committed prefix and the rest are dropped, so trimming only moves a length. The host
reads as it goes: the tree arrives as lists, acceptance walks it on the host
(`specchat.decode.acceptance.verify.accept`), and no step is captured. On a CPU that is the
cheapest way: a read costs nothing, every tensor operation costs a few microseconds.

The fixed layout (`specchat.decode.engine.fixed`) runs the same cycle at fixed shapes.
"""

from __future__ import annotations

import time

import torch

from specchat.decode.acceptance.sampling import SamplingParams, choices_and_margins, sample, target_probs
from specchat.decode.acceptance.verify import accept
from specchat.decode.drafting.tree import Cycle, DraftTree
from specchat.decode.runtime.machine import synchronize
from specchat.decode.runtime.target import ForwardTimes, Target, TargetOutput


class GrowingLayout:
    """The target's cache and a cycle's steps at exact sizes (see the module docstring)."""

    capture_seconds = 0.0  # nothing is captured

    def __init__(self, target: Target):
        self.target = target
        self.cache = target.new_cache()

    def prefill(self, chunk: list[int], length: int, last: bool, feature_layers) -> TargetOutput:
        """One chunk of the prompt through the target, into the cache: its features (for the proposer)
        and, for the `last` chunk, the logits of the token after it."""
        return self.target.forward(torch.tensor([chunk], device=self.target.device), self.cache,
                                   logits_for="last" if last else "none", feature_layers=feature_layers)

    def first_token(self, logits: torch.Tensor, sampling: SamplingParams, rng) -> tuple[int, float]:
        """The reply's first token, drawn from the last chunk's logits, and its margin."""
        return self._chosen(logits, sampling, rng)

    def plain_step(self, root: int, length: int, sampling: SamplingParams, rng,
                   feature_layers: tuple[int, ...] | None = None) -> tuple[int, float, torch.Tensor | None, ForwardTimes]:
        """`root` into the cache; the token drawn after it, its margin, the target's features at it
        and the forward's times."""
        start = time.perf_counter()
        out = self.target.forward(torch.tensor([[root]], device=self.target.device), self.cache, logits_for="last",
                                  feature_layers=feature_layers)
        synchronize(self.target.device)
        forward = ForwardTimes.of(out, time.perf_counter() - start)
        return *self._chosen(out.logits, sampling, rng), out.features, forward

    def _chosen(self, logits: torch.Tensor, sampling: SamplingParams, rng) -> tuple[int, float]:
        """The token drawn after the last row of `logits`, and the margin of that row."""
        (choice,), (margin,) = choices_and_margins(logits[-1:])
        token = choice if sampling.greedy else sample(target_probs(logits[-1], sampling), rng)
        synchronize(self.target.device)
        return token, margin

    def cycle(self, proposer, root: int, length: int, nodes: int, room: int, sampling: SamplingParams, rng,
              start: float) -> tuple[Cycle, list[float], float, float, ForwardTimes]:
        """Draft, verify, accept, compact: the cycle, the kept rows' margins, the drafting and
        verification seconds (drafting counted from `start`, the cycle's start) and the verify
        forward's times."""
        tree = proposer.draft(root, length, None, sampling, rng)
        synchronize(self.target.device)
        drafted = time.perf_counter()
        ids, positions, mask = verify_inputs(tree, root, length, self.target.device)
        forward_started = time.perf_counter()
        out = self.target.forward(ids, self.cache, positions=positions, mask=mask, logits_for="all",
                                  feature_layers=proposer.feature_layers)
        synchronize(self.target.device)
        verified = time.perf_counter()  # the one place a cycle's verify forward is timed, with len(tree) rows + 1
        forward = ForwardTimes.of(out, verified - forward_started)
        choices, row_margins = choices_and_margins(out.logits)  # every row's: one pass over each
        acceptance = accept(tree, out.logits, sampling, rng, choices)
        tree.q = None  # verified: the reply's record of this cycle need not hold [n, vocab] distributions
        # Compact: the root's and the accepted nodes' entries move down next to the committed prefix.
        keep = [0] + [node + 1 for node in acceptance.path]
        self.cache.compact(length, torch.tensor(keep))
        proposer.commit(tree, acceptance, root, None if out.features is None else out.features[keep])
        cycle = Cycle(root, tree, acceptance.path, acceptance.bonus, forward_seconds=forward.forward_seconds)
        # row 0 chose the first token, node i's row the token after it
        return cycle, [row_margins[row] for row in keep], drafted - start, verified - drafted, forward

    def plain_step_seconds(self, steps: int, context_ids: list[int]) -> list[float]:
        """Plain steps on top of the cache (the forward and the greedy choice, as a plain step takes
        them), timed, then trimmed away."""
        committed = self.cache.length
        root, greedy = context_ids[-1] if context_ids else 0, SamplingParams()
        timings = []
        try:
            for _ in range(steps):
                begun = time.perf_counter()
                self.plain_step(root, len(context_ids), greedy, None)
                timings.append(time.perf_counter() - begun)
        finally:
            self.cache.trim(committed)
        return timings


def verify_inputs(tree: DraftTree, root: int, cached: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids [1, n+1], positions [1, n+1] and mask [1, 1, n+1, cached+n+1] for one target forward.

    Row 0 is the root, row i + 1 node i; each attends to the whole cached context, to the root,
    to its ancestors and to itself (tree attention), at the position its depth gives it.
    (The fixed layout's form, on the device and in a window: `fixed.verify_rows`.)
    """
    n = len(tree)
    ids = torch.tensor([[root] + tree.tokens], device=device)
    positions = torch.tensor([[0] + tree.depths], device=device) + cached
    rows = [[True] + [False] * n]  # the root sees only itself among the new tokens
    for line in tree.ancestors():
        row = [True] + [False] * n
        for node in line:
            row[node + 1] = True
        rows.append(row)
    mask = torch.cat([torch.ones(n + 1, cached, dtype=torch.bool), torch.tensor(rows)], dim=1)
    return ids, positions, mask.to(device)[None, None]
