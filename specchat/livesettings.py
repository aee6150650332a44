"""Which settings may change in the middle of a chat, and how their new values are read.

`/set KEY VALUE` gives text, `/load` gives JSON; both go through `parse_value`, which checks the
value against the setting's declared type and choices (`specchat.settings`). This module imports
nothing heavy, so the chat's prompt can use it before torch has loaded.
"""

from __future__ import annotations

import dataclasses

from specchat import settings as settings_mod
from specchat.errors import SpecchatError
from specchat.settings import FIELDS, Settings

# What `/set KEY VALUE` may change; every other setting needs a restart (or `/method`, `/system`).
LIVE_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "total_tokens", "depth", "tree_top_k",
             "draft_tokens", "lookup", "show_accept", "compare")
METHOD_SECTIONS = ("method", "draft")  # the settings a proposer is built from
TRUE_WORDS, FALSE_WORDS = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
UNSET_WORDS = ("none", "default")


class LiveChatError(SpecchatError, ValueError):
    """A change that cannot be made; the message is one line for the user, and nothing changed."""


def parse_value(key: str, value):
    """A setting's value from text (`/set`) or JSON (`/load`), checked against its type and choices."""
    choices = FIELDS[key].metadata["choices"]
    value = _typed_value(key, value)
    if choices and value is not None and value not in choices:
        raise LiveChatError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    problem = settings_mod.check_value(key, value)
    if problem:
        raise LiveChatError(f"{key} {problem}")
    return value


def _typed_value(key: str, value):
    kind = settings_mod.field_type(key)
    optional = FIELDS[key].type.endswith("| None")
    if isinstance(value, str):
        word = value.strip().lower()
        if optional and word in UNSET_WORDS:
            return None
        if kind is bool and word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        if kind in (int, float):
            try:
                return kind(word)
            except ValueError:
                pass
        if kind is str:
            return value
    elif value is None and optional:
        return None
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {bool: "on or off", int: "a whole number", float: "a number", str: "text"}[kind]
    unset = f" or {UNSET_WORDS[0]}" if optional else ""
    raise LiveChatError(f"{key} takes {expected}{unset}, got {value!r}")


def method_key(settings: Settings) -> tuple:
    """Everything a proposer is built from: equal keys give interchangeable proposers."""
    return tuple(getattr(settings, name) for name, f in FIELDS.items() if f.metadata["section"] in METHOD_SECTIONS)


def with_method_of(settings: Settings, other: Settings) -> Settings:
    """`settings` with the method and draft settings of `other`."""
    return dataclasses.replace(settings, **{name: getattr(other, name) for name, f in FIELDS.items()
                                            if f.metadata["section"] in METHOD_SECTIONS})


def show_value(value) -> str:
    """A setting's value as `/set` takes it back: on/off, none, or the value."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)
