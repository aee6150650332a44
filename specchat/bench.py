"""`specchat bench`: every method against plain decoding on the same prompts, as Spec-Bench does it.

Protocol (Spec-Bench, hemingkx/Spec-Bench `evaluation/speed.py`): the same prompts and settings
for every method, warm-up runs first, multi-turn questions answered turn by turn in one
conversation (each method continues from its own answers). Per question, speed = its new tokens /
its wall time (prefill included); a method's speedup = mean per-question speed / that of vanilla
measured in the same run. tau = new tokens / target forward passes (bonus included); at
temperature 0 the identical-output rate counts the turns whose answer equals vanilla's.

Peers run in the same process on the same target: `hf-assisted` (transformers assisted
generation with a smaller model of the same tokenizer as assistant) and `hf-pld` (transformers
prompt lookup). Their target forwards are counted with a forward hook.

Peak memory is the largest resident set size sampled while a method runs (CUDA: peak allocated).
"""

from __future__ import annotations

import csv
import gc
import json
import math
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specchat.inputs import PromptRecord
from specchat.session import Rates

PEER_METHODS = ("hf-assisted", "hf-pld")
ALL_METHODS = ("vanilla", "eagle", "eagle2", "deagle", "jakiro", "sps", "pld") + PEER_METHODS
HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens default
RSS_SAMPLE_SECONDS = 0.05
CALIBRATION_BINS = 10


@dataclass
class TurnResult(Rates):
    method: str
    question: object
    category: str | None
    turn: int
    repeat: int
    response: str
    new_tokens: int
    seconds: float
    target_forwards: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    cycles: list[dict] = field(default_factory=list)  # trace records (tree, accepted), for the plots


# ---------------------------------------------------------------------------------------------
# Runners: one way of answering a conversation turn


class SessionRunner:
    """A specchat method: the engine with the method's proposer."""

    def __init__(self, session):
        self.session = session

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.session.conversation.system = record.system if record.system is not None else system
        self.session.clear()
        self.session.conversation.messages.extend(record.history)

    def turn(self, prompt: str) -> dict:
        text, cycles = [], []
        for event in self.session.reply(prompt):
            text.append(event.text)
            if event.step.cycle is not None:
                cycles.append(event.step.cycle.record())
        stats = self.session.last_stats
        return {"response": "".join(text), "new_tokens": stats.new_tokens, "seconds": stats.seconds,
                "target_forwards": stats.target_forwards, "draft_tokens": stats.draft_tokens,
                "accepted_tokens": stats.accepted_tokens, "accept_lengths": stats.accept_lengths, "cycles": cycles}


class GenerateRunner:
    """A transformers `generate` peer (assisted generation or prompt lookup) on the same target."""

    def __init__(self, target, chat_format, settings, generate_kwargs: dict, rng_seed: int | None):
        self.target, self.chat_format, self.settings = target, chat_format, settings
        self.kwargs = generate_kwargs
        self.seed = rng_seed
        self.forwards = 0
        self._hook = target.model.register_forward_pre_hook(self._count)  # every target forward passes here
        self.conversation = None

    def close(self) -> None:
        self._hook.remove()

    def _count(self, module, args) -> None:
        self.forwards += 1

    def start(self, record: PromptRecord, system: str | None) -> None:
        from specchat.chat import Conversation

        self.conversation = Conversation(system=record.system if record.system is not None else system)
        self.conversation.messages.extend(record.history)

    @torch.inference_mode()
    def turn(self, prompt: str) -> dict:
        self.conversation.add_user(prompt)
        ids = torch.tensor([self.chat_format.prompt_ids(self.conversation)], device=self.target.device)
        sampling = self.settings.sampling
        if not sampling.greedy and self.seed is not None:
            torch.manual_seed(self.seed)
        self.forwards = 0
        start = time.perf_counter()
        output = self.target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.settings.max_new_tokens,
            do_sample=not sampling.greedy, temperature=sampling.temperature or None,
            top_p=sampling.top_p if not sampling.greedy else None, top_k=sampling.top_k or None,
            eos_token_id=sorted(self.settings.stop_ids), pad_token_id=min(self.settings.stop_ids), **self.kwargs)
        seconds = time.perf_counter() - start
        new = output[0, ids.shape[1]:].tolist()
        decoder = self.chat_format.decoder()
        decoder.push(new)
        decoder.flush()
        self.conversation.add_assistant(decoder.text)
        return {"response": decoder.text, "new_tokens": len(new), "seconds": seconds,
                "target_forwards": self.forwards, "draft_tokens": 0, "accepted_tokens": 0,
                "accept_lengths": [], "cycles": []}


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
                outcome = runner.turn(prompt)
                result = TurnResult(method=method, question=record.id, category=record.category, turn=index,
                                    repeat=repeat, **outcome)
                results.append(result)
                on_turn(result)
    return results


def summarize(results: list[TurnResult], greedy: bool) -> dict:
    """Per method and category (and overall): speed, speedup, tau, acceptance, identical rate."""
    by_method = defaultdict(list)
    for result in results:
        by_method[result.method].append(result)
    vanilla_answers = {(r.question, r.turn, r.repeat): r.response for r in by_method.get("vanilla", [])}
    summary = {}
    for method, rows in by_method.items():
        categories = sorted({r.category or "all" for r in rows})
        summary[method] = {}
        for category in ["overall"] + (categories if len(categories) > 1 else []):
            chosen = [r for r in rows if category == "overall" or (r.category or "all") == category]
            summary[method][category] = _aggregate(chosen, vanilla_answers if greedy else None)
    vanilla = summary.get("vanilla", {})
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
    tokens = sum(r.new_tokens for r in rows)
    forwards = sum(r.target_forwards for r in rows)
    drafted = sum(r.draft_tokens for r in rows)
    out = {
        "questions": len(per_question), "turns": len(rows), "new_tokens": tokens,
        "tokens_per_s": round(sum(speeds) / len(speeds), 3) if speeds else 0.0,
        "tau": round(tokens / forwards, 3) if forwards else None,
        "acceptance_rate": round(sum(r.accepted_tokens for r in rows) / drafted, 4) if drafted else None,
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    methods = [m for m in summary if m != "vanilla"]
    # 1. Speedup by method and category.
    categories = sorted({c for m in summary.values() for c in m if c != "overall"}) + ["overall"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(methods)) / 3), 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [summary[method].get(c, {}).get("speedup") or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over vanilla (tokens/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, folder / "speedup.png"))
    # 2. Draft confidence against measured acceptance (EAGLE-2's calibration figure).
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in methods:
        points = calibration(results, method)
        if points:
            ax.plot([p for p, _, _ in points], [a for _, a, _ in points], marker="o", label=method)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("draft confidence of a node (given its parent)")
    ax.set_ylabel("measured acceptance rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, folder / "calibration.png"))
    # 3. Acceptance by tree depth.
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in methods:
        lengths = [n - 1 for r in results if r.method == method for n in r.accept_lengths]
        if lengths:
            deepest = max(lengths)
            ax.plot(range(1, deepest + 1), [sum(a >= d for a in lengths) / len(lengths) for d in range(1, deepest + 1)],
                    marker="o", label=method)
    ax.set_xlabel("tree depth d")
    ax.set_ylabel("share of cycles accepting >= d draft tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, folder / "acceptance_by_depth.png"))
    # 4. Peak memory.
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(memory)), 4))
    ax.bar(list(memory), list(memory.values()))
    ax.set_ylabel("peak memory (MiB)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    written.append(_save(fig, folder / "memory.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


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


def release(*objects) -> None:
    """Let a method's models and caches go before the next method is measured."""
    del objects
    gc.collect()
