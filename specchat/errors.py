"""The errors a user can act on, and the exit status each one gives.

Every module raises its own subclass (a profile, a prompt file, a model, a draft head, ...), with
a one-line message that names the file, key or value. The command line prints that line and
exits with `exit_code`; nothing here imports torch, so the command line can catch them all
before the heavy imports.
"""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """An error's message in one line: its first (its type's name where it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def summary(error: BaseException) -> str:
    """An unexpected error in one line: its type and `first_line`."""
    text = first_line(error)
    return text if text == type(error).__name__ else f"{type(error).__name__}: {text}"


class SpecchatError(Exception):
    """A failure with a one-line message for the user: exit status 1."""

    exit_code = 1


class UsageError(SpecchatError):
    """Something the user must fix before anything runs (an option, a profile, a prompt file): exit status 2."""

    exit_code = 2


class ContextLengthError(SpecchatError, ValueError):
    """The prompt does not fit in the model's context."""


class ModelLoadError(SpecchatError, RuntimeError):
    """The target model could not be found or loaded; the message says why in one line."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread, so that what Ctrl-C cleans up is cleaned up here too
    (finished records kept, temporary files removed); the command line exits with 143 (128 + 15)
    and `message`. A BaseException like KeyboardInterrupt, but not one: nothing that catches Ctrl-C
    to go on (the chat's "stop the answer") may keep the process alive."""

    exit_code = 143

    def __init__(self, message: str = "terminated"):
        super().__init__(message)
        self.message = message
