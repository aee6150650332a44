"""Finding drafts in text already seen: the lookup behind prompt lookup (PLD, Saxena 2023:
`prompt_lookup`) and the lookup source of hybrid trees (`heads`).

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked up, and the tokens that
followed an earlier occurrence are proposed. Two places are searched, in this order:

- the conversation the engine holds (prompt and reply so far), latest occurrence first;
- the chat's history: everything the conversation held before it was cut back (an earlier
  conversation after /clear, an answer regenerated, earlier records of a `run`), so text the
  user asks to edit or repeat is found even when it left the context.

Both are indexes from n-gram to the positions where it ends, updated as tokens are committed, so a
lookup costs a few dictionary accesses whatever the chat's length (measured: docs/cpu-runtime.md).
The match's length (how many tokens before the root agree with the earlier occurrence, up to
MAX_EVIDENCE) says how much to trust it. Lookup is deterministic, so verification is the exact
point-mass rule. Nothing here imports torch: settings read the defaults before it loads.
"""

from __future__ import annotations

from dataclasses import dataclass


# transformers' prompt lookup defaults (prompt_lookup_num_tokens=10 tokens proposed,
# max_matching_ngram_size=2), with trigrams first: longer keys find fewer, better matches.
DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1
MAX_EVIDENCE = 16  # how far back a match is measured
HISTORY_LIMIT = 1 << 20  # tokens of history kept (the oldest go first)


@dataclass(frozen=True)
class Match:
    """A continuation found in earlier text."""

    tokens: list[int]
    evidence: int  # tokens before it that agree with the current context (the root included)


class NgramIndex:
    """Token ids and, for each n-gram, the positions where it ends (oldest first)."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: list[int] = ()) -> None:
        """Hold exactly `tokens`."""
        self.tokens, self.ends = [], {}
        self.extend(list(tokens))

    def extend(self, tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        for end in range(start, len(self.tokens)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    self.ends.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)

    def truncate(self, length: int) -> list[int]:
        """Keep the first `length` tokens; returns the ones dropped."""
        dropped = self.tokens[length:]
        if dropped:
            self.reset(self.tokens[:length])
        return dropped

    def matches(self, tail: list[int], limit: int, count: int) -> list[Match]:
        """Up to `count` continuations (each of at most `limit` tokens, distinct first tokens) of the
        longest n-gram ending `tail`, latest occurrence first."""
        found: list[Match] = []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tail) < n:
                continue
            for end in reversed(self.ends.get(tuple(tail[-n:]), ())):
                follow = self.tokens[end + 1 : end + 1 + limit]
                if not follow or any(m.tokens[0] == follow[0] for m in found):
                    continue
                found.append(Match(follow, self._evidence(tail, end)))
                if len(found) == count:
                    return found
            if found:
                return found
        return found

    def _evidence(self, tail: list[int], end: int) -> int:
        length = 0
        while (length < MAX_EVIDENCE and length < len(tail) and end - length >= 0
               and self.tokens[end - length] == tail[-1 - length]):
            length += 1
        return length


class LookupSource:
    """The conversation the engine holds and the chat's history, kept in step with the engine
    (`observe`, `rewind`), asked for continuations of the newest tokens (`matches`)."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.context = NgramIndex(max_ngram, min_ngram)
        self.history = NgramIndex(max_ngram, min_ngram)

    @property
    def context_ids(self) -> list[int]:
        return self.context.tokens

    def observe(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def rewind(self, length: int) -> int:
        dropped = self.context.truncate(length)
        if dropped:  # what leaves the conversation stays findable
            self.history.extend(dropped)
            if len(self.history.tokens) > HISTORY_LIMIT:  # the older half goes
                self.history.reset(self.history.tokens[-(HISTORY_LIMIT // 2):])
        return len(self.context.tokens)

    def forget(self) -> None:
        self.context.reset()
        self.history.reset()

    def matches(self, root: int, limit: int, count: int = 1) -> list[Match]:
        tail = self.context.tokens[-(MAX_EVIDENCE - 1):] + [root]  # the root's own n-gram is not indexed yet
        found = self.context.matches(tail, limit, count)
        if len(found) < count:
            seen = {m.tokens[0] for m in found}
            found += [m for m in self.history.matches(tail, limit, count) if m.tokens[0] not in seen][: count - len(found)]
        return found

