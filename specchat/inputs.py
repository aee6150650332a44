"""Prompt files for `specchat run` and `specchat bench`.

Accepted inputs:
- `.txt`: one prompt per line (blank lines are skipped);
- `.jsonl`, one object per line, in any of these shapes:
  - Spec-Bench / MT-bench `{"question_id", "category", "turns": [user messages...]}` (multi-turn:
    each turn is answered in the same conversation);
  - `{"prompt": "...", "id"?, "category"?, "system"?}`;
  - `{"messages": [{"role", "content"}...], "id"?, "category"?}` (a conversation ending in a user message);
- `-`: standard input, read as JSONL when its first non-blank line starts with `{`, else as text.

Files are UTF-8 (a leading byte-order mark is skipped) and lines end at "\\n" (or "\\r\\n") only:
U+2028 and friends are text inside a prompt or a JSON string, not line breaks. Everything is
parsed and checked before the first prompt is answered, so a broken line stops the run before it
starts, with the file and line in the message.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from specchat.errors import UsageError

BYTE_ORDER_MARK = "\ufeff"


class InputError(UsageError, ValueError):
    """A prompt file cannot be used; the message names the file and line."""


@dataclass
class PromptRecord:
    """One conversation to run: zero or more given messages, then user turns to answer in order."""

    id: str | int | float
    category: str | None
    turns: list[str]
    history: list[dict] = field(default_factory=list)  # earlier messages given as-is (not generated)
    system: str | None = None
    where: str = ""  # "file:line", for messages


def _text(value, where: str, what: str, optional: bool = False) -> str | None:
    """A string field, checked: the right type, and encodable (JSON can carry lone surrogates; text cannot)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InputError(f"{where}: {what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(f"{where}: {what} holds {value[error.start:error.end]!r}, a lone surrogate, which is not text") \
            from error
    return value


def _prompt(value, where: str, what: str) -> str:
    text = _text(value, where, what)
    if not text.strip():
        raise InputError(f"{where}: empty prompt")
    return text


def _record_id(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InputError(f"{where}: an id must be a string or a number, got {type(value).__name__}")
    return _text(value, where, "the id") if isinstance(value, str) else value


def _from_object(obj, where: str, line_no: int) -> PromptRecord:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    category = _text(obj.get("category"), where, "'category'", optional=True)
    system = _text(obj.get("system"), where, "'system'", optional=True)
    record_id = _record_id(obj.get("question_id", obj.get("id", line_no)), where)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: 'turns' must be a non-empty list of strings")
        return PromptRecord(record_id, category, [_prompt(t, where, "each turn") for t in turns], system=system,
                            where=where)
    if "prompt" in obj:
        return PromptRecord(record_id, category, [_prompt(obj["prompt"], where, "'prompt'")], system=system,
                            where=where)
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: 'messages' must be a non-empty list")
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
                raise InputError(f"{where}: each message needs a role of system, user or assistant")
            _text(message.get("content"), where, "each message's 'content'")
        if messages[-1]["role"] != "user":
            raise InputError(f"{where}: the last message must be the user's (it is what gets answered)")
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        history = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        return PromptRecord(record_id, category, [_prompt(messages[-1]["content"], where, "the last message")],
                            history=history, system=system, where=where)
    raise InputError(f"{where}: a JSON line needs 'turns', 'prompt' or 'messages'")


def _lines(text: str) -> list[str]:
    """The lines of a file: split at "\\n" only, a trailing "\\r" dropped."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_jsonl(text: str, name: str) -> list[PromptRecord]:
    records = []
    for line_no, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            obj = json.loads(line, parse_constant=_not_json_constant)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: broken JSON ({error.msg} at column {error.colno})") from error
        except (ValueError, RecursionError) as error:
            raise InputError(f"{where}: broken JSON ({error})") from error
        records.append(_from_object(obj, where, line_no))
    return records


def parse_text(text: str, name: str) -> list[PromptRecord]:
    records = []
    for line_no, line in enumerate(_lines(text), start=1):
        if line.strip():  # blank lines separate nothing and are skipped
            where = f"{name}:{line_no}"
            records.append(PromptRecord(id=line_no, category=None, turns=[_text(line, where, "the line")], where=where))
    return records


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8").removeprefix(BYTE_ORDER_MARK)
    except UnicodeDecodeError as error:
        raise InputError(f"{name}: not UTF-8 text ({error.reason} at byte {error.start})") from error


def read_stdin() -> str:
    """All of standard input as text (UTF-8, strictly), or an InputError that says what is wrong."""
    if sys.stdin is None or sys.stdin.closed:
        raise InputError("<stdin>: standard input is closed (give a prompt file, or pipe prompts in)")
    raw = getattr(sys.stdin, "buffer", None)  # the bytes, to decode strictly (a StringIO in tests has none)
    try:
        return _decode(raw.read(), "<stdin>") if raw is not None else sys.stdin.read().removeprefix(BYTE_ORDER_MARK)
    except OSError as error:
        raise InputError(f"<stdin>: cannot read ({error.strerror})") from error


def read_prompts(paths: list[str]) -> list[PromptRecord]:
    """Parse every input (a path or "-") into prompt records, in order."""
    records = []
    for path in paths:
        if path == "-":
            text, name = read_stdin(), "<stdin>"
            first = next((line for line in _lines(text) if line.strip()), "")
            kind = "jsonl" if first.lstrip().startswith("{") else "txt"
        else:
            name = path
            kind = path.rsplit(".", 1)[-1].lower() if "." in path else ""
            if kind not in ("txt", "jsonl"):
                raise InputError(f"{path}: unsupported input (use a .txt or .jsonl file, or - for stdin)")
            try:
                with open(path, "rb") as handle:
                    text = _decode(handle.read(), path)
            except OSError as error:
                raise InputError(f"{path}: {error.strerror}") from error
        parsed = parse_jsonl(text, name) if kind == "jsonl" else parse_text(text, name)
        if not parsed:
            raise InputError(f"{name}: empty prompt (no prompts in the input)")
        records.extend(parsed)
    return records


def check_outputs(outputs: dict[str, str | None], inputs: list[str]) -> None:
    """Refuse, before anything runs, output files that would lose data or cannot be written:
    two outputs on one file, an output that is one of the inputs, a missing folder, a closed stdout.

    `outputs` maps an option (for the message) to its path, "-" for standard output, or None.
    """
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        if path == "-":
            if sys.stdout is None or sys.stdout.closed:
                raise InputError(f"{option}: standard output is closed (give {option} FILE)")
            continue
        resolved = os.path.realpath(path)
        if resolved in seen:
            raise InputError(f"{option} {path} is also {seen[resolved]}: give each output its own file")
        seen[resolved] = option
        for source in inputs:
            if source != "-" and os.path.realpath(source) == resolved:
                raise InputError(f"{option} {path} is also an input: writing it would destroy the prompts")
        folder = os.path.dirname(resolved)
        if not os.path.isdir(folder):
            raise InputError(f"{option} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (os.path.exists(resolved) and not os.access(resolved, os.W_OK)):
            raise InputError(f"{option} {path}: not writable")
