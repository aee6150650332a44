"""`pld`, prompt lookup decoding (Saxena 2023), on either layout: a chain of the tokens that followed
the latest match of the newest n-gram (`lookup.LookupSource`), or no draft at all (a plain step).

The lookup runs on the host, which knows every committed token after a cycle's read. On the
growing layout the chain is the tree, cut where a verify-cost curve is known (a CPU) to the length
worth verifying at the acceptance rate lookup tokens have had in this chat: on two AVX2 cores a
verified token costs a fifth of a forward, and full chains of 4-10 tokens accepted at 13% made
pld 0.77x plain decoding. On the fixed layout it reaches the draft step as host inputs
and is padded to a bucket: verifying a few padding rows costs a GPU next to nothing, a chain's
every length would cost a graph each.

`LookupProposer` finds and cuts the chain; its layout's subclass, `GrowingPromptLookup` or
`FixedPromptLookup` (`for_target` picks), sizes the cycle and gives the chain its form.
"""

from __future__ import annotations

import torch

from specchat.decode.drafting.lookup import (DEFAULT_LOOKUP_TOKENS, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, EarlierAnswers,
                                              LookupSource)
from specchat.decode.drafting.pace import Arm
from specchat.decode.drafting.selection import Candidates
from specchat.decode.drafting.tree import DraftTree, Source
from specchat.decode.drafting.trust import LookupRates
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.runtime.envelope import HostInputs
from specchat.decode.runtime.target import Target


class LookupProposer:
    """`pld`: the chain's lookup and cut, on the layout its subclass gives the chain its form on."""

    feature_layers = None
    reach = 0
    described = ""

    def __init__(self, target: Target, draft_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_ngram: int = DEFAULT_MIN_NGRAM, curve: Curve | None = None, earlier: EarlierAnswers | None = None):
        """`target`: the target it drafts for (the fixed layout's subclass reads its envelope and device);
        `curve`: this machine's verify-cost curve (the growing layout on a CPU): chains are cut to the
        length worth verifying; `earlier`: this user's earlier answers, searched too."""
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.k = draft_tokens
        self.source = LookupSource(max_ngram, min_ngram, earlier)
        self.chain: list[int] = []  # this cycle's
        self.evidence: list[int] = []  # its tokens' evidence (tokens of agreeing context: `LookupRates.along`)
        self.curve, self.rates = curve, LookupRates()

    def describe(self) -> str:
        return (f"chains of up to {self.k} tokens that followed the latest {self.source.context.min_ngram}-"
                f"{self.source.context.max_ngram}-gram match" + self.described
                + (", cut to the length worth verifying here" if self.curve is not None else ""))

    def rewind(self, length: int) -> int:
        return self.source.rewind(length)

    def forget(self) -> None:
        self.source.forget()

    def predict(self, tokens: list[int]) -> None:
        self.source.predict(tokens)

    def observe(self, tokens: list[int], features) -> None:
        self.source.prompted(tokens)

    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        found = self.source.matches(root, min(self.k, max_depth, max_nodes))
        self.chain, self.evidence = (found[0].tokens, self.rates.along(found[0])[1]) if found else ([], [])
        if self.chain and self.curve is not None:  # the hybrid's rate rule on the chain alone, its first token kept
            chain = Candidates([], [], [], [], [])  # (so that the acceptance rate keeps learning)
            chain.add_chain(self.chain, *self.rates.along(found[0]))
            self.chain = self.chain[: len(chain.offer_for_rate(self.curve, 0.0, len(self.chain), kept=[0]).chosen)]
        return self.budget() if self.chain else 0

    def draft(self, root, length, span, sampling, rng) -> DraftTree:
        """The chain (lookup needs neither the sampling settings nor the random stream: it is deterministic)."""
        return self.chain_tree()

    def commit(self, tree, acceptance, root, features) -> None:
        pass

    def committed(self, tokens: list[int], cycle) -> None:
        cycle.arm = Arm.LOOKUP
        self.source.observe(tokens)
        if self.curve is not None:
            self.rates.learn(cycle)

    # What a layout's subclass keeps: the nodes a cycle with a chain verifies (`budget`) and the
    # chain's form (`chain_tree`).


class GrowingPromptLookup(LookupProposer):
    """The chain on the growing layout: host lists, verified at its own length."""

    def budget(self) -> int:
        return len(self.chain)

    def chain_tree(self) -> DraftTree:
        tree = DraftTree.chain(self.chain, source=Source.LOOKUP)
        tree.evidence = self.evidence[: len(self.chain)]
        return tree


class FixedPromptLookup(LookupProposer):
    """The chain on the fixed layout: host inputs of the draft step, padded to a bucket."""

    described = " (fixed-shape steps)"

    def __init__(self, target: Target, draft_tokens: int = DEFAULT_LOOKUP_TOKENS, **options):
        super().__init__(target, draft_tokens, **options)
        self.envelope = target.envelope
        self.width = 0  # chain positions the draft step fills (its bucket, or k)
        self.inputs = HostInputs(target.device, count=(), tokens=draft_tokens)

    def budget(self) -> int:
        self.inputs.write(count=len(self.chain), tokens=self.chain)
        nodes = self.envelope.rows_for(len(self.chain) + 1) - 1
        self.width = min(nodes, self.k)
        return nodes

    def chain_tree(self) -> DraftTree:
        tokens = self.inputs.tokens[: self.width]
        return DraftTree.device_chain(tokens, torch.arange(self.width, device=tokens.device) < self.inputs.count,
                                      source=Source.LOOKUP)


def for_target(target: Target, **options) -> LookupProposer:
    """`pld` on `target`'s layout (`options`: draft_tokens, max_ngram, min_ngram, curve, earlier)."""
    return (GrowingPromptLookup if target.envelope is None else FixedPromptLookup)(target, **options)
