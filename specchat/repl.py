"""The interactive chat loop.

The prompt appears at once: importing torch and transformers and loading the model take several
seconds on a CPU, so they happen in a background thread while the user types the first message.
"""

from __future__ import annotations

import sys
import threading

from prompt_toolkit import PromptSession


class BackgroundLoad:
    """Runs `load()` in a thread; `result()` waits for it and re-raises its error."""

    def __init__(self, load):
        self._value = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), daemon=True, name="specchat-load")
        self._thread.start()

    def _run(self, load) -> None:
        try:
            self._value = load()
        except BaseException as error:  # handed to the main thread, which reports it
            self._error = error

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def run_repl(load_session, model_name: str) -> None:
    """Read a message, stream the reply, repeat. Ctrl-C stops a reply; Ctrl-D or /exit quits."""
    from specchat.cli import stats_line

    loading = BackgroundLoad(load_session)
    prompt = PromptSession()
    print(f"specchat · {model_name} · Ctrl-C stops a reply, Ctrl-D or /exit quits", file=sys.stderr)
    session = None
    while True:
        try:
            text = prompt.prompt(">>> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if text.strip() in ("/exit", "/quit"):
            return
        if not text.strip():
            continue
        if session is None:
            if not loading.ready:
                print("(loading the model...)", file=sys.stderr)
            session = loading.result()
        from specchat.engine import ContextLengthError

        try:
            for event in session.reply(text):
                sys.stdout.write(event.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        except ContextLengthError as error:
            print(f"specchat: {error}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        print(stats_line(session.last_stats), file=sys.stderr)
