"""The generation engine: token ids in, token ids out. It knows nothing of text or terminals.

Three thin layers, bottom up:

1. `Engine.decode_step` (plain decoding) and `Engine.speculative_step` (one draft → verify →
   accept → compact cycle) each produce a `StepResult`.
2. `Engine.generate` streams the `StepResult`s of one reply: prefill, then steps, until an
   end-of-turn token, the token budget or the context limit.
3. `specchat.chat.ChatSession` adds text, conversations and statistics; the UI consumes only that.

The engine owns the target's KV cache and the list of token ids it holds (`context_ids`), and
changes both only through explicit trims and compactions. A new reply reuses the longest cached
prefix of its prompt, so multi-turn chat does not recompute the conversation, and a reply that was
interrupted (Ctrl-C) leaves nothing half-done behind: the `finally` in `generate` trims every cache
back to the committed tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specchat.errors import ContextLengthError
from specchat.decode.machine import synchronize
from specchat.decode.options import MAX_NEW_TOKENS
from specchat.decode.sampling import SamplingParams, argmax, margins, sample, target_probs
from specchat.decode.target import Target, TargetOutput
from specchat.decode.tree import Cycle, DraftTree
from specchat.decode.verify import accept, verify_inputs

# Long prompts are prefilled in pieces of this many tokens, which bounds the size of the
# attention mask and scores without changing the result.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class GenerationSettings:
    """What one reply may do: how many tokens, how they are drawn, what ends it."""

    max_new_tokens: int = MAX_NEW_TOKENS
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class StepResult:
    """What one engine step produced.

    Attributes:
        tokens: the new token ids, in order (a final end-of-turn token included).
        drafted: per token, True if it was a draft token the target accepted, False if the target
            produced it itself (the prefill token, a bonus token or a correction).
        seconds: wall time of the step.
        target_forwards: target forward passes spent (one per step; the prefill counts as one).
        draft_seconds / verify_seconds: the drafting and the verification part of `seconds`.
        draft_tokens: draft tokens the target verified in this step (the tree size).
        forward_seconds: the step's target forward (plain or verifying), of `seconds`; with the
            target `profiling`, its products' and attention's parts (`products_seconds`,
            `attention_seconds`).
        finish_reason: "stop" (end-of-turn token), "length" (token budget or context full), or
            None while the reply goes on.
        prefill: True for the first step of a reply (prompt processing plus the first token).
        cycle: the draft tree and what was accepted (`specchat.decode.tree.Cycle`), for traces and /tree.
        margins: per token, the target's top-1 minus top-2 logit where it was chosen: how near a
            tie the choice was, which tells rounding noise from a bug when two runs differ.
    """

    tokens: list[int]
    drafted: list[bool]
    seconds: float
    target_forwards: int = 1
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_tokens: int = 0
    forward_seconds: float = 0.0
    products_seconds: float = 0.0
    attention_seconds: float = 0.0
    finish_reason: str | None = None
    prefill: bool = False
    cycle: object | None = None
    margins: list[float] = field(default_factory=list)


class Proposer(Protocol):
    """A source of draft tokens: a draft head, a small draft model, or n-gram lookup.

    The engine tells a proposer which context tokens are committed (`observe`), what the target
    accepted of its latest tree (`observe`'s `cycle`: the proposer need not work it out from the
    tokens), and when the context shrinks (`rewind`); the proposer keeps whatever state it needs in
    step with that.
    """

    #: Hidden-state indices of the target the proposer consumes (see `Target.forward`), or None.
    feature_layers: tuple[int, ...] | None

    def rewind(self, length: int) -> int:
        """Forget everything about context positions >= `length`.

        Returns the number of leading positions it can still continue from; the engine re-runs
        the target from there so the proposer sees those positions' features again.
        """

    def observe(self, tokens: list[int], features: torch.Tensor | None, cycle: Cycle | None = None) -> None:
        """Newly committed context tokens (and the target's features at their positions); after a
        speculative step, `cycle` is the tree it proposed and the nodes the target accepted."""

    def propose(self, root: int, settings: GenerationSettings, rng: torch.Generator | None,
                max_depth: int, max_nodes: int) -> DraftTree:
        """A draft tree growing from `root` (the newest token, not yet in the context), at most
        `max_depth` deep and `max_nodes` large; `rng` is the run's random stream."""

    def describe(self) -> str:
        """What it drafts, in a few words (for /show)."""

    def forget(self) -> None:
        """Forget the text seen so far, beyond the context (a lookup's history of the chat): what
        follows is unrelated (bench questions, which Spec-Bench answers independently)."""


class Engine:
    """Generates replies from a target model, optionally speculating with a proposer."""

    def __init__(self, target: Target, proposer: Proposer | None = None):
        self.target = target
        self.proposer = proposer
        self.cache = self._new_cache()
        self.context_ids: list[int] = []  # exactly the tokens whose keys/values `cache` holds
        self.max_context = target.max_context  # the longest context a reply may reach

    def _new_cache(self):
        return self.target.new_cache()

    # -- cache bookkeeping -------------------------------------------------------------------

    def reset(self) -> None:
        """Drop all cached state (a new conversation)."""
        self._rewind(0)

    def forget(self) -> None:
        """A new conversation that may not draw on earlier ones (see `Proposer.forget`)."""
        self.reset()
        if self.proposer is not None:
            self.proposer.forget()

    def set_proposer(self, proposer: Proposer | None) -> None:
        self.proposer = proposer
        self._rewind(len(self.context_ids))  # the new proposer has seen nothing of the context yet

    @torch.inference_mode()
    def _rewind(self, length: int) -> int:
        """Shrink the committed context to at most `length` tokens; return the new length."""
        length = min(length, len(self.context_ids))
        if self.proposer is not None:
            length = min(length, self.proposer.rewind(length))
        self.cache.trim(min(length, self.cache.length))
        del self.context_ids[length:]
        return length

    def _keep_cached_prefix(self, prompt_ids: list[int]) -> int:
        """Rewind to the longest prefix the cache shares with `prompt_ids`; return its length. At
        least one prompt token is left to run through the target, for the next-token logits."""
        shared = 0
        for cached, new in zip(self.context_ids, prompt_ids):
            if cached != new:
                break
            shared += 1
        return self._rewind(min(shared, len(prompt_ids) - 1))

    def _sync(self) -> None:
        synchronize(self.target.device)

    # -- the layers ----------------------------------------------------------------------------

    def generate(
        self, prompt_ids: list[int], settings: GenerationSettings, rng: torch.Generator | None = None
    ) -> Iterator[StepResult]:
        """Stream the steps of one reply to `prompt_ids` (the whole conversation so far).

        Raises:
            ContextLengthError: the prompt leaves no room for a reply in the model's context.
        """
        if not prompt_ids:
            raise ValueError("empty prompt")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds {self.max_context}"
            )
        budget = min(settings.max_new_tokens, room)
        try:
            step = self.prefill(prompt_ids, settings, rng)
            produced = 0
            while True:
                produced += self._finish(step, settings, budget - produced)
                yield step
                if step.finish_reason:
                    return
                root = step.tokens[-1]
                if self.proposer is None:
                    step = self.decode_step(root, settings, rng)
                else:
                    room = min(budget - produced, self.max_context - len(self.context_ids) - 1)
                    step = self.speculative_step(root, settings, rng, room)
        finally:
            # A consumer that stops early (Ctrl-C) or an error mid-step must not leave half-updated caches.
            self._rewind(len(self.context_ids))

    @staticmethod
    def _finish(step: StepResult, settings: GenerationSettings, left: int) -> int:
        """Cut a step's tokens at the first end-of-turn token or the budget; return how many remain."""
        for index, token in enumerate(step.tokens[:left]):
            if token in settings.stop_ids:
                del step.tokens[index + 1 :], step.drafted[index + 1 :], step.margins[index + 1 :]
                step.finish_reason = "stop"
                return len(step.tokens)
        if len(step.tokens) >= left:
            del step.tokens[left:], step.drafted[left:], step.margins[left:]
            step.finish_reason = "length"
        return len(step.tokens)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], settings: GenerationSettings, rng) -> StepResult:
        """Process the uncached part of the prompt and draw the first reply token."""
        start = time.perf_counter()
        kept = self._keep_cached_prefix(prompt_ids)
        for chunk_start in range(kept, len(prompt_ids), PREFILL_CHUNK):
            chunk = prompt_ids[chunk_start : chunk_start + PREFILL_CHUNK]
            out = self._prefill_chunk(chunk, last=chunk_start + PREFILL_CHUNK >= len(prompt_ids))
            self.context_ids.extend(chunk)
            if self.proposer is not None:
                self.proposer.observe(chunk, out.features)
        return self._first_token(out, settings, rng, start)

    def _prefill_chunk(self, chunk: list[int], last: bool) -> TargetOutput:
        """One chunk of the prompt through the target, into the cache: its features (for the
        proposer) and, for the `last` chunk, the logits of the token after it."""
        feature_layers = self.proposer.feature_layers if self.proposer else None
        return self.target.forward(torch.tensor([chunk], device=self.target.device), self.cache,
                                   logits_for="last" if last else "none", feature_layers=feature_layers)

    def _first_token(self, out: TargetOutput, settings: GenerationSettings, rng, start: float) -> StepResult:
        """The prefill's step: the reply's first token, drawn from the last chunk's logits."""
        first = self._draw(out.logits[-1], settings.sampling, rng)
        self._sync()
        return StepResult(tokens=[first], drafted=[False], seconds=time.perf_counter() - start, prefill=True,
                          margins=margins(out.logits[-1:]))

    @torch.inference_mode()
    def decode_step(self, root: int, settings: GenerationSettings, rng) -> StepResult:
        """Plain decoding: append `root` to the context and draw the token after it."""
        start = time.perf_counter()
        out = self.target.forward(torch.tensor([[root]], device=self.target.device), self.cache, logits_for="last")
        self._sync()
        forwarded = time.perf_counter()
        self.context_ids.append(root)
        token = self._draw(out.logits[-1], settings.sampling, rng)
        self._sync()
        return StepResult(tokens=[token], drafted=[False], seconds=time.perf_counter() - start,
                          margins=margins(out.logits[-1:]), **_forward_times(out, forwarded - start))

    @torch.inference_mode()
    def speculative_step(self, root: int, settings: GenerationSettings, rng, room: int) -> StepResult:
        """One cycle: draft a tree from `root`, verify it in one target forward, accept, compact.

        `room` is how many tokens this step may still produce; a path of d accepted draft tokens
        yields d + 1 (the bonus), so the tree is at most room - 1 deep.
        """
        start = time.perf_counter()
        cached = len(self.context_ids)
        if room >= 2:
            tree = self.proposer.propose(root, settings, rng, max_depth=room - 1,
                                         max_nodes=self.max_context - cached - 1)
        else:
            tree = DraftTree([], [], [], [])
        self._sync()
        drafted = time.perf_counter()
        ids, positions, mask = verify_inputs(tree, root, cached, self.target.device)
        forward_started = time.perf_counter()
        out = self.target.forward(ids, self.cache, positions=positions, mask=mask, logits_for="all",
                                  feature_layers=self.proposer.feature_layers)
        self._sync()
        verified = time.perf_counter()
        acceptance = accept(tree, out.logits, settings.sampling, rng)
        tree.q = None  # verified: the reply's record of this cycle need not hold [n, vocab] distributions
        # Compact: the root's and the accepted nodes' entries move down next to the committed prefix.
        keep = [0] + [node + 1 for node in acceptance.path]
        self.cache.compact(cached, torch.tensor(keep))
        committed = [root] + [tree.tokens[node] for node in acceptance.path]
        self.context_ids.extend(committed)
        cycle = Cycle(root, tree, acceptance.path, acceptance.bonus, forward_seconds=verified - forward_started)
        self.proposer.observe(committed, None if out.features is None else out.features[keep], cycle)
        self._sync()
        return StepResult(
            tokens=committed[1:] + [acceptance.bonus], drafted=[True] * len(acceptance.path) + [False],
            seconds=time.perf_counter() - start, draft_seconds=drafted - start, verify_seconds=verified - drafted,
            draft_tokens=len(tree), cycle=cycle,
            margins=margins(out.logits[keep]),  # row 0 chose the first token, node i's row the token after it
            **_forward_times(out, verified - forward_started),
        )

    @torch.inference_mode()
    def plain_step_seconds(self, steps: int) -> list[float]:
        """The times of `steps` plain decoding steps at the current context length, on scratch: the
        cache holds what it held before (the speedup estimate's clock)."""
        committed = self.cache.length
        token = torch.tensor([[self.context_ids[-1] if self.context_ids else 0]], device=self.target.device)
        timings = []
        try:
            for _ in range(steps):
                start = time.perf_counter()
                self.target.forward(token, self.cache, logits_for="last")
                self._sync()
                timings.append(time.perf_counter() - start)
        finally:
            self.cache.trim(committed)
        return timings

    @staticmethod
    def _draw(logits: torch.Tensor, sampling: SamplingParams, rng) -> int:
        if sampling.greedy:
            return argmax(logits[None])[0]
        return sample(target_probs(logits, sampling), rng)


def _forward_times(out: TargetOutput, seconds: float) -> dict:
    """A step's target forward timings (`StepResult.forward_seconds` and its parts)."""
    return dict(forward_seconds=seconds, products_seconds=out.products_seconds, attention_seconds=out.attention_seconds)
