"""The bench's measurement: every method against plain decoding on the same prompts, as Spec-Bench does it.

Protocol (Spec-Bench, hemingkx/Spec-Bench `evaluation/speed.py`): the same prompts and settings
for every method, warm-up runs first, multi-turn questions answered turn by turn in one
conversation (each method continues from its own answers). Per question, speed = its new tokens /
its wall time (prefill included); a method's speedup = mean per-question speed / that of vanilla
measured in the same run. The decoding phase is also reported on its own (tokens after the first
per second after the first token; `specchat.speedup`), since prefill cost depends on the cache
and not on the method. tau = new tokens / target forward passes (bonus included). At temperature
0 the identical-output rate counts the turns whose answer equals vanilla's (a peer's speculation:
its own runtime's plain decoding's, when that ran too), and each answer that differs from it in
the same conversation is located: the first differing token and the plain answer's top-2 logit
margin there (where its runner gives one), so a near-tie (rounding) is told from a real difference.

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
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specchat.bench import breakdown
from specchat.chat import ChatSession, Conversation, Turn
from specchat.inputs import PromptRecord
from specchat.methods import PLAIN, plain_of
from specchat.speedup import Divergence, decoding_rate, divergence
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
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    cycles: list[dict] = field(default_factory=list)
    compared: bool = False  # with its plain decoding's answer in the same conversation (set by `summarize`)
    divergence: Divergence | None = None  # where it first differs from that answer


# ---------------------------------------------------------------------------------------------
# Runners: one way of answering a conversation turn


class SessionRunner:
    """A specchat method: the engine with the method's proposer.

    A runner answers the turns of one record after `start`; `turn` returns the reply's record
    (`specchat.chat.Turn`: text, tokens, statistics, draft cycles). The peers of `specchat.peers`
    are runners too.
    """

    def __init__(self, session: ChatSession):
        self.session = session

    def close(self) -> None:
        pass

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.session.conversation = Conversation.opening(record, system)
        self.session.engine.forget()  # each question on its own, as Spec-Bench answers them: no lookup of earlier ones

    def turn(self, prompt: str) -> Turn:
        for _ in self.session.reply(prompt):
            pass
        return self.session.last_turn


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
               on_turn) -> Iterator[TurnResult]:
    """Warm up on the first question, then answer every question `repeats` times (results as they come)."""
    for _ in range(warmup):
        _warm_up(runner, records[0], system)
    for repeat in range(repeats):
        for record in records:
            yield from answer_question(method, runner, record, system, repeat, on_turn)


def run_interleaved(runners: dict, records: list[PromptRecord], system: str | None, repeats: int, warmup: int,
                    on_turn) -> Iterator[TurnResult]:
    """Every method answers a question before the next question is asked, so that a machine whose
    speed drifts during the run (a shared or throttling CPU) slows every method alike."""
    for runner in runners.values():
        for _ in range(warmup):
            _warm_up(runner, records[0], system)
    for repeat in range(repeats):
        for record in records:
            for method, runner in runners.items():
                yield from answer_question(method, runner, record, system, repeat, on_turn)


def _warm_up(runner, record: PromptRecord, system: str | None) -> None:
    runner.start(record, system)
    runner.turn(record.turns[0])


def answer_question(method: str, runner, record: PromptRecord, system: str | None, repeat: int,
                    on_turn) -> list[TurnResult]:
    """Every turn of one question, in one conversation."""
    results = []
    runner.start(record, system)
    for index, prompt in enumerate(record.turns):
        answer = runner.turn(prompt)
        result = TurnResult(method=method, question=record.id, category=record.category, turn=index,
                            repeat=repeat, response=answer.text, tokens=answer.tokens, margins=answer.margins,
                            cycles=[cycle.record() for cycle in answer.cycles], **vars(answer.stats))
        results.append(result)
        on_turn(result)
    return results


def summarize(results: list[TurnResult], greedy: bool) -> dict:
    """Per method and category (and overall): speed, speedup, tau, acceptance, identical rate, divergences."""
    by_method = defaultdict(list)
    for result in results:
        by_method[result.method].append(result)
    if greedy:
        locate_divergences(results)
    summary = {}
    for method, rows in by_method.items():
        categories = sorted({r.category or "all" for r in rows})
        summary[method] = {}
        for category in ["overall"] + (categories if len(categories) > 1 else []):
            chosen = [r for r in rows if category == "overall" or (r.category or "all") == category]
            summary[method][category] = _aggregate(chosen, compared=greedy and plain_of(method) in by_method)
            if greedy and (selection := selection_record(chosen)) is not None:
                summary[method][category]["selection"] = selection
    vanilla = summary.get(PLAIN, {})
    for method, categories in summary.items():
        for category, numbers in categories.items():
            for rate, ratio in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
                base = vanilla.get(category, {}).get(rate)
                numbers[ratio] = round(numbers[rate] / base, 3) if base and numbers[rate] is not None else None
    return summary


def locate_divergences(results: list[TurnResult]) -> None:
    """Compare each turn with its plain decoding's answer (vanilla's; a peer's own runtime's:
    `methods.plain_of`) where both saw the same conversation: a question's first turn, and later
    turns while every earlier answer was identical to the plain one."""
    answers = {(r.method, r.question, r.turn, r.repeat): r for r in results}
    by_conversation = defaultdict(list)
    for r in results:
        by_conversation[(r.method, r.question, r.repeat)].append(r)
    for (method, _, _), turns in by_conversation.items():
        for r in sorted(turns, key=lambda t: t.turn):
            plain = answers.get((plain_of(method), r.question, r.turn, r.repeat))
            if plain is None:
                break
            r.compared = True
            if r.tokens and plain.tokens:
                r.divergence = divergence(r.tokens, plain.tokens, plain.margins)
            elif r.response != plain.response:  # a runner that gave no token ids: the text tells
                r.divergence = Divergence(None, None)
            if r.divergence is not None:
                break  # the next turn's conversation is another one


def _aggregate(rows: list[TurnResult], compared: bool) -> dict:
    per_question = defaultdict(Stats)
    for r in rows:
        per_question[(r.question, r.repeat)] += r
    speeds = [q.tokens_per_s for q in per_question.values() if q.seconds > 0]
    turns_of = Counter((r.question, r.repeat) for r in rows)
    # Tokens after each turn's first, per second after it; only where every turn timed its prefill.
    decode = [decoding_rate(q.new_tokens - turns_of[key] + 1, q.seconds, q.prefill_seconds)
              for key, q in per_question.items()] if all(r.prefill_seconds > 0 for r in rows) else []
    decode = [rate for rate in decode if rate is not None]
    total = Stats()
    for r in rows:
        total += r
    out = {
        "questions": len(per_question), "turns": len(rows), "new_tokens": total.new_tokens,
        "tokens_per_s": round(sum(speeds) / len(speeds), 3) if speeds else 0.0,
        "decode_tokens_per_s": round(sum(decode) / len(decode), 3) if decode else None,
        "tau": None if total.tau is None else round(total.tau, 3),
        "acceptance_rate": None if total.acceptance_rate is None else round(total.acceptance_rate, 4),
        # Hybrid drafting: the share of accepted draft tokens the lookup proposed, and its cost per cycle.
        "lookup_share": round(total.accepted_from_lookup / total.accepted_tokens, 4) if total.accepted_tokens else None,
        "lookup_ms_per_cycle": round(1000 * total.lookup_seconds / len(total.accept_lengths), 3)
        if total.lookup_seconds and total.accept_lengths else None,
        "identical": None, "compared": None, "diverged": None, "near_tie_share": None,
        # Depth of the deepest verified node per cycle, and (DEAGLE) the depth where drafting stopped.
        "tree_depth": _mean([max(c["depths"]) for r in rows for c in r.cycles if c.get("depths")]),
        "stop_depth": _mean([c["stop_depth"] for r in rows for c in r.cycles if "stop_depth" in c]),
        "breakdown": breakdown.cycle_breakdown(total, len(rows)),  # ms per cycle by part (--breakdown)
        "arms": {arm: round(share, 4) for arm, share in total.arm_shares().items()},  # decoding steps by draft source
    }
    checked = [r for r in rows if r.compared]
    if compared and checked:
        diverged = [r for r in checked if r.divergence is not None]
        out.update(identical=round(1 - len(diverged) / len(checked), 4), compared=len(checked), diverged=len(diverged))
        with_margin = [r for r in diverged if r.divergence.margin is not None]
        if with_margin:
            out["near_tie_share"] = round(sum(r.divergence.near_tie for r in with_margin) / len(with_margin), 4)
    return out


def selection_record(rows: list[TurnResult]) -> dict | None:
    """At temperature 0, how well a hybrid drafter's selection chose, from the cycles that say what
    their tree was chosen from (`tree.Offer`): the answer says which of all the candidates the
    target would have accepted, verified or not. Per source (head, lookup, both), the candidates'
    mean expected acceptance (what the selection valued them at) against how often they would have
    been accepted; and per cycle, the accepted tokens an oracle verifying just the accepted path among
    the same candidates would have gained beyond the tree's (`missed_per_cycle`). None: no such cycles."""
    sources = defaultdict(lambda: [0, 0.0, 0])  # candidates, their expected acceptance, accepted
    cycles = missed = 0
    for row in rows:
        root = 0  # the answer's index of the cycle's root: the prefill gave the first token
        for cycle in row.cycles:
            offer = cycle.get("candidates")
            if root >= len(row.tokens) or row.tokens[root] != cycle["root"]:
                break  # the answer does not hold this turn's cycles as drafted (never expected): skip the rest
            if offer is not None and "values" in offer:
                accepted, depths = _would_accept(offer["tokens"], offer["parents"], row.tokens, root)
                if all(a is not None for a in accepted):  # not where the answer ends before a candidate does
                    cycles += 1
                    missed += max((d for d, hit in zip(depths, accepted) if hit), default=0) - len(cycle["accepted"])
                    for node, (value, hit) in enumerate(zip(offer["values"], accepted)):
                        slot = sources[offer["sources"][node] if "sources" in offer else "head"]
                        slot[0], slot[1], slot[2] = slot[0] + 1, slot[1] + value, slot[2] + hit
            root += len(cycle["accepted"]) + 1
    if not cycles:
        return None
    return {"cycles": cycles, "missed_per_cycle": round(missed / cycles, 3),
            "by_source": {source: {"candidates": n, "expected": round(expected / n, 4), "accepted": round(hits / n, 4)}
                          for source, (n, expected, hits) in sorted(sources.items())}}


def _would_accept(tokens: list[int], parents: list[int], answer: list[int],
                  root: int) -> tuple[list[bool | None], list[int]]:
    """Per candidate (parents before children), whether greedy verification would accept its path
    after the answer's token `root` (None where the answer ends before the candidate's position),
    and its depth."""
    depths, accepted = [], []
    for token, parent in zip(tokens, parents):
        depths.append(1 if parent < 0 else depths[parent] + 1)
        above = True if parent < 0 else accepted[parent]
        at = root + depths[-1]
        accepted.append(None if above is None or at >= len(answer) else above and answer[at] == token)
    return accepted, depths


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
        if legend and ax.get_legend_handles_labels()[0]:
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
    # 4. Peak memory (not measured when the methods ran interleaved).
    if memory:
        fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(memory)), 4))
        ax.bar(list(memory), list(memory.values()))
        ax.tick_params(axis="x", rotation=30)
        save(fig, ax, "memory.png", None, "peak memory (MiB)", legend=False)
    # 5. Where a cycle's time goes (--breakdown).
    written += [path for path in [breakdown.plot(plt, folder, summary)] if path]
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


TABLE_COLUMNS = ("method", "tok/s", "speedup", "decode tok/s", "decode speedup", "τ", "acceptance", "identical",
                 "near-tie divergences", "peak MiB")


def table_rows(summary: dict, category: str) -> list[list[str]]:
    """The rows of the terminal table (TABLE_COLUMNS) for one category."""
    def show(value, fmt):
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    rows = []
    for method, categories in summary.items():
        numbers = categories.get(category)
        if numbers:
            near_ties = "–" if not numbers.get("diverged") or numbers["near_tie_share"] is None else \
                f"{numbers['near_tie_share']:.0%} of {numbers['diverged']}"
            rows.append([method, show(numbers["tokens_per_s"], ".2f"), show(numbers["speedup"], ".2f"),
                         show(numbers["decode_tokens_per_s"], ".2f"), show(numbers["decode_speedup"], ".2f"),
                         show(numbers["tau"], ".2f"), show(numbers["acceptance_rate"], ".1%"),
                         show(numbers["identical"], ".0%"), near_ties, show(numbers.get("peak_memory_mib"), ".0f")])
    return rows
