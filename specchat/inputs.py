"""Prompt files for `specchat run` and `specchat bench`, and a chat's prediction file (`read_prediction`).

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

Outputs are checked as early (`check_outputs`): none may be an input or another output, whether by
path or through a hard or symbolic link, and each must take writes, probed without truncating it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
import tempfile
from contextlib import contextmanager, suppress
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


def file_lines(text: str) -> list[str]:
    """The lines of a file: split at "\\n" only, a trailing "\\r" dropped. Not str.splitlines(),
    which also splits at U+2028, U+0085 and other separators that JSON writes unescaped inside strings."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_jsonl(text: str, name: str) -> list[PromptRecord]:
    records = []
    for line_no, line in enumerate(file_lines(text), start=1):
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
    for line_no, line in enumerate(file_lines(text), start=1):
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


def read_prediction(path: str) -> str:
    """The text of a prediction file (`chat --predict`, `/predict`: what the answers will mostly
    repeat), UTF-8 strictly, whole; an InputError in one line if it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return _decode(handle.read(), path)
    except OSError as error:
        raise InputError(f"{path}: cannot read the prediction ({error.strerror})") from error


def read_prompts(paths: list[str]) -> list[PromptRecord]:
    """Parse every input (a path or "-") into prompt records, in order."""
    records = []
    for path in paths:
        if path == "-":
            text, name = read_stdin(), "<stdin>"
            first = next((line for line in file_lines(text) if line.strip()), "")
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


# Linux's memory character devices whose writes go nowhere (null 1:3, zero 1:5, full 1:7): the only
# devices a byte is written to, to see whether writes fail (/dev/full says "no space left").
DISCARDING_DEVICES = {(1, 3), (1, 5), (1, 7)}
# click's --atomic temporary files start with this (kept for our own, so one pattern finds both).
ATOMIC_PREFIX = ".__atomic-write"


def _stat(path: str, what: str = "") -> os.stat_result | None:
    """The file `path` names (through symbolic links), None if there is none; `what` names it in an error."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:  # a folder on the way that cannot be searched
        raise InputError(f"{what or path}: cannot check ({error.strerror or error})") from error


def _input_identities(inputs: list[str]) -> list[tuple[str, str, tuple[int, int] | None]]:
    """Each input as (name, resolved path, (device, inode)), standard input included when it is a file."""
    identities = []
    for source in inputs:
        if source != "-":
            status = _stat(os.path.realpath(source)) if os.path.exists(source) else None
            identities.append((source, os.path.realpath(source), (status.st_dev, status.st_ino) if status else None))
            continue
        try:
            status = os.fstat(sys.stdin.fileno())
        except (AttributeError, OSError, ValueError):  # closed, or a StringIO in tests
            continue
        if stat.S_ISREG(status.st_mode):  # `< prompts.jsonl`: the same file must not be written either
            identities.append(("standard input", "", (status.st_dev, status.st_ino)))
    return identities


def _is_input(resolved: str, status: os.stat_result | None, identities) -> str | None:
    """The input that `resolved` is (same path, or the same file through a hard or symbolic link), if any."""
    for name, path, identity in identities:
        if path == resolved or (status is not None and identity == (status.st_dev, status.st_ino)):
            return name
    return None


def probe_writable(what: str, resolved: str, status: os.stat_result | None, atomic: bool = False) -> None:
    """Fail now, with the reason, if `resolved` cannot be written, and change nothing.

    A regular file is opened for appending (never truncated); a new file is created and removed;
    an atomic write needs a temporary file in the folder; /dev/full and its kin get one byte
    (they discard it, or fail as a real write would). Other devices, pipes and sockets are only
    asked (opening a pipe would wait for a reader; a byte on a terminal would show).
    """
    folder = os.path.dirname(resolved) or "."
    try:
        if status is not None and stat.S_ISDIR(status.st_mode):
            raise InputError(f"{what}: is a folder")
        if atomic and (status is None or stat.S_ISREG(status.st_mode)):
            descriptor, temporary = tempfile.mkstemp(prefix=ATOMIC_PREFIX, dir=folder)
            os.close(descriptor)
            os.unlink(temporary)
        elif status is None:
            os.close(os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(resolved)
        elif stat.S_ISREG(status.st_mode):
            os.close(os.open(resolved, os.O_WRONLY | os.O_APPEND))
        elif stat.S_ISCHR(status.st_mode) and (os.major(status.st_rdev), os.minor(status.st_rdev)) \
                in DISCARDING_DEVICES:
            descriptor = os.open(resolved, os.O_WRONLY)
            try:
                os.write(descriptor, b"\n")  # unbuffered: /dev/full fails here (ENOSPC)
            finally:
                os.close(descriptor)
        elif not os.access(resolved, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as error:
        raise InputError(f"{what}: not writable ({error.strerror or error})") from error


def check_outputs(outputs: dict[str, str | None], inputs: list[str], atomic: tuple[str, ...] = ()) -> None:
    """Refuse, before anything runs, output files that would lose data or cannot be written:
    two outputs on one file, an output that is one of the inputs (by path, or the same file through
    a hard or symbolic link), a missing folder, a closed stdout, a file or device that refuses writes.

    `outputs` maps an option (for the message) to its path, "-" for standard output, or None;
    `atomic` names the options written through a temporary file in the same folder.
    Nothing is changed: an existing output is probed without being truncated.
    """
    identities = _input_identities(inputs)
    seen: list[tuple[str, str, tuple[int, int] | None]] = []
    for option, path in outputs.items():
        if path is None:
            continue
        if path == "-":
            if sys.stdout is None or sys.stdout.closed:
                raise InputError(f"{option}: standard output is closed (give {option} FILE)")
            continue
        resolved = os.path.realpath(path)
        status = _stat(resolved, f"{option} {path}")
        other = _is_input(resolved, status, seen)
        if other:
            raise InputError(f"{option} {path} is also {other}: give each output its own file")
        seen.append((option, resolved, (status.st_dev, status.st_ino) if status else None))
        source = _is_input(resolved, status, identities)
        if source:
            also = {path: "an input", "standard input": "standard input"}.get(source, f"the input {source}")
            raise InputError(f"{option} {path} is also {also}: writing it would destroy the prompts")
        folder = os.path.dirname(resolved)
        if not os.path.isdir(folder):
            raise InputError(f"{option} {path}: the folder {folder} does not exist")
        probe_writable(f"{option} {path}", resolved, status, atomic=option in atomic)


def check_output_folder(option: str, folder: str, inputs: list[str], names: tuple[str, ...]) -> None:
    """Like `check_outputs`, for a folder the files `names` are written into (created if need be):
    it must be a folder that takes new files, and none of the files may be an input or refuse writes."""
    resolved = os.path.realpath(folder)
    status = _stat(resolved, f"{option} {folder}")
    if status is not None and not stat.S_ISDIR(status.st_mode):
        raise InputError(f"{option} {folder}: not a folder")
    existing = resolved
    while not os.path.isdir(existing):  # the folder is created with its parents: the nearest one that exists
        if os.path.lexists(existing):
            raise InputError(f"{option} {folder}: {existing} is not a folder")
        existing = os.path.dirname(existing)
    probe_writable(f"{option} {folder}", os.path.join(existing, "results"), None, atomic=True)
    identities = _input_identities(inputs)
    for name in names:
        path = os.path.realpath(os.path.join(resolved, name))
        status = _stat(path, f"{option} {folder}: {name}")
        source = _is_input(path, status, identities)
        if source:
            raise InputError(f"{option} {folder}: {name} there is also the input {source}: writing it would "
                             "destroy the prompts")
        if status is not None:
            probe_writable(f"{option} {folder}: {name}", path, status)


@contextmanager
def atomic_output(path: str):
    """A text file that replaces `path` only if the block ends without an error: the records go to a
    temporary file in the same folder, renamed over `path` at the end. On an error, Ctrl-C or
    SIGTERM the temporary file is removed and `path` stays as it was. (click's atomic files rename
    even then.) A symbolic link is written through; a device or a pipe is written directly."""
    resolved = os.path.realpath(path)
    status = _stat(resolved)
    if status is not None and not stat.S_ISREG(status.st_mode):  # /dev/null: never renamed over
        with open(resolved, "w", encoding="utf-8") as handle:
            yield handle
        return
    descriptor, temporary = tempfile.mkstemp(prefix=ATOMIC_PREFIX, dir=os.path.dirname(resolved))
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, stat.S_IMODE(status.st_mode) if status else 0o666 & ~_umask())
        os.replace(temporary, resolved)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """A file's sha256, read in blocks of 16 MiB (`hashlib.file_digest` needs Python 3.11; 3.10 is supported)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """`text` as the whole of `path`, written as `atomic_output` writes (the old file or the new, never part)."""
    with atomic_output(str(path)) as handle:
        handle.write(text)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
