"""The core's messages on stderr, as the command line shows them: one `specchat: ` line each, and with
`--verbose` the start's phases, each with the seconds since the process started."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


def process_start() -> float:
    """When this process started (`time.time()`'s clock), from /proc (to 10 ms); elsewhere, now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # starttime: ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


PROCESS_START = process_start()


class AnswerLine:
    """Whether a streamed answer has left its line on the terminal unfinished (`ui.AnswerWriter` says):
    a core message meanwhile (`--verbose`'s healed curve, a warning) then starts on a line of its own
    rather than inside the answer's words, where stdout and stderr share one terminal."""

    open = False


class CoreLines(logging.Handler):
    """The decoding core's messages (`logging.getLogger("specchat")`) as one `specchat: ` line each on
    stderr, written to whatever stderr is at the time (a test's capture included); a debug line (a
    start phase that ended, `--verbose`) with the seconds since the process started."""

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if record.levelno <= logging.DEBUG:
            line = f"{record.created - PROCESS_START:6.2f}s  {line}"
        if AnswerLine.open and sys.stdout.isatty() and sys.stderr.isatty():
            print(file=sys.stderr)  # off the answer's unfinished line; the answer goes on below
            AnswerLine.open = False
        print(f"specchat: {line}", file=sys.stderr, flush=True)


def show_core_messages(phases: bool = False) -> None:
    """The core's messages on stderr; with `phases`, its debug lines too (`--verbose`)."""
    core = logging.getLogger("specchat")
    if not any(isinstance(handler, CoreLines) for handler in core.handlers):
        core.addHandler(CoreLines())
        core.propagate = False
    core.setLevel(logging.DEBUG if phases else logging.INFO)
