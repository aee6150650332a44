"""PLD: prompt lookup decoding (Saxena 2023), drafting with no model at all.

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked up among the earlier
context — prompt and reply so far — and the tokens that followed their latest earlier occurrence
are proposed as a chain. Lookup is deterministic, so verification is the exact point-mass rule.
An index from n-gram to the positions where it ends is kept up to date as tokens are committed,
so a lookup costs a dictionary access rather than a scan of the context.
"""

from __future__ import annotations

from specchat.tree import DraftTree

# transformers' prompt lookup defaults (prompt_lookup_num_tokens=10 tokens proposed,
# max_matching_ngram_size=2); a CPU verifies 16 tokens for about the price of one, so 10 is cheap.
DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


class PromptLookupProposer:
    feature_layers = None

    def __init__(self, draft_tokens: int = DEFAULT_LOOKUP_TOKENS, max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram or draft_tokens < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and draft_tokens >= 1")
        self.k, self.max_ngram, self.min_ngram = draft_tokens, max_ngram, min_ngram
        self.context_ids: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token

    def _index_from(self, start: int) -> None:
        for end in range(start, len(self.context_ids)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    self.ends.setdefault(tuple(self.context_ids[end - n + 1 : end + 1]), []).append(end)

    def describe(self) -> str:
        return f"chains of up to {self.k} tokens that followed the latest {self.min_ngram}-{self.max_ngram}-gram match"

    def rewind(self, length: int) -> int:
        if length < len(self.context_ids):
            del self.context_ids[length:]
            self.ends = {}
            self._index_from(0)
        return len(self.context_ids)

    def observe(self, tokens: list[int], features) -> None:
        start = len(self.context_ids)
        self.context_ids.extend(tokens)
        self._index_from(start)

    def propose(self, root: int, settings, rng, max_depth: int, max_nodes: int) -> DraftTree:
        """A chain (lookup needs neither the sampling settings nor the random stream: it is deterministic)."""
        sequence = self.context_ids + [root]
        limit = min(self.k, max_depth, max_nodes)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(sequence) <= n:
                continue
            positions = self.ends.get(tuple(sequence[-n:]))
            if positions:  # the latest occurrence (the root's own n-gram is not indexed yet)
                follow = sequence[positions[-1] + 1 : positions[-1] + 1 + limit]
                if follow:
                    return _chain(follow)
        return _chain([])


def _chain(tokens: list[int]) -> DraftTree:
    return DraftTree(tokens=tokens, parents=list(range(-1, len(tokens) - 1)), depths=list(range(1, len(tokens) + 1)),
                     probs=[1.0] * len(tokens))
