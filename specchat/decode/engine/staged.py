"""`sps` whose draft model drafts by speculating itself: staged speculative decoding (Spector & Ré
2023, arXiv 2308.04623), on the growing layout.

A draft model costs a forward for every token of its chain, which is most of an `sps` cycle on a CPU
(the embedded 0.5B drafting for the 1.5B on two cores: ~16 ms a token against ~43 ms for the 1.5B's
plain step). Where the draft model has a head of its own, it drafts its chain as a target decodes
with one: its head proposes (with lookup), its forward verifies, and each of its forwards yields τ
of its tokens instead of one. The chain is the draft model's greedy continuation as its plain steps
would draw it (its own decoding is lossless), so only what the chain costs changes.

The draft model runs in an `Engine` of its own, with its own cache and head. A chain goes on from
the root with the engine's cycles where the engine holds the whole context but the root (the
target took a prefix of the last chain that the engine's head still holds: its own cache is cut
back to it); otherwise a prefill catches it up on what the target committed since (keeping the
longest prefix its cache shares with the context) and draws the chain's first token. Each cycle is
no deeper than the chain's room, and the chain ends where one more token would not pay
(`DraftModelProposer.enough`, a token's cost its share of the engine's cycle).

The chain is a point mass at any temperature, verified by the point-mass rule
(`acceptance.verify`): a token x is accepted with probability p(x), where a chain sampled from q
is accepted with probability Σ min(p, q), but the draft's greedy chain has a cycle's τ to offer and
the engine's cache needs no second copy for sampled chains. Its probabilities for the rate rule are
the draft model's margins read as a two-way race.
"""

from __future__ import annotations

import math
import time

import torch

from specchat.decode.drafting.draft_model import DraftModelProposer, GrowingDraftModel
from specchat.decode.drafting.pace import Arm
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.engine.engine import Engine, GenerationSettings

GREEDY = GenerationSettings()  # (its sampling: greedy)


def margin_probability(margin: float) -> float:
    """The top token's probability were the top two all there is: an upper bound, which the chain's
    trust (`HeadTrust`) scales down as far as its drafts fall short of it."""
    return 1.0 / (1.0 + math.exp(-min(margin, 50.0)))


class StagedDraftModel(DraftModelProposer):
    """`sps` on the growing layout, its chains drawn by the draft model's own `engine` (its head
    drafting, its forward verifying); see the module docstring."""

    described = ", which drafts them itself with its head (staged)"
    paced = True

    def __init__(self, engine: Engine, target, draft_tokens: int, **options):
        super().__init__(engine.target, target, draft_tokens, **options)
        self.engine = engine

    @torch.inference_mode()
    def observe(self, tokens: list[int], features) -> None:
        """A prompt, through the draft model's engine at once: its time is the reply's first token's,
        not the first chain's (the token the engine draws after it is dropped: the target draws it)."""
        super().observe(tokens, features)
        self.engine.prefill(self.context, GREEDY, None)

    def forget(self) -> None:
        super().forget()
        self.engine.forget()

    def rewind_cache(self) -> None:
        pass  # the engine keeps what it shares with the next chain's context (`Engine.keep_cached_prefix`)

    budget = GrowingDraftModel.budget  # (a chain as long as the room allows, up to k)

    def confirm(self, drafted_at: int, kept: int) -> None:
        pass  # (as `rewind_cache`)

    @torch.inference_mode()
    def draft(self, root, length, span, sampling, rng) -> DraftTree:
        if self.arm is Arm.LOOKUP:
            return super().draft(root, length, span, sampling, rng)
        ids, tokens, probs = self.context + [root], [], []
        if self.engine.keep_cached_prefix(ids) < len(self.context):  # a tail to catch up on: a forward of its own
            step = self.engine.prefill(ids, GREEDY, None)  # (which draws the chain's first token)
            tokens, probs = list(step.tokens), [margin_probability(margin) for margin in step.margins]
        while not tokens or (len(tokens) < self.steps and not self.enough(probs)):
            began = time.perf_counter()
            step = self.engine.speculative_step(tokens[-1] if tokens else root, GREEDY, None, self.steps - len(tokens))
            tokens += step.tokens
            probs += [margin_probability(margin) for margin in step.margins]
            self.timed_step(1000 * (time.perf_counter() - began) / len(step.tokens))  # a token's share of the cycle
        self.drafted = tokens
        chain = DraftTree.chain(tokens, probs)
        return chain if self.curve is None else self.paying(chain)
