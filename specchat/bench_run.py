"""Running `specchat bench`: load the target once, run each method in turn, report.

Kept apart from `specchat.bench` (measurement, statistics, plots) so those stay free of I/O on
models and terminals. A long run shows progress and can be interrupted with Ctrl-C: whatever
finished is summarised and written.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specchat import bench
from specchat.bench import ALL_METHODS, PEER_METHODS, GenerateRunner, PeakMemory, SessionRunner


def run_bench(inputs: list[str], methods: list[str], draft_for: dict, settings, profile: str, limit, repeat: int,
              warmup: int, output_dir: str) -> None:
    from specchat.chat import ChatFormat, resolve_template
    from specchat.cli import EXIT_USAGE, CommandError, model_loader
    from specchat.engine import Engine, GenerationSettings
    from specchat.inputs import InputError, read_prompts
    from specchat.heads import default_draft, needs_draft
    from specchat.methods import MethodError, build_proposer
    from specchat.sampling import SamplingParams, make_generator
    from specchat.session import ChatSession
    from specchat.target import ModelLoadError

    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise CommandError(f"unknown method {', '.join(unknown)} (known: {', '.join(ALL_METHODS)})", EXIT_USAGE)
    if "vanilla" not in methods:
        methods = ["vanilla"] + methods  # speedups are relative to vanilla measured in the same run
    try:
        records = read_prompts(inputs)[: limit or None]
    except InputError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
    try:
        sampling = SamplingParams(settings.temperature, settings.top_p, settings.top_k)
    except ValueError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
    console = Console(stderr=True)
    load_model = model_loader(settings)
    target = load_model(settings.model, settings.gguf_file)
    chat_format = ChatFormat(target.tokenizer, template=resolve_template(settings.chat_template))
    generation = GenerationSettings(max_new_tokens=settings.max_new_tokens, sampling=sampling,
                                    stop_ids=chat_format.stop_ids)
    drafts, skipped = {}, {}
    for method in methods:
        wanted = needs_draft(method) or ("a smaller model with the same tokenizer" if method == "hf-assisted" else None)
        # A --draft of the wrong kind for a method (a head for sps) fails to load and skips that method, said.
        draft = (draft_for.get(method) or settings.draft or default_draft(method, settings.model)) if wanted else None
        if wanted and not draft:
            skipped[method] = f"needs a draft ({wanted}); give one with --draft-for {method}=PATH"
        drafts[method] = draft
    for method, reason in skipped.items():
        console.print(f"[yellow]skipping {method}: {reason}[/yellow]")
    methods = [m for m in methods if m not in skipped]
    turns_total = sum(len(r.turns) for r in records) * repeat * len(methods)
    results, memory, meta = [], {}, {
        "inputs": inputs, "questions": len(records), "methods": methods, "drafts": drafts, "skipped": skipped,
        "model": settings.model, "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
        "max_new_tokens": generation.max_new_tokens, "temperature": settings.temperature, "repeat": repeat,
        "warmup": warmup, "profile": profile, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "specchat " + " ".join(sys.argv[1:]),
    }
    from specchat.train.trainer import hardware

    meta["hardware"] = hardware()
    interrupted = False
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console)
    with progress:
        task = progress.add_task("bench", total=turns_total, info="")
        for method in methods:
            progress.update(task, description=method)
            method_settings = dataclasses.replace(settings, method=method if method not in PEER_METHODS else "vanilla",
                                                  draft=drafts.get(method))
            try:
                runner, owned = _runner(method, method_settings, target, chat_format, generation, make_generator,
                                        build_proposer, Engine, ChatSession, load_model)
            except (MethodError, ModelLoadError, ValueError, OSError) as error:  # HeadLoadError is a ValueError
                console.print(f"[red]skipping {method}: {error}[/red]")
                skipped[method] = str(error)
                continue

            def on_turn(result, method=method):
                speed = f"{result.tokens_per_s:.1f} tok/s"
                progress.advance(task)
                progress.update(task, info=speed)
                if not console.is_terminal:  # a log file gets no live bar: one line per turn instead
                    console.print(f"{method} {progress.tasks[0].completed:.0f}/{turns_total}: question "
                                  f"{result.question} turn {result.turn + 1}, {result.new_tokens} tokens, "
                                  f"{speed}, τ {result.tau:.2f}", highlight=False)

            try:
                with PeakMemory(target.device) as peak:
                    results += bench.run_method(method, runner, records, settings.system, repeat, warmup, on_turn)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                memory[method] = peak.peak
                if isinstance(runner, GenerateRunner):
                    runner.close()
                bench.release(runner, owned)
            if interrupted:
                break
    meta["interrupted"] = interrupted
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    summary = bench.summarize(results, greedy=generation.sampling.greedy)
    written = bench.write_outputs(Path(output_dir), results, summary, memory, meta)
    categories = sorted({c for m in summary.values() for c in m}, key=lambda c: (c == "overall", c))
    for category in categories:
        table = Table(title=f"{category} · {settings.model} · T={settings.temperature} · {generation.max_new_tokens} tokens")
        for column in ("method", "tok/s", "speedup", "τ", "acceptance", "identical", "peak MiB"):
            table.add_column(column, justify="right" if column != "method" else "left")
        for row in bench.table_rows(summary, category):
            table.add_row(*row)
        Console().print(table)
    console.print(f"wrote {output_dir}/results.json, results.csv and {', '.join(p.name for p in written)}")
    if interrupted:
        raise KeyboardInterrupt


def _runner(method, settings, target, chat_format, generation, make_generator, build_proposer, Engine, ChatSession,
            load_model):
    """The runner for a method, and whatever it loaded that should be released afterwards."""
    if method == "hf-pld":
        return GenerateRunner(target, chat_format, generation, {"prompt_lookup_num_tokens": bench.HF_PLD_TOKENS},
                              settings.seed), None
    if method == "hf-assisted":
        assistant = load_model(settings.draft)
        return GenerateRunner(target, chat_format, generation, {"assistant_model": assistant.model}, settings.seed), assistant
    proposer = build_proposer(settings, target, load_model)
    rng = make_generator(settings.seed if settings.seed is not None else 0, target.device)
    session = ChatSession(Engine(target, proposer), chat_format, generation, rng, system=settings.system)
    return SessionRunner(session), proposer
