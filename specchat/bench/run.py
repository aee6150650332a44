"""Running `specchat bench`: load the target once, run each method in turn, report.

Kept apart from `specchat.bench.measure` (measurement, statistics, plots) so those stay free of
I/O on models and terminals. A long run shows progress and can be interrupted with Ctrl-C: whatever
finished is summarised and written; SIGTERM (`Terminated`) likewise.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from specchat import app
from specchat.bench import measure
from specchat.bench.measure import PeakMemory, SessionRunner
from specchat.errors import SpecchatError, Terminated, UsageError
from specchat.inputs import check_output_folder, read_prompts
from specchat.decode import hardware
from specchat.methods import METHODS, PLAIN, MethodError, MissingDraft, checked_draft, method
from specchat.peers import hf, llamacpp, openvino, vllm
from specchat.settings import FIELDS, METHOD_SECTIONS, LiveChatError, Settings, parse_value


# What runs each of the other tools' methods (specchat's own: `specchat.proposers.BUILDERS`).
RUNNERS = {**hf.RUNNERS, **llamacpp.RUNNERS, **openvino.RUNNERS, **vllm.RUNNERS}

# What `measure.write_outputs` writes into the output folder (checked before the model loads).
OUTPUT_FILES = ("results.json", "results.csv", "speedup.png", "calibration.png", "acceptance_by_depth.png",
                "memory.png", "breakdown.png")


def run_bench(inputs: list[str], methods: list[str], draft_for: dict, settings: Settings, profile: str, limit, repeat: int,
              warmup: int, output_dir: str, interleave: bool = False, breakdown: bool = False) -> None:
    check_output_folder("--output", output_dir, inputs, OUTPUT_FILES)
    # Runs repeat exactly: a run without --seed samples with seed 0.
    settings = dataclasses.replace(settings, method=PLAIN, seed=0 if settings.seed is None else settings.seed)
    runs, skipped = method_settings(methods, draft_for, settings)
    records = read_prompts(inputs)[: limit or None]
    checked = app.check(settings)
    console = Console(stderr=True)
    target, chat_format = app.load_chat_model(settings, checked)
    target.profiling = breakdown  # time each forward's products and attention (specchat.bench.breakdown)
    generation = app.generation_settings(settings, checked, chat_format)
    for label, reason in skipped.items():
        console.print(f"skipping {label}: {reason}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    meta = {
        "inputs": inputs, "questions": len(records), "methods": list(runs),
        "drafts": {**{label: run.draft for label, run in runs.items()}, **dict.fromkeys(skipped)}, "skipped": skipped,
        "model": settings.model, "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
        "runtime": target.runtime,
        "compile_seconds": round(target.compile_seconds, 2),  # at load, before any timed turn: not in tok/s
        "max_new_tokens": generation.max_new_tokens, "temperature": settings.temperature, "repeat": repeat,
        "warmup": warmup, "interleave": interleave, "breakdown": breakdown, "profile": profile,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "specchat " + " ".join(sys.argv[1:]), "hardware": hardware(),
    }
    bench = BenchRuns(runs, target, chat_format, generation, app.model_loader(settings), console, skipped)
    results, memory, interrupted = bench.all(records, settings.system, repeat, warmup, interleave)
    meta["interrupted"] = interrupted is not None
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["capture_seconds"] = round(target.capture_seconds, 2)  # CUDA graphs, at each shape's first steps: not in tok/s
    summary = measure.summarize(results, greedy=generation.sampling.greedy)
    written = measure.write_outputs(Path(output_dir), results, summary, memory, meta)
    about = f"{settings.model} · T={settings.temperature} · {generation.max_new_tokens} tokens"
    Console().print(result_tables(summary, about))
    console.print(f"wrote {output_dir}/results.json, results.csv and {', '.join(p.name for p in written)}")
    if interrupted is not None:
        raise interrupted


def method_settings(labels: list[str], draft_for: dict, settings: Settings) -> tuple[dict[str, Settings], dict[str, str]]:
    """The settings of each method to run, by label (plain decoding first: speedups are relative to it,
    measured in the same run), and the methods skipped for want of a draft, with why.

    A label is a method with changes of its own (`parse_variant`); its draft is `--draft-for`'s, else
    the one chat would use (`methods.effective_draft`: --draft, else the method's default). A --draft
    of the wrong kind for a method (a head for sps) fails to load later and skips that method, said.
    """
    labels = labels if PLAIN in labels else [PLAIN, *labels]
    named = set(labels) | {parse_variant(label)[0] for label in labels}
    if unknown := sorted(set(draft_for) - named):
        raise UsageError(f"--draft-for {unknown[0]}=...: {unknown[0]} is not one of the methods run ({', '.join(labels)})")
    runs, skipped = {}, {}
    for label in labels:
        name, changes = parse_variant(label)
        run = dataclasses.replace(settings, method=name, **changes)
        given = draft_for.get(label) or draft_for.get(name)
        if given:
            run = dataclasses.replace(run, draft=given)
        try:
            draft = checked_draft(run) if METHODS[name].draft else None
        except MissingDraft as missing:
            skipped[label] = f"needs a draft ({missing.draft}); give one with --draft-for {label}=PATH"
            continue
        runs[label] = dataclasses.replace(run, draft=draft)
    return runs, skipped


class BenchRuns:
    """The measured runs of a bench: each method's turns over the questions, one method at a time
    (its peak memory measured) or interleaved, with progress shown and Ctrl-C or SIGTERM stopping
    the runs with what finished kept."""

    def __init__(self, runs: dict[str, Settings], target, chat_format, generation, load_model, console: Console,
                 skipped: dict[str, str]):
        self.runs, self.target, self.chat_format = runs, target, chat_format
        self.generation, self.load_model, self.console, self.skipped = generation, load_model, console, skipped
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console)
        self.turns_total = 0

    def all(self, records, system, repeat: int, warmup: int, interleave: bool):
        """(results, peak memory by method, the Ctrl-C or SIGTERM that stopped the runs or None)."""
        self.turns_total = sum(len(r.turns) for r in records) * repeat * len(self.runs)
        with self.progress:
            self.task = self.progress.add_task("bench", total=self.turns_total, info="")
            if interleave:  # every runner at once; peak memory is then not any one method's
                return self._interleaved(records, system, repeat, warmup)
            return self._one_by_one(records, system, repeat, warmup)

    def _interleaved(self, records, system, repeat, warmup):
        results, interrupted = [], None
        opened = {label: self._open(label) for label in self.runs}
        runners = {label: pair[0] for label, pair in opened.items() if pair is not None}
        try:
            results.extend(measure.run_interleaved(runners, records, system, repeat, warmup, self._on_turn))
        except (KeyboardInterrupt, Terminated) as stop:  # consumed one by one: what finished is kept
            interrupted = stop
        finally:
            for runner in runners.values():
                runner.close()
            del runners, opened
            gc.collect()
        return results, {}, interrupted

    def _one_by_one(self, records, system, repeat, warmup):
        results, memory, interrupted = [], {}, None
        for label in self.runs:
            opened = self._open(label)
            if opened is None:
                continue
            runner, owned = opened
            try:
                with PeakMemory(self.target.device) as peak:
                    results.extend(measure.run_method(label, runner, records, system, repeat, warmup, self._on_turn))
            except (KeyboardInterrupt, Terminated) as stop:  # consumed one by one: what finished is kept
                interrupted = stop
            finally:
                memory[label] = peak.peak
                runner.close()
                del runner, owned  # the method's drafter or assistant goes before the next one is measured
                gc.collect()
            if interrupted is not None:
                break
        return results, memory, interrupted

    def _open(self, label: str):
        """The method's runner (and what it loaded), or None with the reason said and recorded."""
        try:
            return _runner(self.runs[label], self.target, self.chat_format, self.generation, self.load_model)
        except SpecchatError as error:
            self.console.print(f"skipping {label}: {error}", style="red", markup=False, highlight=False,
                               soft_wrap=True)
            self.skipped[label] = str(error)
            return None

    def _on_turn(self, result) -> None:
        speed = f"{result.tokens_per_s:.1f} tok/s"
        self.progress.advance(self.task)
        self.progress.update(self.task, description=result.method, info=speed)
        if not self.console.is_terminal:  # a log file gets no live bar: one line per turn instead
            self.console.print(f"{result.method} {self.progress.tasks[0].completed:.0f}/{self.turns_total}: question "
                               f"{result.question} turn {result.turn + 1}, {result.new_tokens} tokens, "
                               f"{speed}, τ {result.tau:.2f}", highlight=False, soft_wrap=True)


# Short headers for measure.TABLE_COLUMNS, so that a table fits an 80-column terminal or pipe; the
# legend under the tables explains them once.
SHORT_HEADERS = {"speedup": "×", "decode tok/s": "dec\ntok/s", "decode speedup": "dec\n×", "acceptance": "acc",
                 "identical": "same", "near-tie divergences": "ties", "peak MiB": "MiB"}
LEGEND = ("tok/s: new tokens per second · ×: speedup over vanilla · dec: decoding alone, after each turn's first "
          "token · τ: tokens per target forward · acc: share of draft tokens accepted · same: answers identical "
          "to vanilla's (a peer's speculation: to its own plain decoding's) · ties: differing answers that first differ at a near-tie, of how many · MiB: peak memory")
# Where the whole table is too wide, it is shown as two: these columns (speed and memory), then the
# others (drafting and output).
SPEED_COLUMNS = ("tok/s", "speedup", "decode tok/s", "decode speedup", "peak MiB")


def result_tables(summary: dict, about: str) -> Group:
    """The terminal report: a table per category (overall last), titled `category · about`, then the legend."""
    categories = sorted({c for m in summary.values() for c in m}, key=lambda c: (c == "overall", c))
    parts = []
    for category in categories:
        parts += [ResultTable(f"{category} · {about}", measure.table_rows(summary, category)), ""]
    if parts:
        parts.append(Text(LEGEND, style="dim"))
    return Group(*parts)


class ResultTable:
    """One category's rows (measure.table_rows): one table where it fits the width, else two narrower
    ones with the method column in each. Method names are never cut: a name too long even for
    the narrow tables folds onto a second line."""

    def __init__(self, title: str, rows: list[list[str]]):
        self.title, self.rows = title, rows

    def table(self, columns, title=None) -> Table:
        table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0), pad_edge=False,
                      header_style="bold")
        index = [0] + [measure.TABLE_COLUMNS.index(c) for c in columns]
        for i in index:
            name = measure.TABLE_COLUMNS[i]
            table.add_column(SHORT_HEADERS.get(name, name), justify="left" if i == 0 else "right",
                             no_wrap=name not in ("method", "near-tie divergences"), overflow="fold")
        for row in self.rows:
            table.add_row(*(row[i] for i in index))
        return table

    def __rich_console__(self, console, options):
        whole = self.table(measure.TABLE_COLUMNS[1:], self.title)
        if Measurement.get(console, options.update_width(10_000), whole).maximum <= options.max_width:
            yield whole
            return
        yield self.table([c for c in measure.TABLE_COLUMNS[1:] if c in SPEED_COLUMNS], self.title)
        yield ""
        yield self.table([c for c in measure.TABLE_COLUMNS[1:] if c not in SPEED_COLUMNS])


def parse_variant(label: str) -> tuple[str, dict]:
    """`deagle+lookup=off`: a method with method settings of its own (to compare variants in one run)."""
    name, *changes = label.split("+")
    method(name)  # known, else a MethodError
    overrides = {}
    for change in changes:
        key, _, value = change.partition("=")
        if key not in FIELDS or FIELDS[key].metadata["section"] not in METHOD_SECTIONS or not value:
            raise MethodError(f"{label}: +KEY=VALUE takes a method setting ({', '.join(k for k, f in FIELDS.items() if f.metadata['section'] in METHOD_SECTIONS)})")
        try:
            overrides[key] = parse_value(key, value)
        except LiveChatError as error:
            raise MethodError(f"{label}: {error}") from error
    return name, overrides


def _runner(settings: Settings, target, chat_format, generation, load_model):
    """The runner for `settings.method`, and whatever it loaded that should be let go afterwards."""
    entry = METHODS[settings.method]
    if entry.peer:
        return RUNNERS[entry](settings, target, chat_format, generation, load_model)
    session = app.open_session(settings, target, chat_format, generation, load_model,
                               app.answer_store(settings, target, by_default=False))  # read only: measured answers are not kept
    return SessionRunner(session), session.engine.proposer
