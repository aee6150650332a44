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

`DraftModelProposer` is the chain's algorithm; what differs by layout, the draft's cache and the
tree's form, is its subclass's, `GrowingDraftModel` or `FixedDraftModel` (`for_target` picks).
"""

from __future__ import annotations

import torch

from specchat.decode.acceptance.sampling import sample_rows, target_probs
from specchat.decode.drafting.pace import Arm
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.options import DRAFT_MODEL_TOKENS
from specchat.decode.runtime.envelope import HostInputs, Window
from specchat.decode.runtime.target import Target

PROMPT_CHUNK = 512  # prompt tokens the fixed layout feeds the draft at once (eagerly, padded to a bucket)


class TokenizerMismatch(ValueError):
    """The draft model does not share the target's tokenizer."""


def check_tokenizers(target, draft) -> None:
    ours, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if ours != theirs:
        differing = sum(1 for token, index in theirs.items() if ours.get(token) != index) + len(set(ours) - set(theirs))
        raise TokenizerMismatch(
            f"the draft model's tokenizer ({len(theirs)} tokens) is not the target's ({len(ours)} tokens; "
            f"{differing} entries differ): speculative sampling needs the same vocabulary")


class DraftModelProposer:
    """`sps`: chains of k tokens from the small model `draft`, on the layout its subclass keeps the
    draft's cache on."""

    feature_layers = None
    reach = 0
    described = ""

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.model, self.vocab_size, self.k = draft, target.vocab_size, draft_tokens
        self.context: list[int] = []  # the committed tokens, as the engine reported them
        self.fed = 0  # leading positions whose draft entries are right
        self.steps = draft_tokens  # this cycle's chain length

    def describe(self) -> str:
        return f"chains of {self.k} tokens from {self.model.name}" + self.described

    def rewind(self, length: int) -> int:
        del self.context[length:]
        self.fed = min(self.fed, length)
        self.rewind_cache()
        return len(self.context)

    def forget(self) -> None:
        pass  # it keeps nothing beyond the context

    def predict(self, tokens: list[int]) -> None:
        pass  # it drafts from its own model of the context, not from text it is shown

    def observe(self, tokens: list[int], features) -> None:
        self.context.extend(tokens)

    @torch.inference_mode()
    def draft(self, root, length, span: int | None, sampling, rng) -> DraftTree:
        ids = self.first_ids(root)
        tokens, probs, qs = [], [], []
        for step in range(self.steps):
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
        return self.chain(torch.cat(tokens), torch.cat(probs), torch.stack(qs) if qs else None)

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [1, V] over the target's vocabulary (a smaller embedding table's padding
        rows: never drafted)."""
        if logits.shape[-1] < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((1, self.vocab_size - logits.shape[-1]), float("-inf"))], -1)
        return logits[:, : self.vocab_size]

    def commit(self, tree: DraftTree, acceptance, root, features) -> None:
        pass

    def committed(self, tokens: list[int], cycle) -> None:
        cycle.arm = Arm.MODEL
        drafted_at = len(self.context)
        self.context.extend(tokens)
        self.confirm(drafted_at, len(tokens))

    # What a layout's subclass keeps: the draft's cache (`rewind_cache`; `confirm`: the entries a
    # cycle's committed tokens make right), the cycle's budget (`prepare`), the first step's ids
    # (`first_ids`), each step's logits (`logits`) and the chain's form (`chain`).


class GrowingDraftModel(DraftModelProposer):
    """The draft on the growing layout: a cache that grows and is trimmed to the entries known right,
    a cycle as long as the room allows, its chain host lists."""

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS):
        super().__init__(draft, target, draft_tokens)
        self.cache = draft.new_cache(capacity=None)

    def rewind_cache(self) -> None:
        self.cache.trim(min(self.fed, self.cache.length))

    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
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
        tree = DraftTree.chain(tokens.tolist(), probs.tolist())
        tree.q = q
        return tree

    def confirm(self, drafted_at: int, count: int) -> None:
        """The root's and the accepted drafts' entries the cycle fed stay (not the last draft's: the
        chain never fed it; none after a plain step)."""
        self.fed = min(drafted_at + min(count, self.steps), self.cache.length)
        self.cache.trim(self.fed)


class FixedDraftModel(DraftModelProposer):
    """The draft on the fixed layout: a fixed-capacity cache whose stale entries are overwritten, one
    step shape every cycle (k + 1 forwards captured together), its chain device tensors."""

    described = " (fixed-shape steps)"

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


def for_target(draft: Target, target: Target, draft_tokens: int = DRAFT_MODEL_TOKENS) -> DraftModelProposer:
    """`sps` with `draft` on `target`'s layout."""
    return (GrowingDraftModel if target.envelope is None else FixedDraftModel)(draft, target, draft_tokens)
