"""SpS: standard speculative sampling with a small draft language model (Leviathan et al. 2023;
Chen et al. 2023), on either layout.

The draft model shares the target's tokenizer and keeps its own KV cache. Each cycle it drafts
a chain of k tokens: greedily when the target decodes greedily (then verification is plain
argmax matching), otherwise sampled from q, the draft's distribution processed with the same
temperature/top-k/top-p, and verified with min(1, p/q) and the residual norm(max(0, p - q)).

The draft's cache follows the target's positions; `fed` counts the leading ones whose entries are
right. On the growing layout a cycle feeds what the cache lacks and the root, then each drafted
token; after verification the cache keeps the entries the committed tokens confirm. On the fixed
layout the cycle's step has one shape: it feeds the token at L - 1 (the last one committed, its
entry recomputed to the same values where it was cached) with the root at L, then each drafted
token, k + 1 forwards captured together; whatever the target accepts, every entry before the next
cycle's L - 1 is then right, and the rest is overwritten. A prompt goes through the draft eagerly
before the cycle after it.

On the growing layout (a CPU) with the machine's verify-cost curve, the chain is as long as pays:
each further token is drafted while the tokens it is expected to add (the chain's path probability
so far times the last token's, as the draft is sure of them and as far as its drafts hold in this
chat) raise the cycle's expected tokens per millisecond at what a draft step and a verified row
have cost, up to `draft_tokens`. A draft model's step costs a third of a 3x larger target's, so a
chain of three at a fixed length paid off only where the answer is the draft's too. With a lookup
source (`--lookup`) the continuations found in text already seen join the chain as branches where
the target decodes greedily (`selection.Candidates`: a sampled chain is verified by its own rule),
and with `--plain-when-faster` each cycle takes plain steps, lookup alone or the draft model,
whichever has earned the most tokens a millisecond in this chat (`pace.Pace`, as the head methods
do): on the 1.5B target a rewritten function is copied faster by lookup alone than drafted by the
0.5B, and prose the other way round.

`DraftModelProposer` is the chain's algorithm; what differs by layout, the draft's cache and the
tree's form, is its subclass's, `GrowingDraftModel` or `FixedDraftModel` (`for_target` picks). A
draft model with a head of its own drafts its chains in an engine of its own instead
(`specchat.decode.engine.staged`, above this package).
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from specchat.decode.acceptance.sampling import sample_rows, target_probs
from specchat.decode.drafting.lookup import LookupSource, Match
from specchat.decode.drafting.pace import Arm, Found, LookupAndPace, Pace
from specchat.decode.drafting.selection import LOOKUP_TOKENS, Candidates
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.drafting.trust import HeadTrust, LookupRates
from specchat.decode.options import DRAFT_MODEL_TOKENS
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.runtime.envelope import HostInputs, Window
from specchat.decode.runtime.target import Target

PROMPT_CHUNK = 512  # prompt tokens fed to the draft at once (on the fixed layout eagerly, padded to a bucket)
STEP_DECAY = 0.8  # how fast a draft step's measured cost forgets


class TokenizerMismatch(ValueError):
    """The draft model does not share the target's tokenizer."""


def check_tokenizers(target, draft) -> None:
    ours, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if ours != theirs:
        differing = sum(1 for token, index in theirs.items() if ours.get(token) != index) + len(set(ours) - set(theirs))
        raise TokenizerMismatch(
            f"the draft model's tokenizer ({len(theirs)} tokens) is not the target's ({len(ours)} tokens; "
            f"{differing} entries differ): speculative sampling needs the same vocabulary")


class DraftModelProposer(LookupAndPace):
    """`sps`: chains of up to k tokens from the small model `draft`, on the layout its subclass keeps
    the draft's cache on; on the growing layout, given a curve, as long as pays, joined by lookup
    continuations and paced (see the module docstring)."""

    feature_layers = None
    reach = 0
    described = ""
    paced: bool  # whether a cycle may take plain steps or lookup alone where measured faster (the growing layout)

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS,
                 lookup: LookupSource | None = None, curve: Curve | None = None, pace: bool = False):
        """`lookup`: also draft from text already seen; `curve`: this machine's verify-cost curve (the
        growing layout on a CPU): chains as long as pay; `pace`: each cycle's arm by its measured rate."""
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.model, self.vocab_size, self.k = draft, target.vocab_size, draft_tokens
        self.lookup, self.curve = lookup, curve
        self.context: list[int] = []  # the committed tokens, as the engine reported them
        self.fed = 0  # leading positions whose draft entries are right
        self.steps = draft_tokens  # this cycle's chain length (at most; `drafted`: what it drafted)
        self.drafted: list[int] = []  # this cycle's chain
        self.rates, self.trust = LookupRates(), HeadTrust()  # how lookup's and the draft's tokens are accepted here
        arms = (Arm.PLAIN, Arm.LOOKUP, Arm.MODEL) if lookup is not None else (Arm.PLAIN, Arm.MODEL)
        self.pace = Pace(curve.cost(1), arms) if pace and curve is not None and self.paced else None
        self.arm, self.found = Arm.MODEL, Found.NOTHING  # this cycle's (`Pace`)
        self.matches: list[Match] = []
        self.along: list[tuple[list[float], list[int], list[float]]] = []  # per match, `LookupRates.along` (read once)
        self.lookup_tree: DraftTree | None = None  # the LOOKUP arm's tree, chosen in `prepare`
        self.step_ms: float | None = None  # a draft step's cost, decayed (after the first, which catches up)
        self.started, self.max_nodes = 0.0, 0

    def describe(self) -> str:
        length = "as long as pays, " if self.curve is not None else ""
        return (f"chains of {length}up to {self.k} tokens from {self.model.name}" + self.described
                + (", with lookup" if self.lookup is not None else "") + (", paced" if self.pace is not None else ""))

    def rewind(self, length: int) -> int:
        self.rewind_lookup(length)
        del self.context[length:]
        self.fed = min(self.fed, length)
        self.rewind_cache()
        return len(self.context)

    def observe(self, tokens: list[int], features) -> None:
        self.context.extend(tokens)
        self.prompted(tokens)

    @torch.inference_mode()
    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        self.started, self.max_nodes = time.perf_counter(), max_nodes
        nodes = self.budget(max_depth, max_nodes)
        self.matches, self.along = [], []
        if nodes and self.lookup is not None:
            self.matches = self.lookup.matches(root, min(LOOKUP_TOKENS, max_depth, max_nodes))
            self.along = [self.rates.along(match) for match in self.matches]
        self.arm = Arm.MODEL
        if nodes and self.pace is not None:
            likeliest = self.along[0][0][0] if self.along else 0.0
            self.found = Found.of(bool(self.matches), likeliest)
            self.arm = self.pace.choose(self.found)
            if self.arm is Arm.PLAIN:
                return 0  # a plain step
            if self.arm is Arm.LOOKUP:  # the continuation alone; the draft catches up in its next chain
                self.lookup_tree = self.candidates([], []).select_for_rate(
                    self.curve, 1000 * (time.perf_counter() - self.started), max_nodes, kept=[0])
                return len(self.lookup_tree)
        return nodes + (len(self.matches[0].tokens) if self.matches else 0)

    @torch.inference_mode()
    def draft(self, root, length, span: int | None, sampling, rng) -> DraftTree:
        if self.arm is Arm.LOOKUP:
            tree, self.lookup_tree = self.lookup_tree, None
            return tree
        ids = self.first_ids(root)
        tokens, probs, qs = [], [], []
        for step in range(self.steps):
            began = time.perf_counter()
            logits = self._vocabulary(self.logits(ids, step, length, span).float())
            if sampling.greedy:  # `draw_rows`, with q computed once where it is kept
                token = logits.argmax(-1)
            else:
                q_row = target_probs(logits, sampling)
                token = sample_rows(q_row, rng)
                qs.append(q_row[0])
            probs.append(torch.softmax(logits, -1)[0].gather(0, token))
            tokens.append(token)
            ids = token
            if step:
                self.timed_step(1000 * (time.perf_counter() - began))
            if self.enough(probs):
                break
        tree = self.chain(torch.cat(tokens), torch.cat(probs), torch.stack(qs) if qs else None)
        if self.curve is None or not sampling.greedy:  # a sampled chain is verified whole, by its own rule
            return tree
        return self.paying(tree)

    def timed_step(self, ms: float) -> None:
        """A drafted token's cost, as measured (decayed: `step_ms`)."""
        self.step_ms = ms if self.step_ms is None else STEP_DECAY * self.step_ms + (1 - STEP_DECAY) * ms

    def paying(self, chain: DraftTree) -> DraftTree:
        """The point-mass `chain` and lookup's branches, as many of their nodes as pay at the curve's cost."""
        candidates = self.candidates(chain.tokens, chain.probs)
        return candidates.select_for_rate(self.curve, 1000 * (time.perf_counter() - self.started), self.max_nodes,
                                          kept=[0], head_trust=self.trust.factor())

    def enough(self, probs: list[torch.Tensor]) -> bool:
        """Whether the chain drafted so far (the draft's probabilities `probs`) should end here: at the
        growing layout's rate rule, whether one more token would lower the cycle's expected tokens per
        millisecond (the next token's acceptance taken as likely as the last's)."""
        if self.curve is None or len(probs) >= self.steps:
            return False
        trust, path, expected = self.trust.factor(), 1.0, 1.0
        for prob in probs:  # (few: one read each)
            path *= min(1.0, trust * float(prob))
            expected += path
        drafted = len(probs)
        spent = 1000 * (time.perf_counter() - self.started)
        step = self.step_ms if self.step_ms is not None else spent / drafted
        now = expected / (spent + self.curve.cost(drafted + 1))
        more = (expected + path * min(1.0, trust * float(probs[-1]))) / (spent + step + self.curve.cost(drafted + 2))
        return more <= now

    def candidates(self, tokens: list[int], probs: list[float]) -> Candidates:
        """The draft's chain (its nodes counted as a head's: `HeadTrust`) and lookup's continuation."""
        scores = list(itertools.accumulate(math.log(max(prob, 1e-9)) for prob in probs))
        candidates = Candidates(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)),
                                list(probs), scores)
        for match, along in zip(self.matches, self.along):
            candidates.add_chain(match.tokens, *along)
        return candidates

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [1, V] over the target's vocabulary (a smaller embedding table's padding
        rows: never drafted)."""
        if logits.shape[-1] < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((1, self.vocab_size - logits.shape[-1]), float("-inf"))], -1)
        return logits[:, : self.vocab_size]

    def commit(self, tree: DraftTree, acceptance, root, features) -> None:
        pass

    def committed(self, tokens: list[int], cycle) -> None:
        cycle.arm = self.arm if len(cycle.tree) else Arm.PLAIN
        drafted_at = len(self.context)
        self.context.extend(tokens)
        agreeing = 0  # the committed drafts the chain drafted: their entries are the draft's to keep
        if cycle.arm is Arm.MODEL:
            agreeing = len(list(itertools.takewhile(lambda pair: pair[0] == pair[1], zip(tokens[1:], self.drafted))))
        self.confirm(drafted_at, agreeing + 1 if cycle.arm is Arm.MODEL else 0)
        if self.curve is not None and len(cycle.tree):
            self.trust.learn(cycle)
        if self.lookup is not None:
            self.lookup.observe(tokens)
            self.rates.learn(cycle)
        if self.curve is not None and cycle.forward_seconds:  # live verify forwards heal the cost curve
            self.curve.observe(len(cycle.tree) + 1, 1000 * cycle.forward_seconds)
        if self.pace is not None:
            self.pace.learn(cycle.arm, self.found, len(cycle.accepted) + 1, 1000 * (time.perf_counter() - self.started))

    # What a layout's subclass keeps: the draft's cache (`rewind_cache`; `confirm`: the entries a
    # cycle's committed tokens make right), the cycle's budget (`budget`), the first step's ids
    # (`first_ids`), each step's logits (`logits`) and the chain's form (`chain`).


class GrowingDraftModel(DraftModelProposer):
    """The draft on the growing layout: a cache that grows and is trimmed to the entries known right,
    a cycle as long as the room allows, its chain host lists."""

    paced = True

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS, **options):
        super().__init__(draft, target, draft_tokens, **options)
        self.cache = draft.new_cache(capacity=None)

    def rewind_cache(self) -> None:
        self.cache.trim(min(self.fed, self.cache.length))

    @torch.inference_mode()
    def observe(self, tokens: list[int], features) -> None:
        """A prompt, through the draft at once (in chunks): its time is the reply's first token's, not
        the first chain's, which the pace would weigh against drafting for many cycles."""
        super().observe(tokens, features)
        for start in range(self.fed, len(self.context), PROMPT_CHUNK):
            chunk = self.context[start : start + PROMPT_CHUNK]
            self.model.forward(torch.tensor([chunk], device=self.model.device), self.cache, logits_for="none")
        self.fed = len(self.context)

    def budget(self, max_depth: int, max_nodes: int) -> int:
        self.steps = min(self.k, max_depth, max_nodes)
        return self.steps

    def first_ids(self, root: int) -> torch.Tensor:
        """What the cache lacks, and the root."""
        return torch.tensor([self.context[self.fed :] + [root]], device=self.model.device)

    def logits(self, ids: torch.Tensor, step: int, length, span: None) -> torch.Tensor:
        """The logits [1, V] after the growing cache's next positions: the first step's [1, n], then the
        token drawn."""
        return self.model.forward(ids if step == 0 else ids[None], self.cache, logits_for="last").logits

    def chain(self, tokens: torch.Tensor, probs: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
        self.drafted = tokens.tolist()
        tree = DraftTree.chain(self.drafted, probs.tolist())
        tree.q = q
        return tree

    def confirm(self, drafted_at: int, kept: int) -> None:
        """The entries of the root and of the committed drafts the chain fed stay (`kept` of them: not
        the last draft's, which the chain never fed; none after a plain step or lookup's cycle)."""
        self.fed = min(drafted_at + kept, self.cache.length)
        self.cache.trim(self.fed)


class FixedDraftModel(DraftModelProposer):
    """The draft on the fixed layout: a fixed-capacity cache whose stale entries are overwritten, one
    step shape every cycle (k + 1 forwards captured together), its chain device tensors."""

    described = " (fixed-shape steps)"
    paced = False

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS):
        super().__init__(draft, target, draft_tokens)
        self.envelope = target.envelope
        self.reach = draft_tokens + 1
        self.cache = draft.new_cache(capacity=self.envelope.capacity)
        self.last = HostInputs(draft.device, token=())  # the token at L - 1, which the step feeds again

    def rewind_cache(self) -> None:
        pass  # entries past `fed` are overwritten before they are read

    @torch.inference_mode()
    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        """A prompt through the draft (eagerly, in chunks) but its newest token, which the step feeds;
        a bucket's nodes, whatever the room."""
        newest = len(self.context) - 1
        for start in range(self.fed, newest, PROMPT_CHUNK):
            chunk = self.context[start : min(start + PROMPT_CHUNK, newest)]
            window = Window.prompt(self.envelope, start, len(chunk), self.model.device)
            window.forward(self.model, torch.tensor(chunk, device=self.model.device), self.cache, logits_for="none")
        self.fed = max(self.fed, newest)
        self.last.write(token=self.context[-1])
        return self.envelope.rows_for(self.k + 1) - 1

    def first_ids(self, root: torch.Tensor) -> torch.Tensor:
        """The token at L - 1 (its entry recomputed alike) and the root."""
        return torch.cat([self.last.token[None], root])

    def logits(self, ids: torch.Tensor, step: int, length, span: int) -> torch.Tensor:
        """The logits [1, V] of the window from L - 1 (the first step's two rows) or L + step."""
        rows = 2 if step == 0 else 1
        window = Window.causal(length - 1 if step == 0 else length + step, rows, span)
        return window.forward(self.model, ids, self.cache, logits_for=rows - 1).logits

    def chain(self, tokens: torch.Tensor, probs: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
        return DraftTree.device_chain(tokens, torch.ones(self.k, dtype=torch.bool, device=tokens.device), probs, q)

    def confirm(self, drafted_at: int, count: int) -> None:
        """Every entry before the newest token's is right: the next step recomputes that one."""
        self.fed = len(self.context) - 1


def for_target(draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS, **options) -> DraftModelProposer:
    """`sps` with `draft` on `target`'s layout; `options` (lookup, curve, pace) are the growing layout's:
    the fixed one verifies a whole bucket every step, its chains at their full length."""
    if target.envelope is not None:
        return FixedDraftModel(draft, target, draft_tokens)
    return GrowingDraftModel(draft, target, draft_tokens, **options)
