"""The fixed layout: the target's cache at a fixed capacity, every step a fixed shape, replayed as a
CUDA graph where there is one (`specchat.decode.runtime.graphs`), one host read per step. What CUDA runs.

A cycle is two steps. The *draft* step runs the proposer on the device and leaves a tree of a
bucket's size (`specchat.decode.runtime.envelope`) in static buffers; the *verify* step runs the
target on it, accepts on the device (`acceptance.verify.accept_fixed`), compacts the accepted
path in the cache, hands the proposer what it needs for the next cycle (the accepted path's
features, still on the device) and writes one record: the accepted ids, the bonus token, their
margins and the tree (`CycleRecord`). The host reads that record (the cycle's only read), and the
next cycle starts from the bonus token, which never left the device. What changes from cycle to
cycle reaches a step as tensors the host writes before the run (`HostInputs`: the context length,
the reply's room), never as Python values baked into a graph.

Prefills (once per reply, large, many shapes) run eagerly, padded to a bucket. The growing layout
(`specchat.decode.engine.growing`) runs the same cycle at exact sizes.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from specchat.decode.acceptance.sampling import SamplingParams, draw_rows, row_margins
from specchat.decode.acceptance.verify import accept_fixed, ancestor_mask
from specchat.decode.drafting.tree import Cycle, DraftTree, Source
from specchat.decode.runtime.envelope import Fields, HostInputs, Window, window_mask
from specchat.decode.runtime.graphs import StepGraphs
from specchat.decode.runtime.machine import synchronize
from specchat.decode.runtime.target import ForwardTimes, Target, TargetOutput

NODE_FIELDS = ("tokens", "parents", "depths", "valid", "probs", "sources", "evidence")  # a tree's, in a record


class FixedLayout:
    """The target's cache and a cycle's steps at fixed shapes (see the module docstring)."""

    def __init__(self, target: Target, capture: bool | None = None):
        self.target, self.envelope = target, target.envelope
        device = target.device
        self.cache = target.new_cache(capacity=self.envelope.capacity)
        self.graphs = StepGraphs(device, capture=target.captures if capture is None else capture, ledger=target)
        self.inputs = HostInputs(device, length=(), limit=())
        self.root = torch.zeros(1, dtype=torch.long, device=device)  # the newest token, not yet in the cache
        self._trees: dict[tuple, DraftTree] = {}  # the draft step's output, which the verify step reads, by step
        self._records: dict[tuple[int, int], CycleRecord] = {}  # what the host reads after a step, by its tree's size
        self._clock = StepClock(device)

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds

    def prefill(self, chunk: list[int], length: int, last: bool, feature_layers) -> TargetOutput:
        """One chunk of the prompt, padded to a bucket (eager: prefills are not captured); its
        features are the chunk's rows; the `last` chunk's logits are those of the token after it."""
        window = Window.prompt(self.envelope, length, len(chunk), self.target.device)
        out = window.forward(self.target, torch.tensor(chunk, device=self.target.device), self.cache,
                             logits_for=len(chunk) - 1 if last else "none", feature_layers=feature_layers)
        self.cache.extend(len(chunk))
        return TargetOutput(out.logits, None if out.features is None else out.features[: len(chunk)])

    def first_token(self, logits: torch.Tensor, sampling: SamplingParams, rng) -> tuple[int, float]:
        """The reply's first token, drawn on the device into the root the first cycle starts from."""
        first = draw_rows(logits, sampling, rng)
        self.root.copy_(first)
        token, margin = torch.cat([first.double(), row_margins(logits).double()]).tolist()
        return int(token), margin

    def plain_step(self, root: int, length: int, sampling: SamplingParams, rng,
                   feature_layers: tuple[int, ...] | None = None) -> tuple[int, float, None, ForwardTimes]:
        """The captured plain step from the root on the device (`root`, the same token, is the host's copy);
        its forward is not timed apart (a captured step is timed as a whole)."""
        assert feature_layers is None, "a proposer that takes features drafts every cycle on the fixed layout"
        span = self.envelope.span_for(length + 1)
        rng = None if sampling.greedy else rng
        self.inputs.write(length=length)
        self.graphs.run(("plain", span, sampling, rng), lambda: self._plain(span, sampling, rng), rng)
        record = self._record(0, 0).read()  # the step's one read
        self.cache.extend(1)
        return int(record["bonus"][0]), record["margins"][0], None, ForwardTimes()

    def _plain(self, span: int, sampling: SamplingParams, rng) -> None:
        out = Window.causal(self.inputs.length, 1, span).forward(self.target, self.root, self.cache)
        token = draw_rows(out.logits, sampling, rng)
        self.root.copy_(token)
        self._record(0, 0).write(count=token.new_zeros(()), bonus=token, margins=row_margins(out.logits))

    def cycle(self, proposer, root: int, length: int, nodes: int, room: int, sampling: SamplingParams, rng,
              start: float) -> tuple[Cycle, list[float], float, float, ForwardTimes]:
        """Draft and verify (two steps), then the cycle's one read: the cycle, the kept rows' margins,
        and the two steps' seconds (`start` is the growing layout's; the steps are timed on the device,
        the verify forward not apart from its step)."""
        span = self.envelope.span_for(length + max(self.envelope.rows_for(nodes + 1), proposer.reach))
        rng = None if sampling.greedy else rng
        key = (proposer, nodes, span, sampling, rng)
        self.inputs.write(length=length, limit=room - 1)
        self._clock.mark()
        self.graphs.run(("draft", *key), lambda: self._draft(key, sampling, rng), rng)
        self._clock.mark()
        self.graphs.run(("verify", *key), lambda: self._verify(key, sampling, rng), rng)
        self._clock.mark()
        tree = self._trees[key]
        record = self._record(nodes, tree.depth).read()  # the cycle's one read
        draft_seconds, verify_seconds = self._clock.intervals()  # the one place a verify step is timed, nodes + 1 rows
        cycle, margins = read_cycle(record, root, nodes)
        self.cache.extend(len(cycle.accepted) + 1)
        return cycle, margins, draft_seconds, verify_seconds, ForwardTimes()

    def _draft(self, key: tuple, sampling: SamplingParams, rng) -> None:
        proposer, nodes, span = key[:3]
        tree = padded(proposer.draft(self.root, self.inputs.length, span, sampling, rng), nodes)
        arrays = {name: value for name, value in vars(tree).items() if isinstance(value, torch.Tensor)}
        if key not in self._trees:  # the first (eager) run allocates the static tree
            self._trees[key] = dataclasses.replace(tree, **{name: value.clone() for name, value in arrays.items()})
        static = self._trees[key]
        for name, value in arrays.items():
            getattr(static, name).copy_(value)

    def _verify(self, key: tuple, sampling: SamplingParams, rng) -> None:
        proposer, span = key[0], key[2]
        tree, length = self._trees[key], self.inputs.length
        ancestors = ancestor_mask(tree)  # the mask's tree part, and each accepted node's path
        ids, positions, mask, slots = verify_rows(tree, self.root, length, span, ancestors)
        out = self.target.forward_at(ids, self.cache, positions=positions, mask=mask, slots=slots, span=span,
                                     feature_layers=proposer.feature_layers)
        acceptance = accept_fixed(tree, out.logits, sampling, rng, self.inputs.limit, ancestors)
        kept = acceptance.kept_rows()
        self.cache.gather_rows(length, kept)
        proposer.commit(tree, acceptance, self.root, None if out.features is None else out.features[kept])
        self.root.copy_(acceptance.bonus[None])
        nothing = torch.zeros_like(tree.tokens)
        self._record(len(tree), tree.depth).write(
            count=acceptance.count, bonus=acceptance.bonus, path=acceptance.path, margins=row_margins(out.logits[kept]),
            tokens=tree.tokens, parents=tree.parents, depths=tree.depths, valid=tree.valid, probs=tree.probs,
            sources=nothing if tree.sources is None else tree.sources,
            evidence=nothing if tree.evidence is None else tree.evidence)

    def _record(self, nodes: int, depth: int) -> CycleRecord:
        """The static record a step of `nodes` tree nodes (0: a plain step) writes and the host reads."""
        if (nodes, depth) not in self._records:
            self._records[nodes, depth] = CycleRecord(self.target.device, nodes, depth)
        return self._records[nodes, depth]

    def plain_step_seconds(self, steps: int, context_ids: list[int]) -> list[float]:
        """The captured plain step, timed (its writes past the context are scratch)."""
        length, root = len(context_ids), self.root.clone()
        span = self.envelope.span_for(length + 1)
        greedy = SamplingParams()
        self.inputs.write(length=length)
        timings = []
        for _ in range(steps):
            begun = time.perf_counter()
            self.graphs.run(("plain", span, greedy, None), lambda: self._plain(span, greedy, None))
            synchronize(self.target.device)
            timings.append(time.perf_counter() - begun)
        self.root.copy_(root)
        return timings


class CycleRecord:
    """What the host reads after a step, declared once: the accepted count, the bonus token, the path
    (tree depth), the kept rows' margins (depth + 1) and the tree's arrays (nodes each), as one
    float64 vector on the device (token ids are exact in it)."""

    def __init__(self, device: torch.device, nodes: int, depth: int):
        self.fields = Fields(count=(), bonus=(), path=depth, margins=depth + 1, **dict.fromkeys(NODE_FIELDS, nodes))
        self.buffer = torch.zeros(self.fields.size, dtype=torch.float64, device=device)

    def write(self, **values: torch.Tensor) -> None:
        """On the device: every field of the record (one of no size may be left out)."""
        self.buffer.copy_(torch.cat([values[name].double().reshape(-1) if name in values else self.buffer[:0]
                                     for name in self.fields.shapes]))

    def read(self) -> dict[str, list[float]]:
        """On the host: the one read."""
        return self.fields.split(self.buffer.tolist())


def read_cycle(record: dict[str, list[float]], root: int, nodes: int) -> tuple[Cycle, list[float]]:
    """The `Cycle` of a record (its tree holding the verified nodes only, as lists) and the kept rows' margins."""
    count = int(record["count"][0])
    verified = [node for node in range(nodes) if record["valid"][node]]
    position = {node: index for index, node in enumerate(verified)}
    tokens, parents, depths, _, probs, sources, evidence = ([record[name][node] for node in verified]
                                                            for name in NODE_FIELDS)
    hybrid = any(sources)  # a node from a lookup: the tree's sources are recorded
    tree = DraftTree(tokens=[int(t) for t in tokens], parents=[position[int(p)] if p >= 0 else -1 for p in parents],
                     depths=[int(d) for d in depths], probs=probs,
                     sources=[Source(int(s)) for s in sources] if hybrid else [],
                     evidence=[int(e) for e in evidence] if hybrid else [])
    path = [position[int(node)] for node in record["path"][:count]]
    return Cycle(root, tree, path, int(record["bonus"][0])), record["margins"][: count + 1]


def padded(tree: DraftTree, nodes: int) -> DraftTree:
    """A device tree with invalid nodes appended up to `nodes` (children of the root, token 0): its bucket."""
    extra = nodes - len(tree)
    if extra == 0:
        return tree
    assert extra > 0, "a tree is padded to at least its size"

    def grow(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])

    return dataclasses.replace(tree, tokens=grow(tree.tokens, 0), parents=grow(tree.parents, -1),
                               depths=grow(tree.depths, 1), valid=grow(tree.valid, False), probs=grow(tree.probs, 0.0),
                               sources=grow(tree.sources, 0), evidence=grow(tree.evidence, 0), q=grow(tree.q, 0.0))


def verify_rows(tree: DraftTree, root: torch.Tensor, length: torch.Tensor, span: int, ancestors: torch.Tensor):
    """The target forward's inputs for verifying a device tree after `root` ([1]) at context `length`:
    ids, positions [1, n + 1], mask [1, 1, n + 1, span] and the cache slots [n + 1] they go to.
    Row 0 is the root, row i + 1 node i (the growing layout's form: `growing.verify_inputs`);
    `ancestors` is `ancestor_mask(tree)`."""
    n, device = len(tree), root.device
    ids = torch.cat([root, tree.tokens])[None]
    positions = (length + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths]))[None]
    block = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    block[:, 0].fill_(True)  # (assigning a Python value makes a host tensor of it first: not in a step)
    block[1:, 1:] = ancestors
    slots = length + torch.arange(n + 1, device=device)
    return ids, positions, window_mask(block, length, length, span), slots


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
