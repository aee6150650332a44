"""Drafting with a draft head, on either layout: the tree shapes (`shapes`) grown with the head, the
head's own cache kept in step with the context, the verified nodes selected (`selection`), joined by
lookup chains for hybrid trees.

The head's cache is laid out alike on both layouts: entry j is the head's step on (the target's
feature at position j, the token at position j + 1), at RoPE position j, which is EAGLE's
convention. A cycle first runs the *context pass* over the positions committed since the last
one, the newest paired with the root; its last output predicts the root's children. Tree nodes at
depth d sit at position (committed entries - 1 + d); their entries are scratch, dropped after the
cycle.

`HeadProposer` holds the algorithm; what differs by layout, the head's cache and where a cycle's
selection runs, is its subclass's, `GrowingHead` or `FixedHead` (`HeadProposer.for_target` picks):

- growing: the cache grows (`drafters.cache.HeadCache`); the context pass feeds exactly the pending
  positions, a tree's entries are appended and trimmed away; DEAGLE's vote stops drafting; the
  candidates are read once and selected on the host, by the verify-cost curve where there is one.
- fixed: the cache has a fixed capacity (`drafters.cache.FixedHeadCache`); the context pass runs
  at depth + 1 rows from slots the host's counts give (`consumed`, `pending`), a tree's entries sit
  after them and are overwritten next cycle; the head drafts to its full depth, DEAGLE's vote
  dropping the levels after it; selection and lookup merging run on the device. The features and
  tokens of committed positions never leave the device; prompts go through the head eagerly, in
  the first cycle's `prepare`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from drafters import DraftHead
from drafters.cache import FixedHeadCache, HeadCache
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.drafting.lookup import DEFAULT_LOOKUP_PATHS, LookupSource, Match
from specchat.decode.drafting.pace import Arm, Found, Pace
from specchat.decode.drafting.selection import LOOKUP_BRANCHES, LOOKUP_TOKENS, Candidates, merge_lookup, select_fixed
from specchat.decode.drafting.growth import CandidateTable, Growth, HeadSteps, HostTable
from specchat.decode.drafting.shapes import DynamicTree, StaticTree, tree_budget
from specchat.decode.drafting.tree import Cycle, DraftTree
from specchat.decode.drafting.trust import ContradictedLookups, HeadTrust, LookupRates
from specchat.decode.runtime.envelope import MAX_TREE_ROWS, HostInputs, Window, pick, window_mask
from specchat.decode.runtime.target import Target

if TYPE_CHECKING:  # only for annotations: the fused step is the runtime's, built where the head is loaded
    from specchat.decode.runtime.cpu_decoder import FusedEagle3Step

PROMPT_CHUNK = 512  # prompt rows the fixed layout feeds the head at once (eagerly, padded to a bucket)
# A draft level's cost before one is measured (the bundled head's on two Zen 3 cores: its layer and
# draft-vocabulary LM head for a row or two, the top-k and the rate rule), and how fast the measured
# average forgets.
LEVEL_MS, LEVEL_DECAY = 0.8, 0.8


class HeadProposer(HeadSteps):
    """Proposes draft trees of one shape with a draft head (see `drafters`): the algorithm, on the
    layout its subclass keeps the head's cache on (the shapes grow through it: `HeadSteps`)."""

    reach = 0
    described = ""
    lookup_tree: bool  # a cycle's lookup continuations are a tree's paths, else distinct chains (`LookupSource.matches`)

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree,
                 lookup: LookupSource | None = None, curve: Curve | None = None, lookup_tokens: int = LOOKUP_TOKENS,
                 pace: bool = False, lookup_paths: int = DEFAULT_LOOKUP_PATHS,
                 fused: FusedEagle3Step | None = None):
        """
        Args:
            lookup: also draft from text already seen (hybrid trees).
            curve: the verify-cost curve (the growing layout on a CPU): each cycle drafts and verifies
                the nodes that maximize expected tokens per second (`GrowingHead.narrow`, `select`;
                without it, the shape's budget).
            lookup_tokens: the longest lookup chain.
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
        self.lookup_tokens = lookup_tokens if lookup is not None else 0
        self.lookup_paths = lookup_paths
        self.rates, self.trust, self.contradicted = LookupRates(), HeadTrust(), ContradictedLookups()
        arms = (Arm.PLAIN, Arm.LOOKUP, Arm.HEAD) if lookup is not None else (Arm.PLAIN, Arm.HEAD)
        self.pace = Pace(curve.cost(1), arms) if pace and curve is not None and target.envelope is None else None
        self.feature_layers = head.feature_layers(target.num_layers)
        self.matches: list[Match] = []
        self.along: list[tuple[list[float], list[int], list[float]]] = []  # per match, `LookupRates.along` (read once)
        self.arm, self.found = Arm.HEAD, Found.NOTHING  # this cycle's (`Pace`)
        self.lookup_tree: DraftTree | None = None  # the LOOKUP arm's tree, chosen in `prepare`
        self.started = self.lookup_seconds = 0.0
        self.fused = fused

    @staticmethod
    def for_target(head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options) -> HeadProposer:
        """The head's proposer on `target`'s layout (`options`: lookup, curve, lookup_tokens, pace, lookup_paths,
        fused)."""
        return (GrowingHead if target.envelope is None else FixedHead)(head, target, shape, **options)

    def describe(self) -> str:
        return self.shape.describe() + (", with lookup (hybrid)" if self.lookup is not None else "") + self.described

    def rewind(self, length: int) -> int:
        if self.lookup is not None:
            self.lookup.rewind(length)
        return self.rewind_cache(length)

    def forget(self) -> None:
        if self.lookup is not None:  # the acceptance rates and the pace stay: they describe the machine, the
            self.lookup.forget()  # head and the model, not the text

    def predict(self, tokens: list[int]) -> None:
        if self.lookup is not None:  # the head alone drafts from what the target's features say, not from text
            self.lookup.predict(tokens)

    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        self.pend(tokens, features)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            self.lookup.prompted()
        if self.pace is not None:  # a prompt: a new reply follows
            self.pace.check_soon()

    @torch.inference_mode()
    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        self.started = time.perf_counter()
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
        tree = self.select(self.grow(self.context_pass(root, span)))
        tree.arm = Arm.HEAD
        return tree

    def candidates(self, table: CandidateTable | None = None, trace=None) -> Candidates:
        """The table (none: no head nodes) read once, joined by this cycle's lookup chains (host lists)."""
        candidates = Candidates([], [], [], [], []) if table is None else Candidates.from_table(table, trace)
        for match, along in zip(self.matches, self.along):
            candidates.add_chain(match.tokens, *along)
        return candidates

    def lookup_only(self, max_nodes: int) -> DraftTree:
        """The lookup continuations as a tree of as many nodes as pay at this machine's verify cost (the
        first always: so that their acceptance rate keeps learning)."""
        drafting_ms = 1000 * (time.perf_counter() - self.started)
        tree = self.candidates().select_for_rate(self.curve, drafting_ms, max_nodes, kept=[0])
        tree.arm = Arm.LOOKUP
        return tree

    def committed(self, tokens: list[int], cycle: Cycle) -> None:
        self.confirm(tokens)
        self.trust.learn(cycle)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            self.rates.learn(cycle)
            self.contradicted.learn(cycle)
            cycle.tree.lookup_seconds = self.lookup_seconds
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


class GrowingHead(HeadProposer):
    """The head on the growing layout (see the module docstring)."""

    lookup_tree = True  # the host selection merges the paths
    reads_votes = True  # it stops drafting as soon as DEAGLE votes

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options):
        super().__init__(head, target, shape, **options)
        self.cache = HeadCache()
        self.consumed = 0  # cache entries of committed context pairs
        self.pending_features: list[torch.Tensor] = []  # target features from position `consumed` on
        self.pending_tokens: list[int] = []  # the tokens at those positions
        self.keep = self.depth = self.max_nodes = 0  # this cycle's budget
        self.head_trust = self.lookup_trust = 1.0  # this cycle's (`HeadTrust`, `ContradictedLookups`)
        self.level_ms = LEVEL_MS  # a draft level's cost, as measured (`narrow`)
        self.level_started: float | None = None
        self.last_read: tuple[CandidateTable, int, Candidates] | None = None  # (`read`)
        self.top_k = shape.most_children()  # what the fused context pass computes of the root's top-k

    def rewind_cache(self, length: int) -> int:
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

    def pend(self, tokens: list[int], features: torch.Tensor) -> None:
        self.pending_tokens.extend(tokens)
        self.pending_features.append(features)

    def commit(self, tree: DraftTree, acceptance, root: int, features: torch.Tensor) -> None:
        self.pending_features.append(features)

    def confirm(self, tokens: list[int]) -> None:
        self.pending_tokens.extend(tokens)

    def budget(self, max_depth: int, max_nodes: int) -> int:
        """This cycle's budget within the room: with a verify-cost curve the rate rules size the tree
        (`narrow`, `select`), within the shape's depth; else `tree_budget`. None without room for a
        draft token."""
        if max_depth < 1:
            return 0
        self.max_nodes = max_nodes
        if self.curve is not None:  # `keep`: the head's best node, verified every head cycle
            self.head_trust, self.lookup_trust = self.trust.factor(), self.contradicted.factor()
            self.keep, self.depth = 1, self.shape.depth_for(max_depth)
        else:
            self.head_trust = self.lookup_trust = 1.0
            self.keep, self.depth = tree_budget(self.shape, max_depth, max_nodes)
        return self.keep

    def chains(self) -> None:
        pass  # read where the candidates are selected (`select`)

    def context_pass(self, root: int, span: None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Feed the pending (feature, next token) pairs; return the output that predicts the root's
        children, with its top-k where the fused step computed them in the same call (else None)."""
        features = torch.cat(self.pending_features)
        count = len(self.pending_tokens)
        next_tokens = torch.tensor(self.pending_tokens[1:] + [root], device=features.device)
        positions = torch.arange(self.consumed, self.consumed + count, device=features.device)
        root_top = None
        if self.fused is not None and self.shape.grows_on_host:  # with its top-k, which the host growth reads
            out, logps, ids = self.fused.draft(features, next_tokens, positions, self.cache, self.consumed, None,
                                               outputs=1, k=self.top_k)
            root_top = (logps, ids)
        elif self.fused is not None:  # the new rows see each other causally; only the last one's output is read
            out = self.fused.step(features, next_tokens, positions, self.cache, self.consumed, None, outputs=1)
        else:
            out = self.head(features, next_tokens, positions, causal_mask(self.consumed, count, features.device),
                            self.cache)
        self.consumed += count
        self.pending_features, self.pending_tokens = [], []
        return out[-1], root_top

    def grow(self, context: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]) -> CandidateTable | HostTable:
        """The shape's table from the context pass's output (and top-k), grown on host lists where the
        shape has that form (each level is read anyway)."""
        root_hidden, root_top = context
        try:
            if self.shape.grows_on_host:
                return self.shape.grow_on_host(self, root_hidden, self.depth, self.max_nodes, root_top)
            return self.shape.grow(self, root_hidden, self.depth, self.max_nodes)
        finally:
            self.cache.trim(self.consumed)  # tree entries were scratch space

    def narrow(self, growth: Growth, beam: torch.Tensor, depth: int) -> torch.Tensor:
        """`narrow_on_host` of a growth on tensors."""
        nodes = beam.tolist()
        kept = set(self.narrow_on_host(growth.table, nodes, depth))
        return beam[[row for row, node in enumerate(nodes) if node in kept]]

    def narrow_on_host(self, table: CandidateTable | HostTable, beam: list[int], depth: int) -> list[int]:
        """With a verify-cost curve, the beam nodes whose expansion is expected to pay: each one the
        cycle would verify now (`Candidates.rate_choice`) whose best child, expected to be accepted as
        often as the node was given its parent, adds more tokens than its share of the cycle's time:
        one more draft level (as measured) and one more verified row. A CPU verifies few nodes (on two
        AVX2 cores each costs a sixth of a forward), so most cycles draft one or two levels, not the
        shape's whole depth (EAGLE-2's beam fills every level: a tree of which one node was verified
        cost 7 ms of drafting, 40% of a plain step, on a Zen 3)."""
        now = time.perf_counter()
        if self.level_started is not None:  # the level just scored: its forward, LM head, top-k and this rule
            self.level_ms = LEVEL_DECAY * self.level_ms + (1 - LEVEL_DECAY) * 1000 * (now - self.level_started)
        self.level_started = now
        if self.curve is None:
            return beam
        candidates = self.read(table)
        drafting_ms = 1000 * (now - self.started)
        choice = candidates.rate_choice(self.curve, drafting_ms, self.max_nodes, kept=candidates.best(1),
                                        head_trust=self.head_trust, lookup_trust=self.lookup_trust)
        count = len(choice.nodes)
        marginal = self.level_ms + self.curve.cost(count + 2) - self.curve.cost(count + 1)
        worth = choice.expected * marginal / choice.milliseconds  # the tokens a further level must add
        chosen, probs = set(choice.nodes), candidates.probs
        return [node for node in beam if node in chosen and choice.values[node] * probs[node] > worth]

    def read(self, table: CandidateTable | HostTable) -> Candidates:
        """The table's candidates with the cycle's lookup chains, read once while the table stays as it
        is: the rule after the last level drafted (`narrow`) and the selection see the same table."""
        if self.last_read is None or self.last_read[0] is not table or self.last_read[1] != table.filled:
            self.last_read = (table, table.filled, self.candidates(table))
        return self.last_read[2]

    def select(self, table: CandidateTable | HostTable) -> DraftTree:
        """The table read once; with a verify-cost curve the head's best node and as many more (the
        head's and lookup chains') as pay at this machine's cost (`Candidates.select_for_rate`), else
        the best `keep` nodes."""
        self.level_started = None
        candidates, self.last_read = self.read(table), None
        candidates.trace = self.shape.trace(table)
        if self.curve is None:
            tree = candidates.select(self.keep)
        else:
            drafting_ms = 1000 * (time.perf_counter() - self.started)
            tree = candidates.select_for_rate(self.curve, drafting_ms, self.max_nodes, kept=candidates.best(1),
                                              head_trust=self.head_trust, lookup_trust=self.lookup_trust)
        tree.head_trust = self.head_trust
        return tree

    def level_inputs(self, tokens, level: int, first_entry: int, entries: torch.Tensor):
        """A tree level's positions and, of this cycle's entries, those its nodes attend to."""
        m = len(tokens)
        assert self.cache.length == self.consumed + first_entry, "tree entries are appended in feeding order"
        return torch.full((m,), self.consumed - 1 + level, device=tokens.device), entries[:, : first_entry + m]

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        positions, seen = self.level_inputs(tokens, level, first_entry, entries)
        if self.fused is not None and not both:
            return self.fused.step(hidden, tokens, positions, self.cache, self.consumed, seen.contiguous()), None
        context = torch.ones(len(tokens), self.consumed, dtype=torch.bool, device=tokens.device)
        mask = torch.cat([context, seen], dim=1)[None, None]
        if both:
            return self.head.forward_both(hidden, tokens, positions, mask, self.cache)
        return self.head(hidden, tokens, positions, mask, self.cache), None

    def top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return super().top(outputs, k) if self.fused is None else self.fused.top(outputs, k)

    def feed_top(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, k: int):
        """The fused step and its top-k in one kernel call (`FusedEagle3Step.draft`)."""
        if self.fused is None:
            return super().feed_top(hidden, tokens, level, first_entry, entries, k)
        positions, seen = self.level_inputs(tokens, level, first_entry, entries)
        return self.fused.draft(hidden, tokens, positions, self.cache, self.consumed, seen.contiguous(), outputs=None,
                                k=k)

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        return bool(fired)


class FixedHead(HeadProposer):
    """The head on the fixed layout (see the module docstring): one budget every cycle, the largest
    tree the envelope verifies, whatever the room (acceptance stops at the room instead)."""

    described = ", fixed-shape steps"
    lookup_tree = False  # LOOKUP_BRANCHES chains with distinct first tokens: the draft step merges them

    def __init__(self, head: DraftHead, target: Target, shape: StaticTree | DynamicTree, **options):
        super().__init__(head, target, shape, **options)
        self.envelope = envelope = target.envelope
        self.keep, self.head_depth = tree_budget(shape, MAX_TREE_ROWS, MAX_TREE_ROWS - 1)
        self.depth = max(self.head_depth, self.lookup_tokens)  # the deepest node (a lookup chain's)
        self.rows = self.depth + 1  # positions a cycle commits at most: the context pass's rows
        self.reach = self.rows + shape.entries(self.head_depth)  # head entries past the context
        self.cache = FixedHeadCache(envelope.capacity + self.reach)
        # With the target's forward compiled (`--compile on`), the head's layer is too: its steps are
        # captured alike, and its draft levels are as many small kernels as a target step's layers.
        self.layer = torch.compile(head, dynamic=True) if target.compiled else head
        self.layer_both = torch.compile(head.forward_both, dynamic=True) if target.compiled else head.forward_both
        device = next(head.parameters()).device
        self.inputs = HostInputs(device, consumed=(), pending=())
        self.pending_features: torch.Tensor | None = None  # [rows, F], allocated at the first prompt
        self.pending_tokens = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.consumed = self.pending = 0  # host copies: committed entries; committed positions not yet fed
        self.waiting: list[tuple[list[int], torch.Tensor]] = []  # prompt rows not yet fed (tokens, features)
        self.context_end, self.span = None, 0  # this draft step's: where the committed entries end, its window
        if self.lookup is not None:
            shape = (LOOKUP_BRANCHES, self.lookup_tokens)
            self.lookups = HostInputs(device, tokens=shape, lengths=LOOKUP_BRANCHES, evidence=shape)
            self.accept = HostInputs(device, torch.float32, rates=shape)

    def rewind_cache(self, length: int) -> int:
        keep = max(0, min(self.consumed, length - 1))  # entry j also used token j + 1
        if keep < self.consumed:
            self.consumed, self.pending, self.waiting = keep, 0, []
        rows = max(0, length - self.consumed)
        self.pending = min(self.pending, rows)
        waiting, left = [], rows - self.pending
        for tokens, features in self.waiting:
            if left > 0:
                waiting.append((tokens[:left], features[:left]))
            left -= len(tokens)
        self.waiting = waiting
        return self.consumed + self.pending + sum(len(tokens) for tokens, _ in self.waiting)

    def pend(self, tokens: list[int], features: torch.Tensor) -> None:
        self.waiting.append((list(tokens), features))

    def budget(self, max_depth: int, max_nodes: int) -> int:
        if self.waiting:
            self._feed_prompt()
        self.inputs.write(consumed=self.consumed, pending=self.pending)
        return self.envelope.rows_for(self.keep + 1) - 1

    def _feed_prompt(self) -> None:
        """Feed every committed position but the newest through the head (eagerly, in chunks); the
        newest stays pending: the cycle's context pass pairs it with the root."""
        pending = [(self.pending_tokens[: self.pending], self.pending_features[: self.pending])] if self.pending else []
        waiting = [(torch.tensor(tokens, device=self.pending_tokens.device), rows) for tokens, rows in self.waiting]
        tokens, features = (torch.cat(parts) for parts in zip(*pending, *waiting))
        if self.pending_features is None:
            self.pending_features = features.new_zeros(self.rows, features.shape[1])
        for begin in range(0, len(tokens) - 1, PROMPT_CHUNK):
            end = min(begin + PROMPT_CHUNK, len(tokens) - 1)
            window = Window.prompt(self.envelope, self.consumed, end - begin, tokens.device)
            self.head(window.pad(features[begin:end]), window.pad(tokens[begin + 1 : end + 1]), window.slots,
                      window.mask, self.cache.at(window.slots, window.span))
            self.consumed += end - begin
        self.pending_features[0], self.pending_tokens[0] = features[-1], tokens[-1]
        self.pending, self.waiting = 1, []

    def chains(self) -> None:
        """The cycle's lookup chains, for the draft step to merge (a missing token's rate 1: its log is 0, never NaN)."""
        matches = self.matches
        self.lookups.write(tokens=[match.tokens for match in matches], lengths=[len(match.tokens) for match in matches],
                           evidence=[evidences for _, evidences, _ in self.along])
        rates = [accepts + [1.0] * (self.lookup_tokens - len(accepts)) for accepts, _, _ in self.along]
        self.accept.write(rates=rates + [[1.0] * self.lookup_tokens] * (LOOKUP_BRANCHES - len(matches)))

    def context_pass(self, root: torch.Tensor, span: int) -> torch.Tensor:
        """The pending positions through the head (at its fixed rows); the output that predicts the root's children."""
        consumed, count = self.inputs.consumed, self.inputs.pending
        window = Window.causal(consumed, self.rows, span)
        rows = torch.arange(self.rows, device=root.device)
        next_tokens = torch.where(rows == count - 1, root, self.pending_tokens.roll(-1))
        out = self.layer(self.pending_features, next_tokens, window.slots, window.mask,
                         self.cache.at(window.slots, span))
        self.context_end, self.span = consumed + count, span
        return pick(out, count - 1)

    def grow(self, root_hidden: torch.Tensor) -> CandidateTable:
        return self.shape.grow(self, root_hidden, self.head_depth, self.keep)

    def select(self, table: CandidateTable) -> DraftTree:
        if self.lookup is not None:
            lookups = self.lookups
            table = merge_lookup(table, lookups.tokens, lookups.lengths, self.accept.rates.log(), self.head_depth,
                                 lookups.evidence)
        return select_fixed(table, self.keep, self.depth)

    def feed(self, hidden, tokens, level: int, first_entry: int, entries: torch.Tensor, both: bool = False):
        m = len(tokens)
        base = self.inputs.consumed + self.rows
        slots = base + first_entry + torch.arange(m, device=tokens.device)
        mask = window_mask(entries, self.context_end, base, self.span)
        positions = (self.context_end - 1 + level).expand(m)
        window = self.cache.at(slots, self.span)
        if both:
            return self.layer_both(hidden, tokens, positions, mask, window)
        return self.layer(hidden, tokens, positions, mask, window), None

    def stops(self, fired: torch.Tensor, growth: Growth) -> bool:
        growth.alive = ~fired if growth.alive is None else growth.alive & ~fired
        return False

    def commit(self, tree: DraftTree, acceptance, root: torch.Tensor, features: torch.Tensor) -> None:
        self.pending_features.copy_(features)
        self.pending_tokens.copy_(torch.cat([root, tree.tokens[acceptance.path]]))

    def confirm(self, tokens: list[int]) -> None:
        self.consumed += self.pending  # the cycle's context pass fed them
        self.pending = len(tokens)
