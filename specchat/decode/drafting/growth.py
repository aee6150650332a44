"""What a tree shape (`specchat.decode.drafting.shapes`) grows with: the draft head's steps it runs
(`HeadSteps`, which each layout provides), the table of candidates it fills (`CandidateTable`, as
tensors; `HostTable`, its form on the host) and one cycle's growth (`Growth`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from drafters import DraftHead
from specchat.decode.drafting.deagle import DepthVote


class HeadSteps(ABC):
    """The draft head as a shape runs it (see `shapes`' module docstring). The layouts differ in where
    a node's cache entry goes and in how a vote stops drafting."""

    reads_votes = False  # whether `stops` reads each DEAGLE vote at once (then `DepthVote(on_host=True)`)

    def __init__(self, head: DraftHead):
        self.head = head

    @abstractmethod
    def feed(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, first_entry: int,
             entries: torch.Tensor, both: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the head on m nodes of depth `level` (their parents' outputs `hidden` [m, H] and their
        tokens [m]); their entries are `first_entry` + row, `entries` [m, E] what each attends to.
        Returns the outputs [m, H] and, when `both`, the two-ahead outputs (Jakiro)."""

    @abstractmethod
    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        """DEAGLE voted (`fired`: a 0-d tensor, a bool where `reads_votes`): whether to stop drafting
        now (the host reads it); else the levels after it are dropped (`growth.alive`)."""

    def narrow(self, growth: Growth, beam: torch.Tensor, depth: int) -> torch.Tensor:
        """Of the next `beam` (table indices of the best nodes at `depth`, best first), those worth
        expanding; all of them by default (a fixed shape expands its whole beam), none: drafting stops."""
        return beam

    def narrow_on_host(self, table: HostTable, beam: list[int], depth: int) -> list[int]:
        """`narrow` for a growth on the host (`DynamicTree.grow_on_host`)."""
        return beam

    def feed_top(self, hidden: torch.Tensor, tokens: torch.Tensor, level: int, first_entry: int,
                 entries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`feed` and the `top` k after its outputs: (outputs, log-probabilities, draft ids); a layout
        whose step computes both at once gives them from one call."""
        out, _ = self.feed(hidden, tokens, level, first_entry, entries)
        return (out, *self.top(out, k))

    def top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest tokens after each output [m, H]: their draft log-probabilities and draft ids
        [m, k], best first."""
        return self.head.log_probs(outputs).topk(k, dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as target ids."""
        table = self.head.draft_to_target
        return draft_ids if table is None else table[draft_ids]

    @functools.cached_property
    def target_ids(self) -> list[int] | None:
        """`to_target`'s table as a host list, read once where a growth on the host first asks (a tensor
        lookup cost more than the level's Python around it)."""
        table = self.head.draft_to_target
        return None if table is None else table.tolist()

    def to_target_on_host(self, draft_ids: list[int]) -> list[int]:
        """`to_target` of host ids."""
        return draft_ids if self.target_ids is None else [self.target_ids[i] for i in draft_ids]


@dataclass
class CandidateTable:
    """Every node a cycle could verify, level by level (so parents come before children), as
    tensors of one fixed length; a node whose score is -inf is not a candidate (a level not drafted)."""

    tokens: torch.Tensor  # target ids
    parents: torch.Tensor  # table index of the parent, -1 for the root's children
    depths: torch.Tensor
    logps: torch.Tensor  # the draft's log-probability of the node given its parent
    scores: torch.Tensor  # of its whole path
    filled: int = 0  # nodes written; the rest are -inf
    vote: DepthVote | None = None  # DEAGLE's votes this cycle (for the trace)
    sources: torch.Tensor | None = None  # hybrid tables: `Source` codes per node (`selection.merge_lookup`)
    evidence: torch.Tensor | None = None  # with `sources`: the lookup match's strength per node (0: none)

    @classmethod
    def allocate(cls, size: int, device) -> CandidateTable:
        return cls(torch.zeros(size, dtype=torch.long, device=device), torch.full((size,), -1, device=device),
                   torch.zeros(size, dtype=torch.long, device=device), torch.zeros(size, device=device),
                   torch.full((size,), float("-inf"), device=device))

    def write(self, at: int, tokens, parents, depth: int, logps, scores) -> None:
        """Nodes `at`..: `parents` a tensor or one index for all; every node at `depth`."""
        end = at + len(tokens)
        self.tokens[at:end], self.logps[at:end], self.scores[at:end] = tokens, logps, scores
        if isinstance(parents, int):  # a Python value is filled in, not made into a host tensor first
            self.parents[at:end].fill_(parents)
        else:
            self.parents[at:end] = parents
        self.depths[at:end].fill_(depth)
        self.filled = max(self.filled, end)


@dataclass
class HostTable:
    """A `CandidateTable` on the host, as a growth on the host fills it (`DynamicTree.grow_on_host`):
    the nodes written, level by level, without the -inf padding of levels not drafted."""

    tokens: list[int]  # target ids
    parents: list[int]
    depths: list[int]
    logps: list[float]
    scores: list[float]
    vote: DepthVote | None = None

    @property
    def filled(self) -> int:
        return len(self.tokens)

    def write(self, tokens: list[int], parents: list[int], depth: int, logps: list[float], scores: list[float]) -> None:
        self.tokens += tokens
        self.parents += parents
        self.depths += [depth] * len(tokens)
        self.logps += logps
        self.scores += scores


@dataclass
class Growth:
    """One cycle of a dynamic tree: the table so far and the beam to expand next."""

    table: CandidateTable
    beam: torch.Tensor  # table indices of the nodes to expand next
    beam_hidden: torch.Tensor | None  # the head's outputs at their parents (what predicted them)
    beam_entries: torch.Tensor  # [k, E] the entries each beam node's path holds
    beam_scores: list[torch.Tensor]  # per depth, the path log-probabilities of the beam nodes
    entries_fed: int = 0  # the head's cache entries this cycle's beams took so far (one per fed node)
    parent_rows: torch.Tensor | None = None  # each beam node's parent's row in the beam before (Jakiro)
    alive: torch.Tensor | None = None  # 0-d: False once DEAGLE voted to stop (the fixed layout)
    two_ahead: tuple | None = None  # Jakiro: top-k of the two-ahead predictions of the last fed beam
