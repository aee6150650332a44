"""DEAGLE's dynamic depth: stop deepening the EAGLE-2 tree when two of three survival signals say so.

After the tree has been scored at depth d (and before the draft forward for depth d + 1), with
s(v) = product of draft confidences along v's path (exp of EAGLE-2's cumulative score):

- low probability ("mass"):      S_d = sum of s(v) over the top-k beam nodes at depth d < tau_S;
- sharp momentum decay ("momentum"): rho_d = S_d / S_{d-1} < tau_rho has happened twice;
- saturation ("saturation"):     d >= ceil(E_d), E_d the expected accepted length of the tree so far.

Drafting stops when at least two votes hold, or at the maximum depth. The paper (ICLR 2026
submission, OpenReview eZRPb52ccA) leaves some choices open; each is an option here, and the
defaults are the readings we judge most faithful:

- which nodes make S_d (`mass_nodes`): "beam" — the k nodes kept for expansion at depth d, the
  frontier that is actually expanded (alternatives: "all" candidates at depth d). S_0 = 1 (the
  root), so rho_1 = S_1. Since children's probabilities sum to at most 1, S_d <= S_{d-1}.
- what E_d sums over (`expected_over`): "verified" — the nodes that would be verified if drafting
  stopped now (the top total_tokens - 1 by score); at temperature 0 siblings are exclusive events,
  so the sum is the expected number of accepted draft tokens (alternative: "beam", the beam nodes
  of every depth so far). E_d covers all depths 1..d.
- whether E_d counts the bonus token (`expected_plus_bonus`): no — it is compared with the draft
  depth d, which counts draft tokens only.
- whether "twice" means consecutive (`consecutive`): no — a strike counter over the depths of this
  cycle; once it reaches two the vote stays on.
- the earliest depth at which drafting may stop (`min_depth`): 2.
- draft confidences are the raw draft probabilities (no temperature), as in EAGLE-2's tree scores.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: this module runs before torch loads (settings read its defaults)
    import torch

# Thresholds from the DEAGLE paper.
TAU_S = 0.15
TAU_RHO = 0.6
MIN_DEPTH = 2
MASS_NODES = ("beam", "all")
EXPECTED_OVER = ("verified", "beam")


@dataclass(frozen=True)
class DeagleParams:
    tau_s: float = TAU_S
    tau_rho: float = TAU_RHO
    min_depth: int = MIN_DEPTH
    mass_nodes: str = MASS_NODES[0]
    expected_over: str = EXPECTED_OVER[0]
    expected_plus_bonus: bool = False
    consecutive: bool = False

    def __post_init__(self):
        if self.mass_nodes not in MASS_NODES or self.expected_over not in EXPECTED_OVER:
            raise ValueError(f"mass_nodes is {'|'.join(MASS_NODES)} and expected_over is {'|'.join(EXPECTED_OVER)}")
        if self.min_depth < 1:
            raise ValueError("min_depth must be >= 1")


class DepthVote:
    """The stopping decision for one draft cycle (create one per cycle).

    Scores in, the vote out. Without `on_host`, a 0-d boolean tensor and no host read: the fixed
    layout's drafter keeps drafting to its full depth and drops the levels after the vote (the same
    tree, at a fixed shape). With `on_host` (the growing layout's drafter, which reads the vote and
    stops at once), S_d and E_d are read as numbers and the rules run on them: on 0-d tensors they
    are some twenty operations, ~0.2 ms a level on a CPU. The rules are written in operators that
    numbers and tensors share, so they are stated once; tensor methods only, so this module still
    loads without torch."""

    def __init__(self, params: DeagleParams, on_host: bool = False):
        self.params, self.on_host = params, on_host
        self.previous_mass = 1.0  # S_0 = 1: the root survives for sure
        self.strikes, self.last_strike_depth = 0, -2
        self.momentum = False  # once the decay has happened twice, momentum stays on
        self._history: list[tuple] = []  # per depth: the depth, S_d, rho_d, E_d and the three votes

    def decide(self, depth: int, beam_scores: torch.Tensor, level_scores: torch.Tensor, all_scores: torch.Tensor,
               beam_history_scores: torch.Tensor, verified: int) -> torch.Tensor | bool:
        """Votes after depth `depth` has been scored: whether drafting should stop (a 0-d bool
        tensor; a bool `on_host`).

        Args:
            beam_scores: log survival of the beam nodes at this depth.
            level_scores: log survival of every candidate at this depth.
            all_scores: log survival of every candidate generated so far (-inf: none).
            beam_history_scores: log survival of the beam nodes of all depths so far.
            verified: how many nodes would be verified (total_tokens - 1).
        """
        p = self.params
        mass = _finite((beam_scores if p.mass_nodes == "beam" else level_scores).exp().sum())
        if p.expected_over == "verified":
            expected = all_scores.topk(min(verified, all_scores.numel())).values.exp().sum()
        else:
            expected = beam_history_scores.exp().sum()
        expected = _finite(expected) + (1.0 if p.expected_plus_bonus else 0.0)
        if self.on_host:
            mass, expected = mass.item(), expected.item()
        return self._vote(depth, mass, expected)

    def decide_on_host(self, depth: int, beam_scores: list[float], level_scores: list[float],
                       all_scores: list[float], beam_history_scores: list[float], verified: int) -> bool:
        """`decide` on host lists of the nodes' log survivals (`on_host`; the growing layout's host
        growth: `shapes.DynamicTree.grow_on_host`): S_d and E_d summed in Python, the same rules."""
        assert self.on_host, "host lists give numbers: a vote made for tensors reads none"
        p = self.params
        mass = _finite_number(sum(math.exp(s) for s in (beam_scores if p.mass_nodes == "beam" else level_scores)))
        survivals = heapq.nlargest(verified, all_scores) if p.expected_over == "verified" else beam_history_scores
        expected = _finite_number(sum(math.exp(s) for s in survivals)) + (1.0 if p.expected_plus_bonus else 0.0)
        return self._vote(depth, mass, expected)

    def _vote(self, depth: int, mass, expected):
        """The rules, given S_d and E_d (0-d tensors, or numbers `on_host`)."""
        p = self.params
        # rho_d; 0 where S_{d-1} = 0 (a beam's children hold at most its mass, so S_d = 0 there too)
        ratio = mass / (self.previous_mass + (self.previous_mass <= 0))
        self.previous_mass = mass
        strike = ratio < p.tau_rho
        if p.consecutive:  # a strike after a depth without one starts the count again
            self.strikes = self.strikes - self.strikes * (strike & (self.last_strike_depth != depth - 1))
        self.strikes = self.strikes + strike
        self.last_strike_depth = self.last_strike_depth + (depth - self.last_strike_depth) * strike
        self.momentum = self.momentum | (self.strikes >= 2)
        low_mass, saturated = mass < p.tau_s, depth >= expected  # d >= ceil(E_d) as d is whole
        self._history.append((depth, mass, ratio, expected, low_mass, saturated, self.momentum))
        two_votes = (low_mass & self.momentum) | (low_mass & saturated) | (self.momentum & saturated)
        return two_votes & (depth >= p.min_depth)

    def history(self) -> list[DepthVotes]:
        """Each depth's numbers and votes, for the trace (the growing layout's drafter only)."""
        if not self._history:
            return []
        # Tensors: one read of every depth's numbers (a read per value costs a device sync each on a GPU),
        # gathered by tensor methods: this module imports no torch (the settings read its defaults first).
        rows = [values for _, *values in self._history]
        if not self.on_host:
            first = self._history[0][1]
            table = first.new_zeros((len(rows), 6), dtype=first.double().dtype)
            for row, values in enumerate(rows):
                for column, value in enumerate(values):
                    table[row, column] = value
            rows = table.tolist()
        depths = []
        for (depth, *_), (mass, ratio, expected, low_mass, saturated, momentum) in zip(self._history, rows):
            votes = [name for name, on in (("mass", low_mass), ("momentum", momentum), ("saturation", saturated)) if on]
            depths.append(DepthVotes(depth, mass, ratio, expected, votes))
        return depths


@dataclass(frozen=True)
class DepthVotes:
    """One depth's numbers (S_d, rho_d, E_d) and the votes that held there."""

    depth: int
    mass: float
    rho: float
    expected: float
    votes: list[str]

    def record(self) -> dict:
        return {"depth": self.depth, "mass": round(self.mass, 4), "rho": round(self.rho, 4),
                "expected": round(self.expected, 4), "votes": self.votes}


@dataclass(frozen=True)
class DepthTrace:
    """A cycle's DEAGLE trace: the levels drafted, each depth's votes, and the votes that stopped it
    (None where it ran to the maximum depth)."""

    stop_depth: int
    depths: list[DepthVotes]
    votes: list[str] | None

    def record(self) -> dict:
        record = {"stop_depth": self.stop_depth, "depth_votes": [depth.record() for depth in self.depths]}
        return record | ({"votes": self.votes} if self.votes is not None else {})


def _finite(value: torch.Tensor) -> torch.Tensor:
    """A head that outputs NaN (a broken or mismatched checkpoint) predicts nothing: its mass counts as 0,
    so the votes stop drafting early instead of failing; verification keeps the output exact regardless."""
    return value.nan_to_num(0.0, 0.0, 0.0)


def _finite_number(value: float) -> float:
    """`_finite` on a number."""
    return value if math.isfinite(value) else 0.0
