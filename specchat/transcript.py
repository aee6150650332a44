"""Chat transcripts: the conversation and the settings it ran with, as one JSON file.

The shape follows what chat tools already write (`{"settings", "messages"}`), so a transcript is
readable by people and by scripts. Files are written to a temporary sibling and renamed into
place, so an interrupted save (Ctrl-C, SIGTERM, a full disk) never leaves half a transcript or a
temporary file behind. A symbolic link is saved through (the link stays); a device, a pipe or a
folder is refused rather than replaced by a file.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from specchat.errors import SpecchatError
from specchat.inputs import write_atomically

FORMAT = "specchat-transcript"
VERSION = 1
ROLES = ("user", "assistant")


class TranscriptError(SpecchatError, ValueError):
    """A transcript cannot be read or written; the message names the file."""


def save_transcript(path: str | Path, messages: list[dict], settings: dict, profile: str | None = None) -> Path:
    """Write a transcript atomically; returns the path written."""
    path = Path(path).expanduser()
    target = Path(os.path.realpath(path))  # through a symbolic link, so that the link stays a link
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise TranscriptError(f"{path}: cannot write ({error.strerror or error})") from error
    if mode is not None and not stat.S_ISREG(mode):  # renaming over /dev/null would replace the device
        raise TranscriptError(f"{path}: cannot write (not a regular file)")
    document = {
        "format": FORMAT, "version": VERSION, "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "profile": profile, "settings": settings, "messages": messages,
    }
    try:
        write_atomically(target, json.dumps(document, ensure_ascii=False, indent=1) + "\n")
    except OSError as error:
        raise TranscriptError(f"{path}: cannot write ({error.strerror or error})") from error
    return path


def load_transcript(path: str | Path) -> dict:
    """Read and check a transcript; returns the document (messages are checked, settings are not)."""
    path = Path(path).expanduser()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise TranscriptError(f"{path}: cannot read ({error.strerror or error})") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TranscriptError(f"{path}: not a JSON file ({error})") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise TranscriptError(f"{path}: not a specchat transcript (no \"format\": \"{FORMAT}\")")
    if document.get("version") != VERSION:
        raise TranscriptError(f"{path}: transcript version {document.get('version')!r}; this specchat reads {VERSION}")
    messages = document.get("messages")
    if not isinstance(messages, list):
        raise TranscriptError(f"{path}: \"messages\" must be a list")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise TranscriptError(f"{path}: message {index} must be {{\"role\": user|assistant, \"content\": text}}")
    if not isinstance(document.get("settings", {}), dict):
        raise TranscriptError(f"{path}: \"settings\" must be an object")
    return document
