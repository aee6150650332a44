"""Terminal rendering: the chat's answers, statistics and tables, and training progress bars.

The chat writes answers to one stream (stdout) and everything else - statistics, hints, tables,
spinners - to another: stdout too in a terminal, so both interleave as typed, but stderr when
stdout is a pipe or file, which then receives nothing but answers. Colours and spinners appear
only on a terminal (and never with NO_COLOR).

Training shows rich progress bars in a terminal; otherwise (a log file, a pipe) a plain line
every `PLAIN_INTERVAL` seconds, so long runs in the background still leave a readable record.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext

from rich.console import COLOR_SYSTEMS, Console
from rich.style import Style
from rich.table import Table
from rich.text import Text
from rich.tree import Tree
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specchat.logs import AnswerLine

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
        """A callback (done, total) for one preparation stage; its rate and ETA count this run's work
        (a resumed stage starts at what was done before)."""
        task = self.progress.add_task(description, total=None, info="")
        started, first = time.monotonic(), []

        def update(done: int, total: int) -> None:
            self.progress.update(task, completed=done, total=total)
            first[:] = first or [done - 1]
            rate = (done - first[0]) / max(1e-9, time.monotonic() - started)
            eta = f", eta {(total - done) / rate / 60:.0f} min" if rate and done < total else ""
            self._plain(f"{description}: {done}/{total} ({rate:.2f}/s{eta})", force=done == total)

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


# ---------------------------------------------------------------------------------------------
# The chat

# With --show-accept: draft tokens the target accepted, and tokens the target produced itself
# (the first token, each cycle's bonus token or correction).
DRAFTED_STYLE, TARGET_STYLE = "green", "yellow"


def stats_line(stats, estimated_speedup: float | None = None, comparison=None,
               prediction: tuple[int, int] | None = None) -> str:
    """One line about a reply: tokens, tokens/s, tau, acceptance rate, speedup over plain decoding.

    tau counts the bonus token (1.00 for plain decoding); the acceptance rate is accepted draft
    tokens over the draft tokens the target verified. The speedup is the decoding phase's (see
    `specchat.speedup`): estimated, marked "est.", or measured when a `comparison` (the reply
    decoded plainly too) is given. `prediction`: the reply's prediction's tokens that it repeated
    (OpenAI's accepted prediction tokens, `chat.prediction_usage`) and how many it held.
    """
    parts = [f"{stats.new_tokens} tokens", f"{stats.tokens_per_s:.1f} tok/s", f"τ {stats.tau:.2f}"]
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.0%} ({stats.accepted_tokens}/{stats.draft_tokens} drafted)")
    if stats.accepted_from_lookup:
        parts.append(f"{stats.accepted_from_lookup} accepted from lookup")
    if prediction is not None:
        parts.append(f"prediction {prediction[0]}/{prediction[1]} accepted")
    shares = stats.arm_shares()
    if len(shares) > 1:  # the pace took several draft sources
        parts.append("steps " + " ".join(f"{arm} {share:.0%}" for arm, share in shares.items()))
    if comparison is not None:
        verdict = "same answer"
        if comparison.divergence is not None:
            where = comparison.divergence
            margin = "" if where.margin is None else \
                f", plain margin {where.margin:.2f}{' (a near-tie)' if where.near_tie else ''}"
            verdict = f"answers differ from token {where.position}{margin}"
        speedup = "-" if comparison.speedup is None else f"{comparison.speedup:.2f}x"
        parts.append(f"{speedup} vs plain, measured ({verdict})")
    elif estimated_speedup is not None:
        parts.append(f"~{estimated_speedup:.1f}x est.")
    parts.append(f"prefill {stats.prefill_seconds:.2f}s")
    return " · ".join(parts)


def token_label(tokenizer, token: int) -> str:
    """A token as a quoted, escaped string (so spaces and newlines show)."""
    return repr(tokenizer.decode([token], skip_special_tokens=False))


class AnswerWriter:
    """Streams one answer: the text as is, or coloured token by token by where it came from."""

    def __init__(self, console: Console, colour: bool = False):
        self.file = console.file
        self.colour = colour
        self.color_system = COLOR_SYSTEMS.get(console.color_system or "")
        self.styles = {True: Style.parse(DRAFTED_STYLE), False: Style.parse(TARGET_STYLE)}

    def write(self, event) -> None:
        """An event's text (`specchat.chat.TurnEvent`), coloured token by token from its pieces."""
        if not self.colour:
            self._emit(event.text)
            return
        for piece, drafted in event.pieces:
            self._emit(piece, self.styles[drafted])

    def _emit(self, text: str, style: Style | None = None) -> None:
        if not text:
            return
        # Written directly rather than through rich, which would expand tabs and re-wrap lines.
        self.file.write(style.render(text, color_system=self.color_system) if style else text)
        self.file.flush()
        AnswerLine.open = not text.endswith("\n")


class ChatUI:
    """Everything the chat shows: answers on `out`, all else on `info` (see the module docstring)."""

    def __init__(self, out: Console, info: Console | None = None):
        self.out = out
        self.info = info or out

    @classmethod
    def for_streams(cls, info_on_stderr: bool = False) -> ChatUI:
        """Answers on stdout; the rest on stdout too if it is a terminal, else (or if asked) on stderr."""
        out = Console(soft_wrap=True, highlight=False)
        if out.is_terminal and not info_on_stderr:
            return cls(out, out)
        return cls(out, Console(stderr=True, soft_wrap=True, highlight=False))

    @property
    def can_colour(self) -> bool:
        return self.out.is_terminal and not self.out.no_color and self.out.color_system is not None

    # -- answers ---------------------------------------------------------------------------

    def answer(self, colour: bool = False) -> AnswerWriter:
        """A writer for the next answer, coloured by where each token came from if asked and possible."""
        return AnswerWriter(self.out, colour and self.can_colour)

    def end_answer(self, interrupted: bool = False) -> None:
        self.out.file.write("\n")
        self.out.file.flush()
        AnswerLine.open = False
        if interrupted:
            self.note("(interrupted; the partial answer stays in the conversation)")

    def stats(self, report) -> None:
        self.note(stats_line(report.stats, report.estimated_speedup, report.comparison, report.prediction))

    # -- messages --------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.info.print(Text(text, style="dim"))

    def hint(self, text: str) -> None:
        self.info.print(Text(text, style="yellow"))

    def error(self, text: str) -> None:
        self.info.print(Text(f"error: {text}", style="red"))

    def busy(self, text: str, active: bool = True):
        """A spinner while something slow runs (a context manager); nothing off a terminal or if not `active`."""
        return self.info.status(text, spinner="dots") if active and self.info.is_terminal else nullcontext()

    def banner(self, model: str) -> None:
        line = Text.assemble(("specchat", "bold"), f" · {model}",
                             (" · /help for commands, Ctrl-C stops an answer, Ctrl-D or /exit quits", "dim"))
        self.info.print(line)

    def legend(self) -> None:
        self.info.print(Text.assemble(("accepted draft tokens", DRAFTED_STYLE), " · ",
                                      ("tokens the target produced itself", TARGET_STYLE)))

    # -- tables ----------------------------------------------------------------------------

    def help(self, commands: list[tuple[str, str]], keys: list[tuple[str, str]]) -> None:
        table = Table.grid(padding=(0, 2))
        for usage, description in commands:
            table.add_row(Text(usage, style="bold"), description)
        table.add_row("", "")
        for key, description in keys:
            table.add_row(Text(key, style="bold"), description)
        self.info.print(table)

    def show(self, rows: list[tuple[str, str]]) -> None:
        table = Table.grid(padding=(0, 2))
        for name, value in rows:
            table.add_row(Text(name, style="bold"), Text(value))
        self.info.print(table)

    def session_stats(self, totals: dict, runtime: str, compile_seconds: float = 0.0, capture_seconds: float = 0.0
                      ) -> None:
        """Per-method totals (`specchat.live.MethodTotals`), acceptance by tree depth, and what ran the model
        (with the seconds spent compiling its forward at start-up and capturing CUDA graphs, which no
        tok/s includes)."""
        if compile_seconds:
            runtime += f"; compile_seconds {compile_seconds:.1f} at start-up, not in tok/s"
        if capture_seconds:
            runtime += f"; capture_seconds {capture_seconds:.1f} (CUDA graphs), not in tok/s"
        used = {method: t for method, t in totals.items() if t.turns}
        if not used:
            self.note(f"no answers yet (runtime: {runtime})")
            return
        table = Table(box=None, padding=(0, 2), header_style="bold")
        for column in ("method", "answers", "tokens", "tok/s", "τ", "acceptance", "speedup"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for method, t in used.items():
            rate = "-" if t.acceptance_rate is None else \
                f"{t.acceptance_rate:.0%} ({t.accepted_tokens}/{t.draft_tokens})"
            if t.measured_speedup is not None:
                speedup = f"{t.measured_speedup:.2f}x measured"
            else:
                speedup = "-" if t.estimated_speedup is None else f"~{t.estimated_speedup:.1f}x est."
            table.add_row(method, str(t.turns), str(t.new_tokens), f"{t.tokens_per_s:.1f}", f"{t.tau:.2f}", rate,
                          speedup)
        self.info.print(table)
        for method, t in used.items():
            if t.acceptance_by_depth:
                depths = " · ".join(f"{depth}: {hit / reached:.0%} ({hit}/{reached})"
                                    for depth, hit, reached in t.acceptance_by_depth)
                self.info.print(Text(f"{method} acceptance by tree depth  {depths}", style="dim"))
        for method, t in used.items():
            shares = t.arm_shares()
            if len(shares) > 1:
                steps = " · ".join(f"{arm} {share:.0%} ({t.arms[arm]})" for arm, share in shares.items())
                self.info.print(Text(f"{method} steps by draft source  {steps}", style="dim"))
        self.info.print(Text(f"runtime: {runtime}", style="dim"))

    def tree(self, cycle, tokenizer) -> None:
        """The draft tree of one cycle, accepted path marked, with each node's draft probability."""
        draft, accepted = cycle.tree, set(cycle.accepted)
        depth = max(draft.depths, default=0)
        self.info.print(Text(f"last draft tree: {len(draft)} draft tokens verified, {len(accepted)} accepted "
                             f"(✓), then the target's own token (+); depth {depth}", style="dim"))
        root = Tree(Text(f"{token_label(tokenizer, cycle.root)}  root", style="bold"), guide_style="dim")
        nodes = {-1: root}
        for node, (token, parent, prob) in enumerate(zip(draft.tokens, draft.parents, draft.probs)):
            label = Text(f"{token_label(tokenizer, token)}  {prob:.2f}")
            if node in accepted:
                label.append(" ✓", style="bold green")
                label.stylize("green")
            else:
                label.stylize("dim")
            nodes[node] = nodes[parent].add(label)
        last = cycle.accepted[-1] if cycle.accepted else -1
        nodes[last].add(Text(f"+ {token_label(tokenizer, cycle.bonus)}  target", style="yellow"))
        self.info.print(root)
