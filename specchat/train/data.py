"""Training conversations: reading every accepted file shape, and turning them into token ids
with a loss mask over the assistant's tokens.

Accepted shapes (JSON arrays, or JSONL with one record per line):
- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`. A JSON
  array cut off mid-record (like the PyPI ShareGPT file) is decoded record by record and the
  incomplete tail is reported, not fatal.
- Chat: `{"messages": [{"role", "content"}, ...]}`.
- Alpaca: `{"instruction", "input"?, "output" | "response"}`, and `{"question", "answer"}`.
- Prompt-only (answered by the target with `--regenerate`, turn by turn): Spec-Bench `{"turns": [...]}`,
  `{"prompt": ...}` (also an OpenAssistant tree's root `{"prompt": {"text": ...}}`), a bare
  JSON string, or ShareGPT/chat records without assistant messages. Self-instruct records
  (`{"instruction", "instances": [{"input", "output"}]}`) use their first instance.

Malformed records are skipped and counted by reason (the report names the first few), so one bad
record in a 100k-record file does not stop a long run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from specchat.errors import UsageError
from specchat.inputs import file_lines
from specchat.train.datafolder import DataFolder

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


@dataclass
class TrainingConversation:
    messages: list[dict]  # {"role": system|user|assistant, "content": str}
    source: str  # "file#record", for reports

    @property
    def has_responses(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


@dataclass
class ReadReport:
    read: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    examples: list[str] = field(default_factory=list)  # "where: reason", the first few
    truncated: list[str] = field(default_factory=list)  # files whose last record was cut off

    def skip(self, where: str, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")

    def summary(self) -> str:
        parts = [f"{self.read} conversations"]
        if self.skipped:
            parts.append("skipped " + ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common()))
        for name in self.truncated:
            parts.append(f"{name} ends mid-record (the incomplete record was dropped)")
        return "; ".join(parts)


class DataError(UsageError, ValueError):
    """A training file cannot be read at all (not JSON, unknown shape)."""


def _records(path: Path, report: ReadReport):
    """Yield (where, record) from a JSON array (possibly truncated) or a JSONL file."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        decoder = json.JSONDecoder()
        index, count = text.index("[") + 1, 0
        while True:
            while index < len(text) and text[index] in " \t\r\n,":
                index += 1
            if index >= len(text):
                report.truncated.append(path.name)
                return
            if text[index] == "]":
                return
            try:
                record, index = decoder.raw_decode(text, index)
            except json.JSONDecodeError:
                report.truncated.append(path.name)  # a cut-off file: everything before is usable
                return
            count += 1
            yield f"{path.name}#{count}", record
    else:
        for line_no, line in enumerate(file_lines(text), start=1):
            if not line.strip():
                continue
            try:
                yield f"{path.name}:{line_no}", json.loads(line)
            except json.JSONDecodeError:
                report.skip(f"{path.name}:{line_no}", "broken JSON")


def _text(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def parse_record(record) -> list[dict] | str:
    """The messages of one record, or a reason why it is unusable."""
    if isinstance(record, str):
        return [{"role": "user", "content": record}] if record.strip() else "empty prompt"
    if not isinstance(record, dict):
        return "not an object"
    if "conversations" in record:
        messages = []
        for turn in record["conversations"] or []:
            if isinstance(turn, str):  # LIMA-style list of alternating strings
                messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": turn})
                continue
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or _text(turn.get("value")) is None:
                return "malformed turn"
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
        return messages or "no turns"
    if "messages" in record:
        messages = []
        for message in record["messages"] or []:
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") \
                    or _text(message.get("content")) is None:
                return "malformed message"
            messages.append({"role": message["role"], "content": message["content"]})
        return messages or "no messages"
    if "instruction" in record:
        instruction = _text(record.get("instruction"))
        if instruction is None:
            return "empty instruction"
        if isinstance(record.get("instances"), list) and record["instances"]:  # self-instruct
            record = {**record, **record["instances"][0]} if isinstance(record["instances"][0], dict) else record
        extra = _text(record.get("input"))
        prompt = instruction + ("\n\n" + extra if extra else "")
        response = _text(record.get("output", record.get("response")))
        return [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": response}] if response else [])
    if "question" in record and "answer" in record:
        if _text(record["question"]) is None or _text(record["answer"]) is None:
            return "empty question or answer"
        return [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": record["answer"]}]
    if "turns" in record:  # Spec-Bench / MT-bench: the user turns of a conversation, no answers
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or any(_text(turn) is None for turn in turns):
            return "empty turns"
        return [{"role": "user", "content": turn} for turn in turns]
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, dict):  # an OpenAssistant message tree: its root message
            prompt = prompt.get("text")
        return [{"role": "user", "content": prompt}] if _text(prompt) else "empty prompt"
    return "unknown shape"


def _without_unprompted_answers(messages: list[dict]) -> list[dict]:
    """Drop assistant messages before the first user message: ShareGPT has records that open with
    the model's greeting, which answers no prompt and which no chat template renders on its own."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def read_conversations(paths: list[str]) -> tuple[list[TrainingConversation], ReadReport]:
    report = ReadReport()
    conversations = []
    for name in paths:
        path = Path(name)
        if DataFolder.holds(path):  # answers the target wrote (`specchat data regenerate`)
            for messages, where in DataFolder(path).conversations():
                conversations.append(TrainingConversation(messages, where))
                report.read += 1
            continue
        if not path.is_file():
            raise DataError(f"{name}: no such file (or data folder)")
        for where, record in _records(path, report):
            parsed = parse_record(record)
            if isinstance(parsed, str):
                report.skip(where, parsed)
                continue
            if not any(m["role"] == "user" for m in parsed):
                report.skip(where, "no user message")
                continue
            parsed = _without_unprompted_answers(parsed)
            conversations.append(TrainingConversation(parsed, where))
            report.read += 1
    return conversations, report


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """The token ids of `messages` through the chat template (`generation_prompt`: asking for the
    assistant's next answer)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False))


def encode(messages: list[dict], tokenizer, max_tokens: int) -> tuple[list[int], list[int]] | None:
    """Token ids through the chat template, and a 0/1 mask that is 1 on assistant tokens.

    Each assistant turn is located by rendering the conversation up to it with and without the
    turn; templates for which that is not a prefix (rare) are skipped (None).
    """
    ids = render(tokenizer, messages, False)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(tokenizer, messages[:index], True), render(tokenizer, messages[: index + 1], False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            return None
        for position in range(len(before), len(through)):
            mask[position] = 1
    if not any(mask[:max_tokens]):
        return None
    return ids[:max_tokens], mask[:max_tokens]


# Conversations per worker of `encode_all`: fewer go through one process (a worker takes seconds to start).
ENCODE_CHUNK = 1024


def encode_all(conversations: list[list[dict]], tokenizer, max_tokens: int) -> list[tuple[list[int], list[int]] | None]:
    """`encode` of every conversation, on all the machine's cores when there are many: the chat template
    renders a conversation once per assistant turn (~3 ms a render: 60k conversations take a core
    five minutes). Workers are spawned, not forked: the parent may hold CUDA and tokenizer threads."""
    workers = min(os.cpu_count() or 1, len(conversations) // ENCODE_CHUNK)
    if workers <= 1:
        return [encode(messages, tokenizer, max_tokens) for messages in conversations]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_encoder,
                             initargs=(tokenizer, max_tokens)) as pool:
        return list(pool.map(_encode, conversations, chunksize=64))


_worker: dict = {}


def _encoder(tokenizer, max_tokens: int) -> None:
    _worker.update(tokenizer=tokenizer, max_tokens=max_tokens)


def _encode(messages: list[dict]):
    return encode(messages, _worker["tokenizer"], _worker["max_tokens"])
