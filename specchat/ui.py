"""Terminal rendering shared by the commands: progress bars on stderr.

In a terminal, rich progress bars; otherwise (a log file, a pipe) a plain line every
`PLAIN_INTERVAL` seconds, so long runs in the background still leave a readable record.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

PLAIN_INTERVAL = 30.0


class TrainingProgress:
    """Progress of `specchat train`: one bar per preparation stage, then the training bar."""

    def __init__(self):
        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, disable=not self.live)
        self._last_print = 0.0
        self._train_task = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def _plain(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.live and (force or now - self._last_print >= PLAIN_INTERVAL):
            print(text, file=sys.stderr, flush=True)
            self._last_print = now

    def stage(self, description: str):
        """A callback (done, total) for one preparation stage."""
        task = self.progress.add_task(description, total=None, info="")
        started = time.monotonic()

        def update(done: int, total: int) -> None:
            self.progress.update(task, completed=done, total=total)
            rate = done / max(1e-9, time.monotonic() - started)
            self._plain(f"{description}: {done}/{total} ({rate:.2f}/s)", force=done == total)

        return update

    def training(self, state, total_steps: int, loss: float, accuracy: float) -> None:
        rate = state.tokens_seen / max(1e-9, state.seconds)
        info = f"loss {loss:.4f} · top-1 {accuracy:.1%} · {rate:,.0f} tok/s"
        if state.evaluations:
            info += f" · held-out {state.evaluations[-1]['top1_by_step']}"
        if self._train_task is None:
            self._train_task = self.progress.add_task("training", total=total_steps, info=info)
        self.progress.update(self._train_task, completed=state.step, info=info)
        eta = (total_steps - state.step) * state.seconds / max(1, state.step)
        self._plain(f"step {state.step}/{total_steps} · {info} · eta {eta / 60:.0f} min", force=state.step == total_steps)
