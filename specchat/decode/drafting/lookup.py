"""Finding drafts in text already seen: the lookup behind prompt lookup (PLD, Saxena 2023:
`prompt_lookup`) and the lookup source of hybrid trees (`heads`).

The newest n tokens (n from `max_ngram` down to `min_ngram`) are looked up where they occurred
before, in these places:

- the conversation the engine holds (prompt and reply so far);
- the reply's prediction, where the client gave one (OpenAI's "predicted outputs": the text the
  answer will mostly repeat, such as the file being edited), held until the next reply;
- the chat's history: everything the conversation held before it was cut back (an earlier
  conversation after /clear, an answer regenerated, earlier records of a `run`), so text the
  user asks to edit or repeat is found even when it left the context; and, where the session
  gives one, this user's earlier answers on this machine (`specchat.answers`).

Each is an index from n-gram to the positions where it ends, updated as tokens are committed, so a
lookup costs a few dictionary accesses whatever the chat's length (measured: docs/cpu-runtime.md).
An occurrence's evidence is its match's length: how many tokens before the root agree with it, up
to MAX_EVIDENCE. Occurrences are ranked by evidence (then by place, in the order above, then the
latest): the longest match says most about what follows (replayed on the bench's rewrite answers,
longest-first lookup accepted 3% more tokens a cycle than latest-first). A prediction's tokens are
drafted and trusted like any other lookup continuation's (`selection.LookupRates` learns what they
earn): a wrong prediction costs verified tokens, never a changed answer.

As in SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975), the continuations of the best
occurrences form a tree: where they agree, a path; where they part, branches, each with the share
of the occurrences that took it (its frequency), which the acceptance estimate weighs
(`selection.LookupRates`). Replayed on the same answers, the four best paths of such a tree
accepted 5% more tokens a cycle than the best chain alone; the verify-cost rate rule decides how
much of it a cycle verifies. Lookup is deterministic, so verification is the exact point-mass rule.
Nothing here imports torch: settings read the defaults before it loads.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass


# transformers' prompt lookup defaults (prompt_lookup_num_tokens=10 tokens proposed,
# max_matching_ngram_size=2), with trigrams first: longer keys find fewer, better matches.
DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1
MAX_EVIDENCE = 16  # how far back a match is measured
DEFAULT_LOOKUP_PATHS = 4  # the tree's paths a hybrid cycle weighs on the growing layout (the rate rule takes what pays)
OCCURRENCES = 16  # the most occurrences (the latest of the n-gram, in each index) weighed per lookup
GRAM_BITS = 21  # bits a token id takes in an earlier answers' n-gram number (vocabularies up to 2M ids)
HISTORY_LIMIT = 1 << 20  # tokens of history kept (the oldest go first)
ANSWER_TOKENS = 100_000  # tokens of earlier answers kept on this machine (`specchat.answers`; the oldest go first):
# some 400 answers, indexed in milliseconds at each start (`EarlierAnswers._sort`)


@dataclass(frozen=True)
class Match:
    """A continuation found in earlier text."""

    tokens: list[int]
    evidence: int  # tokens before it that agree with the current context (the root included)
    shares: tuple[float, ...] = ()  # per token, the share of the weighed occurrences reaching its parent
    # that went on with it (SuffixDecoding's frequency); empty: all of them (a single continuation)


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

    def occurrences(self, tail: list[int]) -> list[tuple[int, int]]:
        """(evidence, end) of the latest OCCURRENCES occurrences of the longest n-gram ending `tail`
        that some continuation follows, latest first."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            ends = self._ends(tuple(tail[-n:])) if len(tail) >= n else None
            if ends:
                last = len(self.tokens) - 1  # an occurrence at the very end has nothing after it yet
                return [(self._evidence(tail, end), end) for end in reversed(ends[-OCCURRENCES - 1:]) if end < last][:OCCURRENCES]
        return []

    def _ends(self, gram: tuple[int, ...]) -> list[int] | None:
        """Where `gram` ends, oldest first (at least the latest OCCURRENCES + 1 of them), or None."""
        return self.ends.get(gram)

    def follow(self, end: int, limit: int) -> list[int]:
        """The (up to `limit`) tokens after position `end`."""
        return self.tokens[end + 1 : end + 1 + limit]

    def _evidence(self, tail: list[int], end: int) -> int:
        length = 0
        while (length < MAX_EVIDENCE and length < len(tail) and end - length >= 0
               and self.tokens[end - length] == tail[-1 - length]):
            length += 1
        return length


def prompt_key(prompt: list[int]) -> str:
    """A prompt's identity (its token ids'), by which an answer to it is kept and left out (`EarlierAnswers`)."""
    return hashlib.sha256(array("q", prompt).tobytes()).hexdigest()[:16]


class EarlierAnswers(NgramIndex):
    """This user's earlier answers on this machine (`specchat.answers` keeps them), searched like the
    chat's history, with three differences: only the longest n-grams are indexed (a third of the
    work at each start; a shorter match in another chat says little), a
    continuation stops at its answer's end, and the answers to the prompt being answered are left
    out (`leave_out`): a reply drafted from an answer it has already seen is not a speedup."""

    def __init__(self, answers: list[tuple[str, list[int]]], ngram: int):
        """`answers`: (prompt key, token ids), oldest first."""
        super().__init__(ngram, ngram)
        self.prompts = [prompt for prompt, _ in answers]
        self.starts: list[int] = []
        for _, tokens in answers:
            self.starts.append(len(self.tokens))
            self.tokens.extend(tokens)
        self.keys: list[int] | None = None  # the n-grams as numbers, sorted, where they fit in one (`_sort`)
        self.positions: list[int] = []  # where each of them ends
        if ngram * GRAM_BITS < 64 and max(self.tokens, default=0) < 1 << GRAM_BITS:
            self._sort()
        else:  # wider than a number: the dictionary, as the other indexes
            tokens, self.tokens = self.tokens, []
            self.extend(tokens)
        self.left_out: set[int] = set()

    def _sort(self) -> None:
        """Every n-gram as one number (its ids' bits side by side), sorted, with where it ends: for a
        full store built in ~0.02 s where the dictionary took 0.13-0.17 s of every start (a Xeon core),
        and searched by two bisections a lookup."""
        import numpy as np  # (here, not at the top: the command line reads this module's defaults before numpy loads)

        n = self.max_ngram
        ids = np.asarray(self.tokens, dtype=np.int64)
        count = max(len(ids) - n + 1, 0)
        keys = np.zeros(count, dtype=np.int64)
        for i in range(n):  # the oldest token in the highest bits
            keys |= ids[i : i + count] << (GRAM_BITS * (n - 1 - i))
        order = np.argsort(keys, kind="stable")  # stable: each n-gram's ends stay oldest first
        self.keys, self.positions = keys[order].tolist(), (order + (n - 1)).tolist()

    def _ends(self, gram: tuple[int, ...]) -> list[int] | None:
        if self.keys is None:
            return super()._ends(gram)
        key = 0
        for token in gram:
            if token >> GRAM_BITS:  # no stored n-gram holds it
                return None
            key = key << GRAM_BITS | token
        first, last = bisect_left(self.keys, key), bisect_right(self.keys, key)
        return self.positions[max(first, last - OCCURRENCES - 1) : last] or None

    def leave_out(self, prompt: str) -> None:
        """Leave out the answers to `prompt` (a `prompt_key`) until the next prompt."""
        self.left_out = {i for i, key in enumerate(self.prompts) if key == prompt}

    def _answer(self, position: int) -> int:
        return bisect_right(self.starts, position) - 1

    def occurrences(self, tail: list[int]) -> list[tuple[int, int]]:
        found = super().occurrences(tail)
        return [(evidence, end) for evidence, end in found if self._answer(end) not in self.left_out] if self.left_out else found

    def follow(self, end: int, limit: int) -> list[int]:
        answer = self._answer(end)
        stop = self.starts[answer + 1] if answer + 1 < len(self.starts) else len(self.tokens)
        return self.tokens[end + 1 : min(end + 1 + limit, stop)]


class LookupSource:
    """The conversation the engine holds and the chat's history, kept in step with the engine
    (`observe`, `rewind`), asked for continuations of the newest tokens (`matches`); and, if given,
    the reply's prediction (`predict`) and this user's earlier answers (`EarlierAnswers`)."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM,
                 earlier: EarlierAnswers | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.context = NgramIndex(max_ngram, min_ngram)
        self.history = NgramIndex(max_ngram, min_ngram)
        self.prediction = NgramIndex(max_ngram, min_ngram)
        self.earlier = earlier

    @property
    def context_ids(self) -> list[int]:
        return self.context.tokens

    def observe(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def prompted(self, tokens: list[int]) -> None:
        """A prompt's `tokens` join the context, and a reply to it follows: the earlier answers to the
        prompt are left out."""
        self.observe(tokens)
        if self.earlier is not None:
            self.earlier.leave_out(prompt_key(self.context.tokens))

    def rewind(self, length: int) -> int:
        dropped = self.context.truncate(length)
        if dropped:  # what leaves the conversation stays findable
            self.history.extend(dropped)
            if len(self.history.tokens) > HISTORY_LIMIT:  # the older half goes
                self.history.reset(self.history.tokens[-(HISTORY_LIMIT // 2):])
        return len(self.context.tokens)

    def predict(self, tokens: list[int]) -> None:
        """Tokens the next reply is expected to repeat (OpenAI's predicted outputs), in place of the
        previous prediction (none: no prediction). Searched after the conversation, which is the
        reply's own text, and before the history, which a prediction given for this reply outranks."""
        self.prediction.reset(tokens)

    def forget(self) -> None:
        self.context.reset()
        self.history.reset()
        self.prediction.reset()

    def matches(self, root: int, limit: int, count: int = 1, tree: bool = False) -> list[Match]:
        """Up to `count` continuations (each of at most `limit` tokens) of the newest tokens and `root`,
        the strongest first: with `tree`, the paths of the best occurrences' continuation tree, with
        their shares; else distinct first tokens, one occurrence each (the fixed layout's chains)."""
        if limit < 1:
            return []
        tail = self.context.tokens[-(MAX_EVIDENCE - 1):] + [root]  # the root's own n-gram is not indexed yet
        indexes = (self.context, *([self.prediction] if self.prediction.tokens else ()), self.history,
                   *([self.earlier] if self.earlier is not None else ()))
        found = [(evidence, -rank, end, index) for rank, index in enumerate(indexes)
                 for evidence, end in index.occurrences(tail)]
        found.sort(key=lambda occurrence: occurrence[:3], reverse=True)  # evidence, the place (in that order), latest
        if not tree:
            matches: list[Match] = []
            for evidence, _, end, index in found:
                follow = index.follow(end, limit)
                if all(match.tokens[0] != follow[0] for match in matches):
                    matches.append(Match(follow, evidence))
                    if len(matches) == count:
                        break
            return matches
        # The tree is weighed over the occurrences of comparable strength: half the best match's or more.
        weighed = [occurrence for occurrence in found if 2 * occurrence[0] >= found[0][0]]
        return paths([index.follow(end, limit) for _, _, end, index in weighed], [evidence for evidence, *_ in weighed], count)


def paths(follows: list[list[int]], evidences: list[int], count: int) -> list[Match]:
    """Up to `count` paths of the tree that the continuations `follows` (the strongest first, their
    matches' `evidences`) make, each with its tokens' shares, in the order of the first continuation
    to reach each new leaf; a continuation that adds no node to the paths already taken adds no path."""
    trie: dict = {}  # token -> [occurrences that went on with it, its children]
    for follow in follows:
        level = trie
        for token in follow:
            node = level.setdefault(token, [0, {}])
            node[0] += 1
            level = node[1]
    found: list[Match] = []
    taken: set[tuple[int, ...]] = set()
    for follow, evidence in zip(follows, evidences):
        if tuple(follow) in taken:
            continue
        shares, level = [], trie
        for token in follow:
            went_on = sum(node[0] for node in level.values())
            shares.append(level[token][0] / went_on)
            level = level[token][1]
        taken.update(tuple(follow[:j]) for j in range(1, len(follow) + 1))
        found.append(Match(follow, evidence, tuple(shares)))
        if len(found) == count:
            break
    return found
