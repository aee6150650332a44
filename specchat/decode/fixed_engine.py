"""The engine on the fixed envelope (`specchat.decode.envelope`): every step a fixed shape, replayed
as a CUDA graph where there is one (`specchat.decode.graphs`), one host read per step.

A cycle is two steps. The *draft* step runs the proposer on the device and leaves a `FixedTree`
of a bucket's size in static buffers; the *verify* step runs the target on it, accepts on the
device (`accept_fixed`), compacts the accepted path in the cache, hands the proposer what it
needs for the next cycle (the accepted path's features, still on the device) and writes one
record: the accepted ids, the bonus token, their margins and the tree. The host reads that record
(the cycle's only read), extends the context, and the next cycle starts from the bonus token, which
never left the device. What changes from cycle to cycle reaches a step as tensors the host writes
before the run (`HostInputs`: the context length, the reply's room), never as Python values baked
into a graph.

Prefills (once per reply, large, many shapes) run eagerly, padded to a bucket.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from specchat.decode.engine import Engine, GenerationSettings, Proposer, StepResult
from specchat.decode.envelope import Envelope, FixedTree, HostInputs, causal_block, verify_rows, window_mask
from specchat.decode.graphs import StepGraphs
from specchat.decode.machine import synchronize
from specchat.decode.sampling import SamplingParams, draw_rows, row_margins
from specchat.decode.target import Target, TargetOutput
from specchat.decode.tree import Cycle, DraftTree, Source
from specchat.decode.verify import FixedAcceptance, accept_fixed

PER_NODE = 7  # numbers per tree node in a cycle's record (`pack_cycle`)


class FixedProposer(Protocol):
    """A source of draft trees of fixed shape, built on the device (the fixed envelope's `Proposer`).

    The host side (`prepare`, `committed`, `observe`, `rewind`) keeps its bookkeeping in step with
    the engine's; the device side (`draft`, `commit`) runs inside the captured steps and may not
    read the host or depend on Python values that change between cycles.
    """

    feature_layers: tuple[int, ...] | None
    #: how far past the context length its cache entries reach in a draft step (the span must cover them)
    reach: int

    def rewind(self, length: int) -> int:
        """As `Proposer.rewind`."""

    def observe(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """Prompt tokens a prefill committed (eagerly), with the target's features at them."""

    def start(self, root: torch.Tensor) -> None:
        """A prefill drew `root` ([1], on the device): make ready for the first cycle (eagerly)."""

    def prepare(self, root: int) -> int:
        """Before a cycle (host): the number of tree nodes it will draft, padding included (0:
        nothing to verify, a plain step instead; only a proposer that needs no features may say so)."""

    def draft(self, nodes: int, root: torch.Tensor, length: torch.Tensor, span: int, sampling: SamplingParams,
              rng) -> FixedTree:
        """The draft step: a tree of at most `nodes` nodes (`prepare`'s) from `root` ([1]) at context
        `length` (a 0-d tensor)."""

    def commit(self, tree: FixedTree, acceptance: FixedAcceptance, root: torch.Tensor,
               features: torch.Tensor | None) -> None:
        """In the verify step: what was accepted of `tree` after `root`, and the target's features at
        the kept rows (the root's and the accepted nodes')."""

    def committed(self, tokens: list[int], cycle: Cycle) -> None:
        """After the cycle's read (host): the tokens it committed, the root first, and the cycle."""

    def describe(self) -> str: ...

    def forget(self) -> None: ...


class FixedEngine(Engine):
    """`Engine` on the fixed envelope. Same replies, same statistics; see the module docstring."""

    def __init__(self, target: Target, proposer: FixedProposer | None = None, capture: bool | None = None):
        self.envelope: Envelope = target.envelope
        super().__init__(target, proposer)
        device = target.device
        self.graphs = StepGraphs(device, capture=target.captures if capture is None else capture, ledger=target)
        self.inputs = HostInputs(device, "length", "limit")
        self.root = torch.zeros(1, dtype=torch.long, device=device)  # the newest token, not yet in the cache
        self._trees: dict[tuple[int, bool], FixedTree] = {}  # the draft step's output, by node count and sampling
        self._records: dict[int, torch.Tensor] = {}  # what the host reads after a step, by node count
        self._clock = StepClock(device)

    def _new_cache(self):
        return self.target.new_cache(capacity=self.target.envelope.capacity)

    # -- prefill ---------------------------------------------------------------------------------

    def _first_token(self, out: TargetOutput, settings: GenerationSettings, rng, start: float) -> StepResult:
        """The reply's first token, drawn on the device into the root the first cycle starts from."""
        first = draw_rows(out.logits, settings.sampling, rng)
        self.root.copy_(first)
        token, margin = torch.cat([first.double(), row_margins(out.logits).double()]).tolist()
        if self.proposer is not None:
            self.proposer.start(self.root)
        return StepResult(tokens=[int(token)], drafted=[False], seconds=time.perf_counter() - start, prefill=True,
                          margins=[margin])

    def _prefill_chunk(self, chunk: list[int], last: bool) -> TargetOutput:
        """One chunk of the prompt, padded to a bucket (eager: prefills are not captured); its
        features are the chunk's rows; the `last` chunk's logits are those of the token after it."""
        length, device = len(self.context_ids), self.target.device
        rows = self.envelope.rows_for(len(chunk))
        span = self.envelope.span_for(length + rows)
        ids = torch.tensor([chunk + [0] * (rows - len(chunk))], device=device)
        at = torch.tensor(length, device=device)
        slots = at + torch.arange(rows, device=device)
        out = self.target.forward_at(ids, self.cache, positions=slots[None], slots=slots, span=span,
                                     mask=window_mask(causal_block(rows, device), at, at, span),
                                     logits_for=len(chunk) - 1 if last else "none",
                                     feature_layers=self.proposer.feature_layers if self.proposer else None)
        self.cache.extend(len(chunk))
        return TargetOutput(out.logits, None if out.features is None else out.features[: len(chunk)])

    # -- plain decoding ----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_step(self, root: int, settings: GenerationSettings, rng) -> StepResult:
        start, capturing = time.perf_counter(), self.graphs.capture_seconds
        length = len(self.context_ids)
        span = self.envelope.span_for(length + 1)
        rng = None if settings.sampling.greedy else rng
        self.inputs.write(length=length)
        self.graphs.run(("plain", span, settings.sampling, rng), lambda: self._plain(span, settings.sampling, rng), rng)
        token, margin = self._record(0).tolist()  # the step's one read
        self.cache.extend(1)
        self.context_ids.append(root)
        seconds = time.perf_counter() - start - (self.graphs.capture_seconds - capturing)  # capture apart
        return StepResult(tokens=[int(token)], drafted=[False], seconds=seconds, margins=[margin])

    @torch.inference_mode()
    def plain_step_seconds(self, steps: int) -> list[float]:
        """`Engine.plain_step_seconds` on the captured plain step (its writes past the context are scratch)."""
        length, root = len(self.context_ids), self.root.clone()
        span = self.envelope.span_for(length + 1)
        greedy = SamplingParams()
        self.inputs.write(length=length)
        timings = []
        for _ in range(steps):
            start = time.perf_counter()
            self.graphs.run(("plain", span, greedy, None), lambda: self._plain(span, greedy, None))
            synchronize(self.target.device)
            timings.append(time.perf_counter() - start)
        self.root.copy_(root)
        return timings

    def _plain(self, span: int, sampling: SamplingParams, rng) -> None:
        length = self.inputs["length"]
        slots = length[None]
        out = self.target.forward_at(self.root[None], self.cache, positions=slots[None], slots=slots, span=span,
                                     mask=window_mask(causal_block(1, slots.device), length, length, span))
        token = draw_rows(out.logits, sampling, rng)
        self.root.copy_(token)
        self._record(0).copy_(torch.cat([token.double(), row_margins(out.logits).double()]))

    # -- one speculative cycle -----------------------------------------------------------------

    @torch.inference_mode()
    def speculative_step(self, root: int, settings: GenerationSettings, rng, room: int) -> StepResult:
        """Draft (on the device), verify, accept, compact, commit: two steps and one read."""
        nodes = self.proposer.prepare(root)
        if nodes == 0:  # nothing to verify (no lookup match): a plain step
            step = self.decode_step(root, settings, rng)
            step.cycle = Cycle(root, DraftTree([], [], [], []), [], step.tokens[0])
            self.proposer.committed([root], step.cycle)
            return step
        start, capturing = time.perf_counter(), self.graphs.capture_seconds
        length = len(self.context_ids)
        span = self.envelope.span_for(length + max(self.envelope.rows_for(nodes + 1), self.proposer.reach))
        rng = None if settings.sampling.greedy else rng
        key = (nodes, span, settings.sampling, rng)
        self.inputs.write(length=length, limit=room - 1)
        self._clock.mark()
        self.graphs.run(("draft", *key), lambda: self._draft(nodes, span, settings.sampling, rng), rng)
        self._clock.mark()
        self.graphs.run(("verify", *key), lambda: self._verify(nodes, span, settings.sampling, rng), rng)
        self._clock.mark()
        tree = self._trees[nodes, not settings.sampling.greedy]
        record = self._record(nodes, tree.depth).tolist()  # the cycle's one read
        draft_seconds, verify_seconds = self._clock.intervals()
        cycle, margins = unpack_cycle(record, root, nodes, tree.depth)
        committed = [root] + [cycle.tree.tokens[node] for node in cycle.accepted]
        self.cache.extend(len(committed))
        self.context_ids.extend(committed)
        self.proposer.committed(committed, cycle)
        return StepResult(
            tokens=committed[1:] + [cycle.bonus], drafted=[True] * len(cycle.accepted) + [False],
            seconds=time.perf_counter() - start - (self.graphs.capture_seconds - capturing),
            draft_seconds=draft_seconds, verify_seconds=verify_seconds, draft_tokens=len(cycle.tree), cycle=cycle,
            margins=margins,
        )

    def _draft(self, nodes: int, span: int, sampling: SamplingParams, rng) -> None:
        tree = self.proposer.draft(nodes, self.root, self.inputs["length"], span, sampling, rng).padded(nodes)
        key = nodes, not sampling.greedy
        if key not in self._trees:  # the first (eager) run allocates the static tree
            self._trees[key] = FixedTree(*(t.clone() if isinstance(t, torch.Tensor) else t
                                             for t in (tree.tokens, tree.parents, tree.depths, tree.valid,
                                                       tree.probs, tree.depth, tree.sources, tree.evidence, tree.q)))
        static = self._trees[key]
        for name in ("tokens", "parents", "depths", "valid", "probs", "sources", "evidence", "q"):
            if getattr(tree, name) is not None:
                getattr(static, name).copy_(getattr(tree, name))

    def _verify(self, nodes: int, span: int, sampling: SamplingParams, rng) -> None:
        tree, length = self._trees[nodes, not sampling.greedy], self.inputs["length"]
        ancestors = tree.ancestors()  # the mask's tree part, and each accepted node's path
        ids, positions, mask, slots = verify_rows(tree, self.root, length, span, ancestors)
        out = self.target.forward_at(ids, self.cache, positions=positions, mask=mask, slots=slots, span=span,
                                     feature_layers=self.proposer.feature_layers)
        acceptance = accept_fixed(tree, out.logits, sampling, rng, self.inputs["limit"], ancestors)
        kept = acceptance.kept_rows()
        self.cache.gather_rows(length, kept)
        self.proposer.commit(tree, acceptance, self.root, None if out.features is None else out.features[kept])
        self.root.copy_(acceptance.bonus[None])
        self._record(nodes, tree.depth).copy_(pack_cycle(tree, acceptance, row_margins(out.logits[kept])))

    def _record(self, nodes: int, depth: int = 0) -> torch.Tensor:
        """The static buffer a step of `nodes` tree nodes writes its record to (0: a plain step)."""
        if nodes not in self._records:
            size = 2 if nodes == 0 else 2 + depth + (depth + 1) + PER_NODE * nodes
            self._records[nodes] = torch.zeros(size, dtype=torch.float64, device=self.target.device)
        return self._records[nodes]


def pack_cycle(tree: FixedTree, acceptance: FixedAcceptance, margins: torch.Tensor) -> torch.Tensor:
    """A cycle's record as one float64 vector (token ids are exact in it): accepted count, bonus,
    the path (tree.depth), the margins of the kept rows (tree.depth + 1), then the tree's tokens,
    parents, depths, validity, probabilities, sources and lookup evidence."""
    sources = tree.sources if tree.sources is not None else torch.zeros_like(tree.tokens)
    evidence = tree.evidence if tree.evidence is not None else torch.zeros_like(tree.tokens)
    return torch.cat([torch.stack([acceptance.count, acceptance.bonus]).double(), acceptance.path.double(),
                      margins.double(), tree.tokens.double(), tree.parents.double(), tree.depths.double(),
                      tree.valid.double(), tree.probs.double(), sources.double(), evidence.double()])


def unpack_cycle(record: list[float], root: int, nodes: int, depth: int) -> tuple[Cycle, list[float]]:
    """The `Cycle` (its tree holding the verified nodes only) and the kept rows' margins of a record."""
    count, bonus = int(record[0]), int(record[1])
    path = [int(node) for node in record[2 : 2 + count]]
    margins = record[2 + depth : 2 + depth + count + 1]
    fields = [record[3 + 2 * depth + i * nodes : 3 + 2 * depth + (i + 1) * nodes] for i in range(PER_NODE)]
    tokens, parents, depths, valid, probs, sources, evidence = fields
    verified = [node for node in range(nodes) if valid[node]]
    position = {node: index for index, node in enumerate(verified)}
    hybrid = any(sources)  # a node from a lookup: the tree's sources are recorded
    tree = DraftTree(tokens=[int(tokens[node]) for node in verified],
                     parents=[position[int(parents[node])] if parents[node] >= 0 else -1 for node in verified],
                     depths=[int(depths[node]) for node in verified], probs=[probs[node] for node in verified],
                     sources=[Source(int(sources[node])) for node in verified] if hybrid else [],
                     lookup_evidence=[int(evidence[node]) for node in verified] if hybrid else [])
    return Cycle(root, tree, [position[node] for node in path], bonus), margins


class StepClock:
    """Times between marks around the steps of a cycle: CUDA events on a GPU (read after the
    cycle's one read has synchronized, so they cost no extra wait), the wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        marks, self.marks = self.marks, []
        if self.cuda:
            return [start.elapsed_time(end) / 1000 for start, end in zip(marks, marks[1:])]
        return [end - start for start, end in zip(marks, marks[1:])]


def new_engine(target: Target, proposer: Proposer | FixedProposer | None = None) -> Engine:
    """The engine for `target`: on the fixed envelope where the target was loaded for it."""
    return FixedEngine(target, proposer) if target.envelope is not None else Engine(target, proposer)
