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
    """The stopping decision for one draft cycle (create one per cycle)."""

    def __init__(self, params: DeagleParams):
        self.params = params
        self.previous_mass = 1.0  # S_0: the root survives for sure
        self.strikes = 0
        self.last_strike_depth = None
        self.momentum = False  # once the decay has happened twice, the vote stays on
        self.history: list[dict] = []

    def decide(self, depth: int, beam_scores: torch.Tensor, level_scores: torch.Tensor,
               all_scores: torch.Tensor, beam_history_scores: torch.Tensor, verified: int) -> list[str] | None:
        """Votes after depth `depth` has been scored; returns the votes if drafting should stop.

        Args:
            beam_scores: log survival of the beam nodes at this depth.
            level_scores: log survival of every candidate at this depth.
            all_scores: log survival of every candidate generated so far.
            beam_history_scores: log survival of the beam nodes of all depths so far.
            verified: how many nodes would be verified (total_tokens - 1).
        """
        p = self.params
        mass = _finite(float((beam_scores if p.mass_nodes == "beam" else level_scores).exp().sum()))
        ratio = mass / self.previous_mass if self.previous_mass > 0 else 0.0
        self.previous_mass = mass
        if ratio < p.tau_rho:
            if p.consecutive and self.last_strike_depth != depth - 1:
                self.strikes = 0
            self.strikes += 1
            self.last_strike_depth = depth
            self.momentum = self.momentum or self.strikes >= 2
        if p.expected_over == "verified":
            expected = float(all_scores.topk(min(verified, len(all_scores))).values.exp().sum())
        else:
            expected = float(beam_history_scores.exp().sum())
        expected = _finite(expected) + (1.0 if p.expected_plus_bonus else 0.0)
        votes = []
        if mass < p.tau_s:
            votes.append("mass")
        if self.momentum:
            votes.append("momentum")
        if depth >= math.ceil(expected):
            votes.append("saturation")
        self.history.append({"depth": depth, "mass": round(mass, 4), "rho": round(ratio, 4),
                             "expected": round(expected, 4), "votes": votes})
        if depth >= p.min_depth and len(votes) >= 2:
            return votes
        return None


def _finite(value: float) -> float:
    """A head that outputs NaN (a broken or mismatched checkpoint) predicts nothing: its mass counts as 0,
    so the votes stop drafting early instead of failing; verification keeps the output exact regardless."""
    return value if math.isfinite(value) else 0.0
