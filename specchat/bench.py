"""`specchat bench`: every method against plain decoding on the same prompts, as Spec-Bench does it.

Protocol (Spec-Bench, hemingkx/Spec-Bench `evaluation/speed.py`): the same prompts and settings
for every method, warm-up runs first, multi-turn questions answered turn by turn in one
conversation (each method continues from its own answers). Per question, speed = its new tokens /
its wall time (prefill included); a method's speedup = mean per-question speed / that of vanilla
measured in the same run. tau = new tokens / target forward passes (bonus included); at
temperature 0 the identical-output rate counts the turns whose answer equals vanilla's.

Peers (`specchat.peers`) run other tools' implementations on the same target and prompts: every
runner answers a turn and returns the same statistics record (`specchat.stats.Stats`).

Peak memory is the largest resident set size sampled while a method runs (CUDA: peak allocated).
"""

from __future__ import annotations

import csv
import json
import math
import os
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specchat.chat import ChatSession
from specchat.inputs import PromptRecord
from specchat.methods import PLAIN
from specchat.stats import Stats

RSS_SAMPLE_SECONDS = 0.05
CALIBRATION_BINS = 10


@dataclass(kw_only=True)
class TurnResult(Stats):
    """One answered turn: which it was, the answer, its statistics and its draft cycles."""

    method: str
    question: object
    category: str | None
    turn: int
    repeat: int
    response: str
    cycles: list[dict] = field(default_factory=list)  # trace records (tree, accepted), for the plots


# ---------------------------------------------------------------------------------------------
# Runners: one way of answering a conversation turn


class SessionRunner:
    """A specchat method: the engine with the method's proposer.

    A runner answers the turns of one record after `start`; `turn` returns the answer, its
    statistics and its draft cycles. The peers of `specchat.peers` are runners too.
    """

    def __init__(self, session: ChatSession):
        self.session = session

    def close(self) -> None:
        pass

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.session.conversation.system = record.system if record.system is not None else system
        self.session.clear()
        self.session.conversation.messages.extend(record.history)

    def turn(self, prompt: str) -> tuple[str, Stats, list[dict]]:
        text, cycles = [], []
        for event in self.session.reply(prompt):
            text.append(event.text)
            if event.step.cycle is not None:
                cycles.append(event.step.cycle.record())
        return "".join(text), self.session.last_stats, cycles


# ---------------------------------------------------------------------------------------------
# Memory


class PeakMemory:
    """Largest resident set size (or CUDA allocation) while the context is open, in MiB."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0.0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> float:
        try:
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return 0.0

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_SECONDS):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())
        return False


# ---------------------------------------------------------------------------------------------
# Running


def run_method(method: str, runner, records: list[PromptRecord], system: str | None, repeats: int, warmup: int,
               on_turn) -> list[TurnResult]:
    """Warm up on the first question, then answer every question `repeats` times."""
    results = []
    for _ in range(warmup):
        runner.start(records[0], system)
        runner.turn(records[0].turns[0])
    for repeat in range(repeats):
        for record in records:
            runner.start(record, system)
            for index, prompt in enumerate(record.turns):
                response, stats, cycles = runner.turn(prompt)
                result = TurnResult(method=method, question=record.id, category=record.category, turn=index,
                                    repeat=repeat, response=response, cycles=cycles, **vars(stats))
                results.append(result)
                on_turn(result)
    return results


def summarize(results: list[TurnResult], greedy: bool) -> dict:
    """Per method and category (and overall): speed, speedup, tau, acceptance, identical rate."""
    by_method = defaultdict(list)
    for result in results:
        by_method[result.method].append(result)
    vanilla_answers = {(r.question, r.turn, r.repeat): r.response for r in by_method.get(PLAIN, [])}
    summary = {}
    for method, rows in by_method.items():
        categories = sorted({r.category or "all" for r in rows})
        summary[method] = {}
        for category in ["overall"] + (categories if len(categories) > 1 else []):
            chosen = [r for r in rows if category == "overall" or (r.category or "all") == category]
            summary[method][category] = _aggregate(chosen, vanilla_answers if greedy else None)
    vanilla = summary.get(PLAIN, {})
    for method, categories in summary.items():
        for category, numbers in categories.items():
            base = vanilla.get(category, {}).get("tokens_per_s")
            numbers["speedup"] = round(numbers["tokens_per_s"] / base, 3) if base else None
    return summary


def _aggregate(rows: list[TurnResult], vanilla_answers: dict | None) -> dict:
    per_question = defaultdict(lambda: [0, 0.0])
    for r in rows:
        per_question[(r.question, r.repeat)][0] += r.new_tokens
        per_question[(r.question, r.repeat)][1] += r.seconds
    speeds = [tokens / seconds for tokens, seconds in per_question.values() if seconds > 0]
    total = Stats()
    for r in rows:
        total += r
    out = {
        "questions": len(per_question), "turns": len(rows), "new_tokens": total.new_tokens,
        "tokens_per_s": round(sum(speeds) / len(speeds), 3) if speeds else 0.0,
        "tau": None if total.tau is None else round(total.tau, 3),
        "acceptance_rate": None if total.acceptance_rate is None else round(total.acceptance_rate, 4),
        "identical": None,
        # Depth of the deepest verified node per cycle, and (DEAGLE) the depth where drafting stopped.
        "tree_depth": _mean([max(c["depths"]) for r in rows for c in r.cycles if c.get("depths")]),
        "stop_depth": _mean([c["stop_depth"] for r in rows for c in r.cycles if "stop_depth" in c]),
    }
    if vanilla_answers:
        compared = [r for r in rows if (r.question, r.turn, r.repeat) in vanilla_answers]
        if compared:
            same = sum(r.response == vanilla_answers[(r.question, r.turn, r.repeat)] for r in compared)
            out["identical"] = round(same / len(compared), 4)
    return out


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


# ---------------------------------------------------------------------------------------------
# Output


def write_outputs(folder: Path, results: list[TurnResult], summary: dict, memory: dict, meta: dict) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for method, peak in memory.items():
        for numbers in summary.get(method, {}).values():
            numbers["peak_memory_mib"] = round(peak, 1)
    records = [{k: v for k, v in asdict(r).items() if k != "cycles"} for r in results]
    (folder / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "turns": records}, indent=1))
    with open(folder / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        columns = ["tokens_per_s", "speedup", "tau", "acceptance_rate", "identical", "tree_depth", "stop_depth",
                   "peak_memory_mib", "questions", "turns", "new_tokens"]
        writer.writerow(["method", "category"] + columns)
        for method, categories in summary.items():
            for category, numbers in categories.items():
                writer.writerow([method, category] + [numbers.get(c) for c in columns])
    return plot(folder, results, summary, memory)


def plot(folder: Path, results: list[TurnResult], summary: dict, memory: dict) -> list[Path]:
    # matplotlib loads only when plots are written, and draws off-screen.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, ax, name: str, xlabel: str | None, ylabel: str, legend: bool = True) -> None:
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if legend:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=120)
        plt.close(fig)
        written.append(folder / name)

    methods = [m for m in summary if m != PLAIN]
    # 1. Speedup by method and category.
    categories = sorted({c for m in summary.values() for c in m if c != "overall"}) + ["overall"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(methods)) / 3), 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [summary[method].get(c, {}).get("speedup") or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    save(fig, ax, "speedup.png", None, "speedup over vanilla (tokens/s)")
    # 2. Draft confidence against measured acceptance (EAGLE-2's calibration figure).
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in methods:
        points = calibration(results, method)
        if points:
            ax.plot([p for p, _, _ in points], [a for _, a, _ in points], marker="o", label=method)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=0.8)
    save(fig, ax, "calibration.png", "draft confidence of a node (given its parent)", "measured acceptance rate")
    # 3. Acceptance by tree depth.
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in methods:
        lengths = [n - 1 for r in results if r.method == method for n in r.accept_lengths]
        if lengths:
            deepest = max(lengths)
            ax.plot(range(1, deepest + 1), [sum(a >= d for a in lengths) / len(lengths) for d in range(1, deepest + 1)],
                    marker="o", label=method)
    save(fig, ax, "acceptance_by_depth.png", "tree depth d", "share of cycles accepting >= d draft tokens")
    # 4. Peak memory.
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(memory)), 4))
    ax.bar(list(memory), list(memory.values()))
    ax.tick_params(axis="x", rotation=30)
    save(fig, ax, "memory.png", None, "peak memory (MiB)", legend=False)
    return written


def calibration(results: list[TurnResult], method: str) -> list[tuple[float, float, int]]:
    """(mean confidence, acceptance rate, count) per confidence bin, over the nodes that were reachable:
    children of the root or of an accepted node."""
    bins = defaultdict(lambda: [0.0, 0, 0])
    for result in results:
        if result.method != method:
            continue
        for cycle in result.cycles:
            accepted = set(cycle["accepted"])
            for node, (parent, prob) in enumerate(zip(cycle["parents"], cycle["probs"])):
                if parent == -1 or parent in accepted:
                    slot = bins[min(CALIBRATION_BINS - 1, int(prob * CALIBRATION_BINS))]
                    slot[0] += prob
                    slot[1] += node in accepted
                    slot[2] += 1
    return [(total / count, hits / count, count) for _, (total, hits, count) in sorted(bins.items()) if count]


def table_rows(summary: dict, category: str) -> list[list[str]]:
    def show(value, fmt):
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    rows = []
    for method, categories in summary.items():
        numbers = categories.get(category)
        if numbers:
            rows.append([method, show(numbers["tokens_per_s"], ".2f"), show(numbers["speedup"], ".2f"),
                         show(numbers["tau"], ".2f"), show(numbers["acceptance_rate"], ".1%"),
                         show(numbers["identical"], ".0%"), show(numbers.get("peak_memory_mib"), ".0f")])
    return rows
