"""The generation engine: token ids in, token ids out, on either cache layout. It knows nothing of text or terminals.

Three thin layers, bottom up:

1. `Engine.decode_step` (plain decoding) and `Engine.speculative_step` (one draft → verify →
   accept → compact cycle) each produce a `StepResult`.
2. `Engine.generate` streams the `StepResult`s of one reply: prefill, then steps, until an
   end-of-turn token, the token budget or the context limit.
3. `specchat.chat.ChatSession` adds text, conversations and statistics; the UI consumes only that.

The engine owns the list of token ids the target's KV cache holds (`context_ids`) and changes it
only through explicit rewinds and what each step commits. How the cache is laid out, how large a
step's tensors are and when the host reads them is the layout's, chosen by how the target was
loaded (`Target.envelope`):

- `GrowingLayout` (`growing.py`): exact sizes; the cache grows by each step's rows and is cut back
  by trimming and compaction. What CPUs run.
- `FixedLayout` (`fixed.py`): the cache at a fixed capacity, rows padded to buckets, each step
  captured as a CUDA graph, one host read per cycle. What CUDA runs.

The proposer drafts on the same layout (the `Proposer` protocol below). A new reply reuses the
longest cached prefix of its prompt, so multi-turn chat does not recompute the conversation, and a
reply that was interrupted (Ctrl-C) leaves nothing half-done behind: the `finally` in `generate`
trims every cache back to the committed tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specchat.decode.acceptance.sampling import SamplingParams
from specchat.decode.drafting.tree import Cycle, DraftTree
from specchat.decode.engine.fixed import FixedLayout
from specchat.decode.engine.growing import GrowingLayout
from specchat.decode.options import MAX_NEW_TOKENS
from specchat.decode.runtime.target import ForwardTimes, Target
from specchat.errors import ContextLengthError

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
        seconds: wall time of the step (capturing CUDA graphs left out).
        target_forwards: target forward passes spent (one per step; the prefill counts as one).
        draft_seconds / verify_seconds: the drafting and the verification part of `seconds`.
        draft_tokens: draft tokens the target verified in this step (the tree size).
        forward: the step's target forward (plain or verifying), of `seconds`, with the target
            `profiling` its products' and attention's parts; timed on the growing layout only (the
            fixed one times its steps as a whole: `verify_seconds`).
        finish_reason: "stop" (end-of-turn token), "length" (token budget or context full), or
            None while the reply goes on.
        prefill: True for the first step of a reply (prompt processing plus the first token).
        cycle: the draft tree and what was accepted (`specchat.decode.drafting.tree.Cycle`), for traces and /tree.
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
    forward: ForwardTimes = ForwardTimes()
    finish_reason: str | None = None
    prefill: bool = False
    cycle: Cycle | None = None
    margins: list[float] = field(default_factory=list)


class Proposer(Protocol):
    """A source of draft trees (a draft head, a small draft model, n-gram lookup), on the layout of the
    target it drafts for: its trees' arrays are lists on the growing layout, device tensors on the fixed one.

    A cycle calls `prepare` (on the host), `draft` (the draft step), `commit` (in the verify step, with
    what the target accepted) and `committed` (on the host, after the cycle). On the fixed layout
    `draft` and `commit` run inside captured steps: they may not read the host, nor depend on Python
    values that change between cycles.
    """

    feature_layers: tuple[int, ...] | None  # hidden-state indices of the target it consumes (`Target.forward`)
    reach: int  # how far past the context its cache entries reach in a draft step (the fixed layout's window)

    def rewind(self, length: int) -> int:
        """Forget context positions >= `length`; return how many leading positions it can still continue
        from (the engine re-runs the target from there, so that it sees their features again)."""

    def observe(self, tokens: list[int], features: torch.Tensor | None) -> None:
        """Prompt tokens a prefill committed, with the target's features at them."""

    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        """How many nodes the tree from `root` (the newest token, not yet in the context) will hold, at most
        `max_depth` deep and `max_nodes` large (on the fixed layout a bucket, whatever the room); 0:
        nothing to verify, a plain step instead, which computes the features the proposer takes."""

    def draft(self, root, length, span: int | None, sampling: SamplingParams, rng) -> DraftTree:
        """The tree from `root` at context `length` (on the fixed layout device tensors, and the step's
        attention window `span`); `rng` is the run's random stream."""

    def commit(self, tree: DraftTree, acceptance, root, features: torch.Tensor | None) -> None:
        """What the target accepted of `tree` (`acceptance.verify`'s record) and its features at the kept
        rows (the root's and the accepted nodes')."""

    def committed(self, tokens: list[int], cycle: Cycle) -> None:
        """The tokens the cycle committed, the root first, and the cycle."""

    def describe(self) -> str:
        """What it drafts, in a few words (for /show)."""

    def forget(self) -> None:
        """Forget the text seen beyond the context (a lookup's history of the chat): what follows is
        unrelated (bench questions, which Spec-Bench answers independently)."""

    def predict(self, tokens: list[int]) -> None:
        """Tokens the next reply is expected to repeat (OpenAI's predicted outputs): a lookup source until
        the next call; proposers that do not look up ignore it."""


class Engine:
    """Generates replies from a target model, optionally speculating with a proposer."""

    def __init__(self, target: Target, proposer: Proposer | None = None):
        self.target = target
        self.proposer = proposer
        self.layout = GrowingLayout(target) if target.envelope is None else FixedLayout(target)
        self.context_ids: list[int] = []  # exactly the tokens whose keys/values the cache holds
        self.max_context = target.max_context  # the longest context a reply may reach

    @property
    def cache(self):
        return self.layout.cache

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

    def keep_cached_prefix(self, prompt_ids: list[int]) -> int:
        """Rewind to the longest prefix the cache shares with `prompt_ids`; return its length. At
        least one prompt token is left to run through the target, for the next-token logits."""
        cached = self.context_ids
        if prompt_ids[: len(cached)] == cached:  # the common case (the conversation, a chain's context grown),
            shared = len(cached)  # compared in C: staged drafting asks every cycle
        else:
            shared = 0
            for old, new in zip(cached, prompt_ids):
                if old != new:
                    break
                shared += 1
        return self._rewind(min(shared, len(prompt_ids) - 1))

    def _seconds(self, start: float, capturing: float) -> float:
        """Wall time since `start`, less what capturing steps took since the layout had spent `capturing`."""
        return time.perf_counter() - start - (self.layout.capture_seconds - capturing)

    # -- the layers ----------------------------------------------------------------------------

    def generate(
        self, prompt_ids: list[int], settings: GenerationSettings, rng: torch.Generator | None = None,
        prediction: list[int] | None = None,
    ) -> Iterator[StepResult]:
        """Stream the steps of one reply to `prompt_ids` (the whole conversation so far).

        `prediction`: tokens the reply is expected to repeat (OpenAI's predicted outputs), which the
        proposer may draft from (`Proposer.predict`); it changes what is drafted, never the reply.

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
        if self.proposer is not None:  # each reply's prediction replaces the previous one; none clears it
            self.proposer.predict(prediction or [])
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
        kept = self.keep_cached_prefix(prompt_ids)
        feature_layers = self.proposer.feature_layers if self.proposer is not None else None
        for chunk_start in range(kept, len(prompt_ids), PREFILL_CHUNK):
            chunk = prompt_ids[chunk_start : chunk_start + PREFILL_CHUNK]
            last = chunk_start + PREFILL_CHUNK >= len(prompt_ids)
            out = self.layout.prefill(chunk, len(self.context_ids), last, feature_layers)
            self.context_ids.extend(chunk)
            if self.proposer is not None:
                self.proposer.observe(chunk, out.features)
        token, margin = self.layout.first_token(out.logits, settings.sampling, rng)
        return StepResult(tokens=[token], drafted=[False], seconds=time.perf_counter() - start, prefill=True,
                          margins=[margin])

    @torch.inference_mode()
    def decode_step(self, root: int, settings: GenerationSettings, rng) -> StepResult:
        """Plain decoding: append `root` to the context and draw the token after it."""
        start, capturing = time.perf_counter(), self.layout.capture_seconds
        token, margin, _, forward = self.layout.plain_step(root, len(self.context_ids), settings.sampling, rng)
        self.context_ids.append(root)
        return StepResult(tokens=[token], drafted=[False], seconds=self._seconds(start, capturing), margins=[margin],
                          forward=forward)

    @torch.inference_mode()
    def speculative_step(self, root: int, settings: GenerationSettings, rng, room: int) -> StepResult:
        """One cycle: draft a tree from `root`, verify it in one target forward, accept, compact.

        `room` is how many tokens this step may still produce; a path of d accepted draft tokens
        yields d + 1 (the bonus), so the tree is at most room - 1 deep.
        """
        start, capturing = time.perf_counter(), self.layout.capture_seconds
        proposer, length = self.proposer, len(self.context_ids)
        nodes = proposer.prepare(root, room - 1, self.max_context - length - 1)
        if nodes == 0:  # nothing to verify: a plain step, which gives the proposer its features
            token, margin, features, forward = self.layout.plain_step(root, length, settings.sampling, rng,
                                                                      proposer.feature_layers)
            self.context_ids.append(root)
            cycle = Cycle(root, DraftTree.chain([]), [], token, forward_seconds=forward.forward_seconds)
            proposer.commit(cycle.tree, None, root, features)
            proposer.committed([root], cycle)
            return StepResult(tokens=[token], drafted=[False], seconds=self._seconds(start, capturing), cycle=cycle,
                              margins=[margin], forward=forward)
        cycle, margins, draft_seconds, verify_seconds, forward = self.layout.cycle(proposer, root, length, nodes, room,
                                                                                   settings.sampling, rng, start)
        committed = [root] + [cycle.tree.tokens[node] for node in cycle.accepted]
        self.context_ids.extend(committed)
        proposer.committed(committed, cycle)
        return StepResult(
            tokens=committed[1:] + [cycle.bonus], drafted=[True] * len(cycle.accepted) + [False],
            seconds=self._seconds(start, capturing), draft_seconds=draft_seconds, verify_seconds=verify_seconds,
            draft_tokens=len(cycle.tree), cycle=cycle, margins=margins, forward=forward,
        )

    @torch.inference_mode()
    def plain_step_seconds(self, steps: int) -> list[float]:
        """The times of `steps` plain decoding steps at the current context length, on scratch: the
        cache holds what it held before (the speedup estimate's clock)."""
        return self.layout.plain_step_seconds(steps, self.context_ids)
