"""This user's earlier answers on this machine, kept for lookup to draft from (`--answer-index`).

A user who asks about the same code again, or asks for another version of an answer, gets text the
model has written before: lookup drafts from it (`lookup.EarlierAnswers`) as it does from the chat's
own history. The answers are kept in the cache folder, one store per tokenizer (token ids mean
nothing under another), bounded to ANSWER_TOKENS with the oldest answers going first, and written
by `chat` and by `run` when asked; `bench` reads them only when asked and never writes. An answer
is never drafted from while its own prompt is being answered (`EarlierAnswers.leave_out`).

A store is two files: `tokens.bin` (the answers' token ids, 4 bytes each) and `answers.jsonl` (per
answer: its prompt's key, where its tokens start, how many, when), appended under a lock so that
two chats at once keep them in step.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from pathlib import Path

from filelock import FileLock

from specchat.decode import ANSWER_TOKENS, EarlierAnswers, cache_dir, prompt_key

# A tokenizer's fingerprint: its size and its ids for text of several kinds (two tokenizers that
# agree on all of it share their store, and then their ids mean the same things).
PROBE = "def f(x):\n    return x ** 2  # Größe, 東京, naïve café; \"quotes\" & <tags>\t1234567890"


def tokenizer_key(tokenizer) -> str:
    ids = [len(tokenizer), *tokenizer.encode(PROBE)]
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:16]


class AnswerStore:
    """The earlier answers under one tokenizer (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.tokens_path, self.records_path = folder / "tokens.bin", folder / "answers.jsonl"
        self.indexes: dict[int, EarlierAnswers] = {}  # by n-gram length, read once (`index`)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> AnswerStore:
        return cls(cache_dir() / "answers" / tokenizer_key(tokenizer))

    def _lock(self) -> FileLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        return FileLock(self.folder / "store.lock")

    def _read(self) -> list[tuple[dict, list[int]]]:
        """(record, token ids) per answer, oldest first; records past the tokens written are dropped
        (a write cut short)."""
        if not self.records_path.exists():
            return []
        ids = array("I")
        with open(self.tokens_path, "rb") as handle:
            ids.frombytes(handle.read())
        answers = []
        for line in self.records_path.read_text().splitlines():
            record = json.loads(line)
            start, length = record["start"], record["length"]
            if start + length <= len(ids):
                answers.append((record, ids[start : start + length].tolist()))
        return answers

    def load(self) -> list[tuple[str, list[int]]]:
        """(prompt key, token ids) per answer, oldest first."""
        with self._lock():
            return [(record["prompt"], tokens) for record, tokens in self._read()]

    def index(self, ngram: int) -> EarlierAnswers:
        """The answers as lookup reads them, read and indexed at the first call (only where a method
        looks them up), the same snapshot after it (the replies of this chat are in its own history)."""
        if ngram not in self.indexes:
            self.indexes[ngram] = EarlierAnswers(self.load(), ngram)
        return self.indexes[ngram]

    def add(self, prompt: list[int], answer: list[int]) -> None:
        """Keep `answer`, the reply to `prompt` (token ids); past ANSWER_TOKENS the oldest answers go."""
        if not answer:
            return
        with self._lock():
            start = self.tokens_path.stat().st_size // 4 if self.tokens_path.exists() else 0
            with open(self.tokens_path, "ab") as handle:
                handle.write(array("I", answer).tobytes())
            record = {"prompt": prompt_key(prompt), "start": start, "length": len(answer), "time": round(time.time())}
            with open(self.records_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            if start + len(answer) > ANSWER_TOKENS:
                self._prune()

    def _prune(self) -> None:
        """Keep the newest answers that fit in half of ANSWER_TOKENS (so that pruning is rare), rewritten
        whole and swapped in (the lock held)."""
        kept, total = [], 0
        for record, tokens in reversed(self._read()):
            if total + len(tokens) > ANSWER_TOKENS // 2:
                break
            kept.append((record, tokens))
            total += len(tokens)
        ids, lines = array("I"), []
        for record, tokens in reversed(kept):
            lines.append(json.dumps(record | {"start": len(ids)}))
            ids.extend(tokens)
        for path, data in ((self.tokens_path, ids.tobytes()), (self.records_path, "".join(f"{line}\n" for line in lines).encode())):
            temporary = path.with_suffix(".tmp")
            temporary.write_bytes(data)
            os.replace(temporary, path)
