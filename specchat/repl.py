"""The interactive chat: a prompt, streamed answers and slash commands.

The prompt appears at once: importing torch and transformers and loading the model take several
seconds on a CPU, so they happen in a background thread while the user types the first message.
What the loop changes goes through `specchat.live.LiveChat` and what it prints through
`specchat.ui.ChatUI`; both, and the prompt's input and output, can be handed in, which is how
the tests drive it.
"""

from __future__ import annotations

import os
import threading
from contextlib import closing
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.application import get_app
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.filters import Condition
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import create_output

from specchat.errors import ContextLengthError, summary
from specchat.inputs import InputError, read_prediction
from specchat.settings import LIVE_KEYS, LiveChatError, show_value
from specchat.methods import CHAT_METHODS, METHODS, effective_draft, needs_draft
from specchat.transcript import TranscriptError
from specchat.ui import ChatUI

PROMPT, CONTINUATION = ">>> ", "... "
PLACEHOLDER = "Send a message (/help for commands)"
BLOCK_QUOTE = '"""'

# (name, arguments, what it does), in the order /help lists them
COMMANDS = (
    ("help", "", "this help"),
    ("exit", "", "quit (also /quit, /bye, Ctrl-D)"),
    ("clear", "", "start a new conversation (the system prompt stays)"),
    ("system", "[TEXT | none]", "show, set or remove the system prompt"),
    ("method", "[NAME [DRAFT]]", "decode with another method; DRAFT is a head folder, hub id or draft model"),
    ("set", "[KEY VALUE]", "change a setting: " + ", ".join(LIVE_KEYS)),
    ("show", "", "model, draft, method, profile and settings"),
    ("stats", "", "session totals per method: tokens, τ, acceptance (by tree depth), speedup"),
    ("compare", "[on | off]", "also decode each answer plainly: measured speedup, identical answers?"),
    ("tree", "", "the last draft tree with its probabilities, accepted path marked"),
    ("predict", "[FILE | off]", "show, set or remove the text every answer will mostly repeat (drafted from)"),
    ("save", "FILE", "save the conversation and settings as a JSON transcript"),
    ("load", "FILE", "restore a saved conversation and its settings"),
)
ALIASES = {"quit": "exit", "bye": "exit", "?": "help"}
KEYS = (
    ("Ctrl-C", "stop the answer (it stays in the conversation); on an empty line, a reminder how to quit"),
    ("Ctrl-D", "quit"),
    ("Alt-Enter", "new line without sending (or Esc then Enter)"),
    ('"""', 'start a message with """ to write several lines; end it with """'),
    ("Up / Down", "earlier messages (kept in the history file)"),
)


class BackgroundLoad:
    """Runs `load()` in a thread; `result()` waits for it and re-raises its error.

    The thread is a daemon, so that quitting does not wait for the load (the command line then
    ends the process at once: `specchat.cli.leave_at_once`). Waiting is on an event, not on
    `Thread.join()`: in Python 3.11 a Ctrl-C that interrupts a join marks the thread as stopped
    while it runs on, and the chat then took the load for done (and its result for None).
    """

    def __init__(self, load):
        self._value = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(load,), daemon=True, name="specchat-load")
        self._thread.start()

    def _run(self, load) -> None:
        try:
            self._value = load()
        except BaseException as error:  # handed to the main thread, which reports it
            self._error = error
        finally:
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


# ---------------------------------------------------------------------------------------------
# Input


def history_path() -> Path:
    state_home = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state_home) / "specchat" / "history"


def open_history():
    """The prompt's history: the XDG state file (private to the user), or memory only."""
    if os.environ.get("SPECCHAT_NOHISTORY"):
        return InMemoryHistory()
    path = history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.touch(mode=0o600)
    except OSError:
        return InMemoryHistory()  # a read-only home must not stop the chat
    return FileHistory(str(path))


def block_is_open(text: str) -> bool:
    """True while a message that starts with \"\"\" has not been closed by another."""
    stripped = text.lstrip()
    return stripped.startswith(BLOCK_QUOTE) and stripped.count(BLOCK_QUOTE) % 2 == 1


def unwrap_block(text: str) -> str:
    """The message inside \"\"\" ... \"\"\", or the text as typed."""
    stripped = text.strip()
    if len(stripped) >= 2 * len(BLOCK_QUOTE) and stripped.startswith(BLOCK_QUOTE) and stripped.endswith(BLOCK_QUOTE):
        # Keep the first line's indentation; drop the auto-indent before the closing quotes.
        return stripped[len(BLOCK_QUOTE):-len(BLOCK_QUOTE)].lstrip("\n").rstrip()
    return text


class CommandCompleter(Completer):
    """Tab completes command names, /method names, /set keys, on/off and /predict off."""

    def get_completions(self, document, complete_event):
        words = document.text_before_cursor.split(" ")
        if not words[0].startswith("/"):
            return
        if len(words) == 1:
            candidates = ["/" + name for name, _, _ in COMMANDS]
        elif len(words) == 2:
            arguments = {"/method": list(CHAT_METHODS), "/set": list(LIVE_KEYS),
                         "/compare": ["on", "off"], "/predict": ["off"]}
            candidates = arguments.get(words[0], [])
        else:
            candidates = ["on", "off"] if words[0] == "/set" and words[1] in ("show_accept", "compare") else []
        for candidate in candidates:
            if candidate.startswith(words[-1]):
                yield Completion(candidate, start_position=-len(words[-1]))


def make_prompt(input=None, output=None) -> PromptSession:
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _new_line(event):
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event):
        # Ctrl-C discards a half-typed line; on an empty one it raises KeyboardInterrupt (a quit reminder).
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    # Off a terminal stdout, draw the prompt on the terminal behind stderr, so stdout keeps only answers.
    output = output or create_output(always_prefer_tty=True)
    inside_block = Condition(lambda: block_is_open(get_app().current_buffer.text))
    return PromptSession(
        history=open_history(), key_bindings=bindings, multiline=inside_block, prompt_continuation=CONTINUATION,
        placeholder=PLACEHOLDER, completer=CommandCompleter(), complete_while_typing=False, input=input, output=output,
    )


# ---------------------------------------------------------------------------------------------
# The loop


def run_repl(load_chat, model_name: str, *, ui: ChatUI | None = None, input=None, output=None) -> None:
    """Read a message, stream the answer, repeat. Returns on Ctrl-D or /exit.

    Args:
        load_chat: builds the `LiveChat` (runs in a background thread while the prompt is up).
        model_name: shown in the banner before the model has loaded.
        ui, input, output: where to print, and the prompt-toolkit input/output (default: the terminal).
    """
    ui = ui or ChatUI.for_streams()
    repl = Repl(BackgroundLoad(load_chat), ui)
    prompt = make_prompt(input, output)
    ui.banner(model_name)
    while True:
        try:
            text = prompt.prompt(PROMPT)
        except KeyboardInterrupt:
            ui.hint("Use Ctrl-D or /exit to quit.")
            continue
        except EOFError:
            return
        try:
            if repl.handle(text):
                return
        except KeyboardInterrupt:
            ui.note("(stopped)")


class Repl:
    """What one line of input does: a message is answered, a /command is run."""

    def __init__(self, loading: BackgroundLoad, ui: ChatUI):
        self.loading = loading
        self.ui = ui

    def handle(self, text: str) -> bool:
        """Act on one input; True means quit."""
        if text.startswith("/"):
            return self.command(text)
        message = unwrap_block(text)
        if message.strip():
            self.answer(message)
        return False

    def chat(self):
        """The `LiveChat`, once loaded (a spinner while waiting); None if the user gave up waiting."""
        if self.loading.ready:
            return self.loading.result()
        try:
            with self.ui.busy("loading the model..."):
                return self.loading.result()
        except KeyboardInterrupt:
            self.ui.hint("Stopped waiting; the model goes on loading.")
            return None

    # -- answers ---------------------------------------------------------------------------

    def answer(self, message: str) -> None:
        chat = self.chat()
        if chat is None:
            return
        try:
            finished = self._stream(chat, message)
        except ContextLengthError as error:
            self.ui.error(f"{error}; /clear starts a new conversation")
            return
        except Exception as error:  # e.g. out of memory: the caches were rolled back, the chat can go on
            self.ui.end_answer()
            self.ui.error(f"the answer failed: {summary(error)}")
            return
        self.ui.end_answer(interrupted=not finished)
        report = chat.report()
        if finished and chat.settings.compare:
            report.comparison = self._compare(chat)
        self.ui.stats(report)

    def _stream(self, chat, message: str) -> bool:
        """Print the answer as it comes; False if Ctrl-C stopped it."""
        writer = self.ui.answer(chat.settings.show_accept)
        # Closing the stream on Ctrl-C lets the engine trim its caches back to the committed
        # tokens, and the session keep the partial answer marked as interrupted.
        with closing(chat.reply(message)) as events:
            try:
                for event in events:
                    writer.write(event)
            except KeyboardInterrupt:
                return False
        return True

    def _compare(self, chat):
        try:
            with self.ui.busy("decoding plainly to compare..."):
                return chat.compare_last_turn()
        except KeyboardInterrupt:
            self.ui.note("(comparison stopped)")
            return None

    # -- commands --------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run one /command; True means quit. Mistakes get a one-line hint."""
        name, _, argument = line[1:].strip().partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        if name not in {command for command, _, _ in COMMANDS}:
            self.ui.hint(f"Unknown command /{name}. Type /help for the commands "
                         "(start a line with a space to send it as a message).")
            return False
        if name in ("help", "exit"):
            return getattr(self, f"do_{name}")(argument.strip())
        chat = self.chat()
        if chat is None:
            return False
        try:
            getattr(self, f"do_{name}")(chat, argument.strip())
        except (LiveChatError, TranscriptError, InputError) as error:
            self.ui.error(str(error))
        except Exception as error:  # a failing library call must not end the chat and lose the conversation
            self.ui.error(f"/{name} failed: {summary(error)}")
        return False

    def do_help(self, argument: str) -> bool:
        self.ui.help([(f"/{name} {arguments}".rstrip(), what) for name, arguments, what in COMMANDS], list(KEYS))
        return False

    def do_exit(self, argument: str) -> bool:
        return True

    def do_clear(self, chat, argument: str) -> None:
        chat.clear()
        self.ui.note("new conversation")

    def do_system(self, chat, argument: str) -> None:
        if not argument:
            self.ui.note(f"system prompt: {chat.settings.system!r}" if chat.settings.system else "no system prompt")
            return
        chat.set_system(None if argument.lower() == "none" else argument)
        self.ui.note("system prompt removed" if chat.settings.system is None else "system prompt set")

    def do_method(self, chat, argument: str) -> None:
        if not argument:
            known = ", ".join(f"{name} ({METHODS[name].summary})" for name in CHAT_METHODS)
            self.ui.note(f"method {chat.settings.method}; known: {known}")
            return
        name, _, draft = argument.partition(" ")
        loads = bool(needs_draft(name))
        with self.ui.busy(f"loading the draft for {name}...", active=loads):
            chat.switch_method(name, draft.strip() or None)
        self.ui.note(f"method {name}: {METHODS[name].summary}" + (f" (draft {effective_draft(chat.settings)})" if loads else ""))

    def do_set(self, chat, argument: str) -> None:
        if not argument:
            self.ui.show([(key, show_value(getattr(chat.settings, key))) for key in LIVE_KEYS])
            return
        key, _, value = argument.partition(" ")
        if key == "system":
            self.do_system(chat, value.strip())
            return
        if not value.strip():
            raise LiveChatError(f"usage: /set KEY VALUE (KEY is one of {', '.join(LIVE_KEYS)})")
        with self.ui.busy("rebuilding the draft...", active=key in ("total_tokens", "depth", "tree_top_k")):
            chat.set_value(key, value.strip())
        self.ui.note(f"{key} = {show_value(getattr(chat.settings, key))}")
        if key == "show_accept" and chat.settings.show_accept and self.ui.can_colour:
            self.ui.legend()
        elif key == "show_accept" and chat.settings.show_accept:
            self.ui.note("(colours show only on a terminal)")

    def do_compare(self, chat, argument: str) -> None:
        if argument:
            chat.set_value("compare", argument)
        state = "on: each answer is also decoded plainly" if chat.settings.compare else "off"
        self.ui.note(f"compare {state}")

    def do_show(self, chat, argument: str) -> None:
        history = "off (SPECCHAT_NOHISTORY)" if os.environ.get("SPECCHAT_NOHISTORY") else str(history_path())
        self.ui.show(chat.describe() + [("history", history)])

    def do_stats(self, chat, argument: str) -> None:
        target = chat.engine.target
        self.ui.session_stats(chat.totals, target.runtime, target.compile_seconds, target.capture_seconds)

    def do_tree(self, chat, argument: str) -> None:
        if chat.last_cycle is None:
            self.ui.hint("No draft tree yet: answer something with a speculative method "
                         f"(now: {chat.settings.method}).")
            return
        self.ui.tree(chat.last_cycle, chat.tokenizer)

    def do_predict(self, chat, argument: str) -> None:
        off = argument.lower() == "off"
        if off:
            chat.set_prediction(None)
        elif argument:
            chat.set_prediction(read_prediction(argument), argument)
        if chat.prediction is None:
            self.ui.note("no prediction" + (f" ({argument} is empty)" if argument and not off else ""))
            return
        tokens = len(chat.session.chat_format.prediction_ids(chat.prediction))
        self.ui.note(f"prediction {chat.prediction_name}: {tokens} tokens, drafted from in every answer")

    def do_save(self, chat, argument: str) -> None:
        if not argument:
            raise LiveChatError("usage: /save FILE")
        path = chat.save(argument)
        self.ui.note(f"saved {len(chat.session.conversation.messages)} messages and the settings to {path}")

    def do_load(self, chat, argument: str) -> None:
        if not argument:
            raise LiveChatError("usage: /load FILE")
        with self.ui.busy("loading..."):
            notes = chat.load(argument)
        self.ui.note(f"loaded {len(chat.session.conversation.messages)} messages from {argument}; "
                     f"method {chat.settings.method}")
        for note in notes:
            self.ui.hint(note)
