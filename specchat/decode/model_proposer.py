"""SpS: standard speculative sampling with a small draft language model (Leviathan et al. 2023;
Chen et al. 2023).

The draft model shares the target's tokenizer and keeps its own KV cache. Each cycle it drafts
a chain of k tokens: greedily when the target decodes greedily (then verification is plain
argmax matching), otherwise sampled from q, the draft's distribution processed with the same
temperature/top-k/top-p, and verified with min(1, p/q) and the residual norm(max(0, p - q)).
After verification the draft cache keeps whatever of its entries the committed context still
matches (the root and the accepted tokens) and drops the rest.
"""

from __future__ import annotations

import torch

from specchat.decode.engine import GenerationSettings
from specchat.decode.sampling import sample, target_probs
from specchat.decode.tree import DraftTree

DEFAULT_DRAFT_TOKENS = 3  # chain length; see the README's sps measurements on the 1.5B target


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
    feature_layers = None

    def __init__(self, draft, target_vocab_size: int, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        self.draft = draft
        self.vocab_size = target_vocab_size
        self.k = draft_tokens
        self.cache = draft.new_cache()
        self.context_ids: list[int] = []  # committed context, as the engine reported it
        self.cached_ids: list[int] = []  # the tokens whose entries the draft cache holds

    def describe(self) -> str:
        return f"chains of {self.k} tokens from {self.draft.name}"

    def _sync_cache(self) -> None:
        """Keep only the cache entries that still agree with the committed context."""
        shared = 0
        for cached, committed in zip(self.cached_ids, self.context_ids):
            if cached != committed:
                break
            shared += 1
        self.cache.trim(min(shared, self.cache.length))
        del self.cached_ids[shared:]

    def forget(self) -> None:
        pass  # it keeps nothing beyond the context

    def rewind(self, length: int) -> int:
        del self.context_ids[length:]
        self._sync_cache()
        return len(self.context_ids)

    def observe(self, tokens: list[int], features, cycle=None) -> None:
        self.context_ids.extend(tokens)
        self._sync_cache()

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.draft.device)
        logits = self.draft.forward(ids, self.cache, logits_for="last").logits[-1].float()
        self.cached_ids.extend(tokens)
        if len(logits) < self.vocab_size:  # padding rows of a smaller embedding table: never drafted
            logits = torch.cat([logits, logits.new_full((self.vocab_size - len(logits),), float("-inf"))])
        return logits[: self.vocab_size]

    @torch.inference_mode()
    def propose(self, root: int, settings: GenerationSettings, rng, max_depth: int, max_nodes: int) -> DraftTree:
        sampling = settings.sampling
        steps = min(self.k, max_depth, max_nodes)
        feed = self.context_ids[len(self.cached_ids):] + [root]
        tokens, probs, qs = [], [], []
        for _ in range(steps):
            logits = self._logits(feed)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = target_probs(logits, sampling)
                token = sample(q, rng)
                qs.append(q)
            tokens.append(token)
            probs.append(float(torch.softmax(logits, -1)[token]))
            feed = [token]
        tree = DraftTree.chain(tokens, probs)
        tree.q = torch.stack(qs) if qs else None
        return tree

