"""Drafting with a draft head: the tree shapes (`shapes`) grown with the head, the head's own cache
kept in step with the context, the verified nodes selected (`selection`), joined by lookup chains
for hybrid trees. `HeadProposer` is the algorithm; its layout's subclass keeps the head's cache and
runs a cycle's selection (`heads`: growing or fixed).

The head's cache is laid out alike on both layouts: entry j is the head's step on (the target's
feature at position j, the token at position j + 1), at RoPE position j, which is EAGLE's
convention. A cycle first runs the *context pass* over the positions committed since the last
one, the newest paired with the root; its last output predicts the root's children. Tree nodes at
depth d sit at position (committed entries - 1 + d); their entries are scratch, dropped after the
cycle.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from drafters import DraftHead
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.drafting.deagle import DepthTrace
from specchat.decode.drafting.lookup import DEFAULT_LOOKUP_PATHS, LookupSource, Match
from specchat.decode.drafting.pace import Arm, Found, LookupAndPace, Pace
from specchat.decode.drafting.selection import LOOKUP_BRANCHES, Candidates
from specchat.decode.drafting.growth import CandidateTable, HeadSteps
from specchat.decode.drafting.shapes import DynamicTree, StaticTree
from specchat.decode.drafting.tree import Cycle, DraftTree, Offer
from specchat.decode.drafting.trust import ContradictedLookups, HeadTrust, LookupRates
from specchat.decode.runtime.target import Target

if TYPE_CHECKING:  # only for annotations: the fused step is the runtime's, built where the head is loaded
    from specchat.decode.runtime.cpu_decoder import FusedEagle3Step

PROMPT_CHUNK = 512  # prompt rows the fixed layout feeds the head at once (eagerly, padded to a bucket)
# A draft level's cost before one is measured (the bundled head's on two Zen 3 cores: its layer and
# draft-vocabulary LM head for a row or two, the top-k and the rate rule), and how fast the measured
# average forgets.
LEVEL_MS, LEVEL_DECAY = 0.8, 0.8


class HeadProposer(LookupAndPace, HeadSteps):
    """Proposes draft trees of one shape with a draft head (see `drafters`): the algorithm, on the
    layout its subclass keeps the head's cache on (the shapes grow through it: `HeadSteps`)."""

    reach = 0
    described = ""
    lookup_tree: bool  # a cycle's lookup continuations are a tree's paths, else distinct chains (`LookupSource.matches`)
    paced: bool  # whether a cycle may take plain steps or lookup alone where measured faster (`Pace`)
    longest_lookup: int  # the longest lookup chain a cycle weighs (the rate rule or the bucket takes what it verifies)

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree,
                 lookup: LookupSource | None = None, curve: Curve | None = None,
                 pace: bool = False, lookup_paths: int = DEFAULT_LOOKUP_PATHS,
                 fused: FusedEagle3Step | None = None):
        """
        Args:
            lookup: also draft from text already seen (hybrid trees).
            curve: the verify-cost curve (the growing layout on a CPU): each cycle drafts and verifies
                the nodes that maximize expected tokens per second (`GrowingHead.narrow`, `select`;
                without it, the shape's budget).
            lookup_paths: the lookup tree's paths a cycle weighs (the growing layout's; the fixed one
                merges LOOKUP_BRANCHES chains in its draft step).
            pace: each cycle takes plain steps, lookup continuations alone or the head's tree, whichever
                has been measured fastest in this chat (`Pace`; the growing layout, given a curve: the
                fixed one verifies a whole bucket every step).
            fused: the head's steps and top-k in one call each (the growing layout's, on a CPU:
                `cpu_decoder.FusedEagle3Step`), else its torch code.
        """
        shape.check(head)
        super().__init__(head)
        self.shape, self.lookup, self.curve = shape, lookup, curve
        self.lookup_tokens = self.longest_lookup if lookup is not None else 0
        self.lookup_paths = lookup_paths
        self.rates, self.trust, self.contradicted = LookupRates(), HeadTrust(), ContradictedLookups()
        arms = (Arm.PLAIN, Arm.LOOKUP, Arm.HEAD) if lookup is not None else (Arm.PLAIN, Arm.HEAD)
        self.pace = Pace(curve.cost(1), arms) if pace and curve is not None and self.paced else None
        self.feature_layers = head.feature_layers(target.num_layers)
        self.matches: list[Match] = []
        self.along: list[tuple[list[float], list[int], list[float]]] = []  # per match, `LookupRates.along` (read once)
        self.arm, self.found = Arm.HEAD, Found.NOTHING  # this cycle's (`Pace`)
        self.lookup_tree: DraftTree | None = None  # the LOOKUP arm's tree, chosen in `prepare`
        self.started = self.lookup_seconds = 0.0
        self.trace: DepthTrace | None = None  # this cycle's DEAGLE votes, for the record (`Cycle.trace`)
        self.offer: Offer | None = None  # what this cycle's tree was chosen from, for the record (`Cycle.offer`)
        self.drafted_trust: float | None = None  # the trust in the head this cycle's tree was selected with
        self.fused = fused

    def describe(self) -> str:
        return self.shape.describe() + (", with lookup (hybrid)" if self.lookup is not None else "") + self.described

    def rewind(self, length: int) -> int:
        self.rewind_lookup(length)
        return self.rewind_cache(length)

    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        self.pend(tokens, features)
        self.prompted(tokens)

    @torch.inference_mode()
    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        self.started = time.perf_counter()
        self.trace = self.drafted_trust = self.offer = None
        nodes = self.budget(max_depth, max_nodes)
        self.matches, self.along = [], []
        if nodes and self.lookup is not None:
            count = self.lookup_paths if self.lookup_tree else LOOKUP_BRANCHES
            self.matches = self.lookup.matches(root, min(self.lookup_tokens, max_depth), count, self.lookup_tree)
            self.along = [self.rates.along(match) for match in self.matches]
            self.chains()
        self.arm = Arm.HEAD
        if nodes and self.pace is not None:
            likeliest = max((accepts[0] for accepts, _, _ in self.along), default=0.0)
            self.found = Found.of(bool(self.matches), likeliest)
            self.arm = self.pace.choose(self.found)
            if self.arm is Arm.PLAIN:
                nodes = 0  # a plain step, which gives the head its features
            elif self.arm is Arm.LOOKUP:  # the continuations alone; the head catches up in its next context pass
                self.lookup_tree = self.lookup_only(max_nodes)
                nodes = len(self.lookup_tree)
        self.lookup_seconds = time.perf_counter() - self.started if self.lookup is not None else 0.0
        return nodes

    @torch.inference_mode()
    def draft(self, root, length, span: int | None, sampling, rng) -> DraftTree:
        if self.arm is Arm.LOOKUP:
            tree, self.lookup_tree = self.lookup_tree, None
            return tree
        return self.select(self.grow(self.context_pass(root, span)))

    def candidates(self, table: CandidateTable | None = None) -> Candidates:
        """The table (none: no head nodes) read once, joined by this cycle's lookup chains (host lists)."""
        candidates = Candidates([], [], [], [], []) if table is None else Candidates.from_table(table)
        for match, along in zip(self.matches, self.along):
            candidates.add_chain(match.tokens, *along)
        return candidates

    def lookup_only(self, max_nodes: int) -> DraftTree:
        """The lookup continuations as a tree of as many nodes as pay at this machine's verify cost (the
        first always: so that their acceptance rate keeps learning)."""
        drafting_ms = 1000 * (time.perf_counter() - self.started)
        candidates = self.candidates()
        self.offer = candidates.offer_for_rate(self.curve, drafting_ms, max_nodes, kept=[0])
        return candidates.tree_of(self.offer.chosen)

    def committed(self, tokens: list[int], cycle: Cycle) -> None:
        cycle.arm, cycle.trace, cycle.head_trust, cycle.offer = self.arm, self.trace, self.drafted_trust, self.offer
        self.confirm(tokens)
        self.trust.learn(cycle)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            self.rates.learn(cycle)
            self.contradicted.learn(cycle)
            cycle.lookup_seconds = self.lookup_seconds
        # Live verify forwards heal the cost curve; only the growing layout has one (and times its
        # verify forward apart: `Cycle.forward_seconds`), the fixed one verifies its whole bucket.
        if self.curve is not None and cycle.forward_seconds:
            self.curve.observe(len(cycle.tree) + 1, 1000 * cycle.forward_seconds)
        if self.pace is not None:
            arm = self.arm if len(cycle.tree) else Arm.PLAIN
            self.pace.learn(arm, self.found, len(cycle.accepted) + 1, 1000 * (time.perf_counter() - self.started))

    # What a layout's subclass keeps: the head's cache (`rewind_cache`, `pend`: prompt positions,
    # `commit` and `confirm`: a cycle's), the cycle's budget (`budget`) and lookup chains (`chains`),
    # the context pass, growing a shape's table (and `feed`, `stops`: `HeadSteps`), the selection.
