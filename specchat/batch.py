"""`specchat run`: prompt records answered one after another, each in a fresh conversation.

Each record becomes one JSON record (or, with `--format text`, answers streamed to the UI with a
statistics line each), written as soon as it is complete, so an interruption or a failure later
loses nothing. A record that fails is reported and the run goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from specchat.errors import ContextLengthError
from specchat.inputs import PromptRecord
from specchat.live import LiveChat
from specchat.methods import effective_draft
from specchat.ui import ChatUI, stats_line


def answer_records(chat: LiveChat, records: list[PromptRecord], sink, trace_file=None, ui: ChatUI | None = None,
                   warn: Callable[[str], None] = print) -> int:
    """Answer every record; JSON records go to `sink` unless a `ui` shows the answers. Returns the failures."""
    failures = 0
    for done, record in enumerate(records):
        try:
            result = answer_record(chat, record, trace_file, ui, warn)
        except KeyboardInterrupt:
            warn(f"\nspecchat: interrupted; kept the {done - failures} finished records")
            raise
        if result is None:
            failures += 1
        elif ui is None:
            sink.write(json.dumps(result, ensure_ascii=False) + "\n")
            sink.flush()  # records are written as they complete, so a failure later loses nothing
    return failures


def answer_record(chat: LiveChat, record: PromptRecord, trace_file=None, ui: ChatUI | None = None,
                  warn: Callable[[str], None] = print) -> dict | None:
    """Answer every turn of one prompt record in a fresh conversation; None if it failed.

    With a `ui` (`--format text`), answers stream to it as they come, statistics below each.
    """
    settings, session = chat.settings, chat.session
    session.conversation.system = record.system if record.system is not None else settings.system
    session.clear()
    session.conversation.messages.extend(record.history)
    turns = []
    for turn_index, prompt in enumerate(record.turns):
        pieces, cycle_index = [], 0
        writer = ui.answer(session.chat_format.decoder() if settings.show_accept else None) if ui else None
        try:
            for event in chat.reply(prompt):
                pieces.append(event.text)
                if writer is not None:
                    writer.write(event)
                if trace_file is not None and event.step.cycle is not None:
                    line = {"id": record.id, "turn": turn_index, "cycle": cycle_index, **event.step.cycle.record()}
                    if cycle_index == 0:
                        line["context_ids"] = session.last_prompt_ids
                    trace_file.write(json.dumps(line) + "\n")
                    cycle_index += 1
        except ContextLengthError as error:
            warn(f"specchat: error: {record.where}: {error}")
            return None
        finally:
            if writer is not None:
                writer.close()
        comparison = chat.compare_last_turn() if settings.compare else None
        turn = {"prompt": prompt, "response": "".join(pieces), **session.last_stats.record()}
        turns.append({**turn, **comparison.record()} if comparison else turn)
        if ui is not None:
            ui.end_answer()
            ui.note(stats_line(session.last_stats, comparison=comparison))
    return {"id": record.id, "category": record.category, "method": settings.method,
            "model": settings.model, "draft": effective_draft(settings), "turns": turns}
