"""SpS: standard speculative sampling with a small draft language model (Leviathan et al. 2023;
Chen et al. 2023), on either layout.

The draft model shares the target's tokenizer and keeps its own KV cache. Each cycle it drafts
a chain of k tokens: greedily when the target decodes greedily (then verification is plain
argmax matching), otherwise sampled from q, the draft's distribution processed with the same
temperature/top-k/top-p, and verified with min(1, p/q) and the residual norm(max(0, p - q)).

How the draft's cache follows the context is the layout's:

- growing (`GrowingDraftCache`): after verification the cache keeps whatever of its entries the
  committed context still matches and drops the rest; a cycle feeds what it lacks and the root.
- fixed (`FixedDraftCache`): the cache follows the target's positions. A cycle at context length L
  first feeds the token at L - 1 (the last one committed: the previous chain's last token when the
  whole chain was accepted, else already cached and recomputed to the same entry) with the root at
  L, then each drafted token; whatever the target accepts, every entry before the next cycle's
  L - 1 is then right, and the rest is overwritten. The k + 1 forwards are captured together.
"""

from __future__ import annotations

import torch

from specchat.decode.acceptance.sampling import sample_rows, target_probs
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.engine.envelope import Envelope, Window, device_chain, pick
from specchat.decode.target import Target

DEFAULT_DRAFT_TOKENS = 3  # chain length; see the README's sps measurements on the 1.5B target
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
    """`sps` for `target`, on its layout: chains of k tokens from the small model `draft`."""

    feature_layers = None

    def __init__(self, draft: Target, target: Target, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.model, self.vocab_size, self.k = draft, target.vocab_size, draft_tokens
        self.cache = GrowingDraftCache(draft) if target.envelope is None else FixedDraftCache(draft, target.envelope,
                                                                                               draft_tokens)
        self.reach = self.cache.reach
        self.steps = draft_tokens  # this cycle's

    def describe(self) -> str:
        return f"chains of {self.k} tokens from {self.model.name}" + self.cache.described

    def rewind(self, length: int) -> int:
        return self.cache.rewind(length)

    def forget(self) -> None:
        pass  # it keeps nothing beyond the context

    def observe(self, tokens: list[int], features) -> None:
        self.cache.extend(tokens)

    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        self.steps, nodes = self.cache.prepare(min(self.k, max_depth, max_nodes))
        return nodes

    @torch.inference_mode()
    def draft(self, root, length, span: int | None, sampling, rng) -> DraftTree:
        ids, tokens, probs, qs = self.cache.first_ids(root), [], [], []
        for step in range(self.steps):
            logits = self._vocabulary(self.cache.logits(ids, step, length, span).float())
            if sampling.greedy:  # `draw_rows`, with q computed once where it is kept
                token = logits.argmax(-1)
            else:
                q_row = target_probs(logits, sampling)
                token = sample_rows(q_row, rng)
                qs.append(q_row[0])
            probs.append(torch.softmax(logits, -1)[0].gather(0, token))
            tokens.append(token)
            ids = token
        return self.cache.chain(torch.cat(tokens), torch.cat(probs), torch.stack(qs) if qs else None)

    def _vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [1, V] over the target's vocabulary (a smaller embedding table's padding rows: never drafted)."""
        if logits.shape[-1] < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((1, self.vocab_size - logits.shape[-1]), float("-inf"))], -1)
        return logits[:, : self.vocab_size]

    def commit(self, tree: DraftTree, acceptance, root, features) -> None:
        self.cache.commit(tree, acceptance, root)

    def committed(self, tokens: list[int], cycle) -> None:
        self.cache.extend(tokens, cycle=True)


class GrowingDraftCache:
    """The draft's growing cache, holding the entries of `cached_ids`, kept where the context agrees."""

    reach = 0
    described = ""

    def __init__(self, draft: Target):
        self.model, self.cache = draft, draft.new_cache()
        self.context_ids: list[int] = []  # committed context, as the engine reported it
        self.cached_ids: list[int] = []  # the tokens whose entries the draft cache holds
        self.fed: list[int] = []  # what this cycle's first forward feeds

    def _sync(self) -> None:
        """Keep only the cache entries that still agree with the committed context."""
        shared = 0
        for cached, committed in zip(self.cached_ids, self.context_ids):
            if cached != committed:
                break
            shared += 1
        self.cache.trim(min(shared, self.cache.length))
        del self.cached_ids[shared:]

    def rewind(self, length: int) -> int:
        del self.context_ids[length:]
        self._sync()
        return len(self.context_ids)

    def extend(self, tokens: list[int], cycle: bool = False) -> None:
        self.context_ids.extend(tokens)
        self._sync()

    def prepare(self, steps: int) -> tuple[int, int]:
        """(steps drafted, nodes verified): the room's."""
        return steps, steps

    def first_ids(self, root: int) -> torch.Tensor:
        self.fed = self.context_ids[len(self.cached_ids):] + [root]
        return torch.tensor([self.fed], device=self.model.device)

    def logits(self, ids: torch.Tensor, step: int, length, span) -> torch.Tensor:
        """The logits after `ids` ([1, n] first, then the token drawn, [1])."""
        return self.model.forward(ids if step == 0 else ids[None], self.cache, logits_for="last").logits

    def chain(self, tokens: torch.Tensor, probs: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
        tree = DraftTree.chain(tokens.tolist(), probs.tolist())
        self.cached_ids.extend(self.fed + tree.tokens[:-1])  # the last drafted token was not fed
        tree.q = q
        return tree

    def commit(self, tree: DraftTree, acceptance, root: int) -> None:
        pass


class FixedDraftCache:
    """The draft's cache at the envelope's capacity, following the target's positions (module docstring)."""

    described = " (fixed-shape steps)"

    def __init__(self, draft: Target, envelope: Envelope, draft_tokens: int):
        self.model, self.envelope, self.k = draft, envelope, draft_tokens
        self.reach = draft_tokens + 1
        self.cache = draft.new_cache(capacity=envelope.capacity)
        self.context: list[int] = []  # the committed tokens (to feed the draft after a prompt)
        self.fed = 0  # positions whose draft entries are right
        self.prompted = False  # whether the prompt went through the draft since the last prefill
        self.last = torch.zeros(1, dtype=torch.long, device=draft.device)  # the token at L - 1

    def rewind(self, length: int) -> int:
        del self.context[length:]
        self.fed = min(self.fed, length)
        return length

    def extend(self, tokens: list[int], cycle: bool = False) -> None:
        self.context.extend(tokens)
        if cycle:
            self.fed = len(self.context) - 1  # the entries before the newest committed token are right
        self.prompted = cycle

    def prepare(self, steps: int) -> tuple[int, int]:
        """(steps drafted, nodes verified): always k, in a bucket. After a prefill, the prompt goes
        through the draft model first (eagerly, in chunks padded to a bucket)."""
        if not self.prompted:
            while self.fed < len(self.context):
                chunk = self.context[self.fed : self.fed + PROMPT_CHUNK]
                window = Window.prompt(self.envelope, self.fed, len(chunk), self.last.device)
                window.forward(self.model, torch.tensor(chunk, device=self.last.device), self.cache, logits_for="none")
                self.fed += len(chunk)
            self.last.fill_(self.context[-1])
            self.prompted = True
        return self.k, self.envelope.rows_for(self.k + 1) - 1

    def first_ids(self, root: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.last, root])

    def logits(self, ids: torch.Tensor, step: int, length: torch.Tensor, span: int) -> torch.Tensor:
        rows = 2 if step == 0 else 1  # the first step also recomputes the token at L - 1
        window = Window.causal(length - 1 if step == 0 else length + step, rows, span)
        return window.forward(self.model, ids, self.cache, logits_for=rows - 1).logits

    def chain(self, tokens: torch.Tensor, probs: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
        return device_chain(tokens, torch.ones(self.k, dtype=torch.bool, device=tokens.device), probs, q)

    def commit(self, tree: DraftTree, acceptance, root: torch.Tensor) -> None:
        last_accepted = pick(tree.tokens, (acceptance.count - 1).clamp(min=0))
        self.last.copy_(torch.where(acceptance.count > 0, last_accepted, root[0])[None])
