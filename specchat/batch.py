"""`specchat run`: prompt records answered one after another, each in a fresh conversation; and a
piped chat's one prompt (`answer_piped`).

Each record becomes one JSON record (or, with `--format text`, answers streamed to the UI with a
statistics line each), written with its trace lines as soon as it is complete, so an
interruption or a failure later loses nothing. A record that fails — its template cannot format
it, it does not fit in the context, the answer fails — is reported as `FILE:LINE: reason` and
written with an "error" field and the turns it did answer; the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specchat.chat import Conversation
from specchat.errors import SpecchatError, Terminated
from specchat.inputs import PromptRecord
from specchat.live import LiveChat
from specchat.methods import effective_draft
from specchat.ui import ChatUI, stats_line

log = logging.getLogger(__name__)


def answer_records(chat: LiveChat, records: list[PromptRecord], sink, trace_file=None, ui: ChatUI | None = None,
                   warn: Callable[[str], None] = print, kept: bool = True) -> int:
    """Answer every record; JSON records go to `sink` unless a `ui` shows the answers. Returns the failures.

    On Ctrl-C (or SIGTERM, `Terminated`) the records finished so far are said to be kept, or, if
    not `kept` (an --atomic output, which then stays as it was), discarded.
    """
    failures = written = 0
    problems = {id(record): problem for record in records if (problem := preflight(chat, record))}
    try:  # around the whole loop: a signal can land between records as well as inside one
        for record in records:
            trace: list[str] = []
            result = (answer_record(chat, record, trace, ui) if id(record) not in problems
                      else failed(chat, record, [], problems[id(record)]))
            if "error" in result:
                failures += 1
                warn(f"specchat: error: {result['error']}")
            with signals_held():  # a record and its count go together: Ctrl-C or SIGTERM lands after both
                if ui is None:
                    sink.write(json.dumps(result, ensure_ascii=False) + "\n")
                    sink.flush()  # records are written as they complete, so a failure later loses nothing
                if trace_file is not None and trace:
                    trace_file.write("".join(trace))  # a record's cycles in one piece
                    trace_file.flush()
                written += 1
    except (KeyboardInterrupt, Terminated) as stop:
        outcome = f"kept the {written} finished records" if kept else \
            f"the {written} finished records are not written (--atomic leaves the output as it was)"
        if isinstance(stop, Terminated):
            stop.message = f"terminated; {outcome}"  # the command line's one line
        else:
            warn(f"\nspecchat: interrupted; {outcome}")
        raise
    return failures


@contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while the block runs; one that came meanwhile is handled as it ends.

    Python runs a signal's handler between any two calls, so without this a record could be
    written and not counted, and "kept the N finished records" be one short. Only the main thread
    can set handlers; elsewhere signals are not Python's to hold, and the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous: dict[int, object] = {}
    try:
        for signum in signums:
            if signal.getsignal(signum) is not None:  # None: a handler not set from Python, left alone
                previous[signum] = signal.signal(signum, lambda signum, frame: pending.append(signum))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            handler = previous[pending[0]]
            if callable(handler):
                handler(pending[0], None)  # raises KeyboardInterrupt or Terminated, as it would have
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), pending[0])


def answer_piped(chat: LiveChat, prompt: str) -> None:
    """Answer one prompt like a Unix tool (`echo ... | specchat chat`): the answer on stdout, the
    statistics line on stderr."""
    ui = ChatUI.for_streams(info_on_stderr=True)
    writer = ui.answer(chat.settings.show_accept)
    for index, event in enumerate(chat.reply(prompt)):
        if index == 0:
            log.debug("the first token")
        writer.write(event)
    ui.end_answer()
    report = chat.report()
    if chat.settings.compare:
        report.comparison = chat.compare_last_turn()
    ui.stats(report)


def preflight(chat: LiveChat, record: PromptRecord) -> str | None:
    """What stops a record before it is answered (its first prompt cannot be formatted, or does not
    fit in the context), as `FILE:LINE: reason`; None if it can start."""
    conversation = Conversation.opening(record, chat.settings.system)
    conversation.add_user(record.turns[0])
    room = chat.engine.target.max_context
    try:
        chat.session.chat_format.check_size(conversation.as_messages(), room)  # a huge record: not even tokenized
        ids = chat.session.chat_format.prompt_ids(conversation)
    except SpecchatError as error:
        return f"{record.where}: {error}"
    if len(ids) >= room:
        return f"{record.where}: the prompt has {len(ids)} tokens but the model's context holds {room}"
    return None


def answer_record(chat: LiveChat, record: PromptRecord, trace: list[str], ui: ChatUI | None = None) -> dict:
    """Answer every turn of one prompt record in a fresh conversation; its trace lines go to `trace`.

    With a `ui` (`--format text`), answers stream to it as they come, statistics below each. A
    turn that fails ends the record: the result keeps the turns before it and says why.
    """
    settings, session = chat.settings, chat.session
    session.conversation = Conversation.opening(record, settings.system)
    turns = []
    for turn_index, prompt in enumerate(record.turns):
        writer = ui.answer(settings.show_accept) if ui else None
        try:
            for event in chat.reply(prompt):
                if writer is not None:
                    writer.write(event)
                if event.step.cycle is not None:
                    cycle_index = len(event.turn.cycles) - 1
                    line = {"id": record.id, "turn": turn_index, "cycle": cycle_index, **event.step.cycle.record()}
                    if cycle_index == 0:
                        line["context_ids"] = event.turn.prompt_ids
                    trace.append(json.dumps(line) + "\n")
        except (SpecchatError, RuntimeError, ValueError) as error:  # this record only: the caches were rolled back
            reason = str(error) if isinstance(error, SpecchatError) else f"the answer failed: {type(error).__name__}: {error}"
            if ui is not None:
                ui.end_answer()
            return failed(chat, record, turns, f"{record.where}: turn {turn_index + 1}: {reason}")
        stats = chat.last_turn.stats
        turn = {"prompt": prompt, "response": chat.last_turn.text, **stats.record()}
        comparison = None
        if settings.compare:  # the estimate the chat shows beside the measured speedup, so that one can check the other
            estimate = chat.report().estimated_speedup
            comparison = chat.compare_last_turn()
            turn |= {"estimated_speedup": None if estimate is None else round(estimate, 4),
                     **(comparison.record() if comparison else {})}
        turns.append(turn)
        if ui is not None:
            ui.end_answer()
            ui.note(stats_line(stats, comparison=comparison))
    return _record(chat, record, turns)


def failed(chat: LiveChat, record: PromptRecord, turns: list[dict], reason: str) -> dict:
    return {**_record(chat, record, turns), "error": reason}


def _record(chat: LiveChat, record: PromptRecord, turns: list[dict]) -> dict:
    settings = chat.settings
    return {"id": record.id, "category": record.category, "method": settings.method, "model": settings.model,
            "runtime": chat.engine.target.runtime, "draft": effective_draft(settings), "turns": turns}
