"""Prompt files for `specchat run` and `specchat bench`.

Accepted inputs:
- `.txt`: one prompt per line (blank lines are skipped);
- `.jsonl`, one object per line, in any of these shapes:
  - Spec-Bench / MT-bench `{"question_id", "category", "turns": [user messages...]}` (multi-turn:
    each turn is answered in the same conversation);
  - `{"prompt": "...", "id"?, "category"?, "system"?}`;
  - `{"messages": [{"role", "content"}...], "id"?, "category"?}` (a conversation ending in a user message);
- `-`: standard input, read as JSONL when its first non-blank line starts with `{`, else as text.

Everything is parsed before the first prompt is answered, so a broken line stops the run before
it starts, with the file and line in the message.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from specchat.errors import UsageError


class InputError(UsageError, ValueError):
    """A prompt file cannot be used; the message names the file and line."""


@dataclass
class PromptRecord:
    """One conversation to run: zero or more given messages, then user turns to answer in order."""

    id: object
    category: str | None
    turns: list[str]
    history: list[dict] = field(default_factory=list)  # earlier messages given as-is (not generated)
    system: str | None = None
    where: str = ""  # "file:line", for messages


def _nonempty(text, where: str, what: str) -> str:
    if not isinstance(text, str):
        raise InputError(f"{where}: {what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InputError(f"{where}: empty prompt")
    return text


def _from_object(obj, where: str, line_no: int) -> PromptRecord:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    category = obj.get("category")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: 'turns' must be a non-empty list of strings")
        return PromptRecord(
            id=obj.get("question_id", obj.get("id", line_no)), category=category,
            turns=[_nonempty(t, where, "each turn") for t in turns], system=obj.get("system"), where=where,
        )
    if "prompt" in obj:
        return PromptRecord(
            id=obj.get("id", line_no), category=category, turns=[_nonempty(obj["prompt"], where, "'prompt'")],
            system=obj.get("system"), where=where,
        )
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: 'messages' must be a non-empty list")
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
                raise InputError(f"{where}: each message needs a role of system, user or assistant")
            if not isinstance(message.get("content"), str):
                raise InputError(f"{where}: each message needs a string 'content'")
        if messages[-1]["role"] != "user":
            raise InputError(f"{where}: the last message must be the user's (it is what gets answered)")
        system = None
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        history = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        return PromptRecord(
            id=obj.get("id", line_no), category=category, turns=[_nonempty(messages[-1]["content"], where, "the last message")],
            history=history, system=system, where=where,
        )
    raise InputError(f"{where}: a JSON line needs 'turns', 'prompt' or 'messages'")


def parse_jsonl(text: str, name: str) -> list[PromptRecord]:
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: broken JSON ({error.msg} at column {error.colno})") from error
        records.append(_from_object(obj, where, line_no))
    return records


def parse_text(text: str, name: str) -> list[PromptRecord]:
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():  # blank lines separate nothing and are skipped
            records.append(PromptRecord(id=line_no, category=None, turns=[line], where=f"{name}:{line_no}"))
    return records


def read_prompts(paths: list[str]) -> list[PromptRecord]:
    """Parse every input (a path or "-") into prompt records, in order."""
    records = []
    for path in paths:
        if path == "-":
            text, name = sys.stdin.read(), "<stdin>"
            first = next((line for line in text.splitlines() if line.strip()), "")
            kind = "jsonl" if first.lstrip().startswith("{") else "txt"
        else:
            name = path
            kind = path.rsplit(".", 1)[-1].lower() if "." in path else ""
            if kind not in ("txt", "jsonl"):
                raise InputError(f"{path}: unsupported input (use a .txt or .jsonl file, or - for stdin)")
            try:
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
            except OSError as error:
                raise InputError(f"{path}: {error.strerror}") from error
            except UnicodeDecodeError as error:
                raise InputError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
        parsed = parse_jsonl(text, name) if kind == "jsonl" else parse_text(text, name)
        if not parsed:
            raise InputError(f"{name}: empty prompt (no prompts in the input)")
        records.extend(parsed)
    return records
