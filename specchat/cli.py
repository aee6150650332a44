"""The `specchat` command line: `chat`, `run` and friends.

Exit status: 0 success; 1 a runtime error (a model or head that cannot be loaded, a prompt
longer than the context, ...); 2 a usage error (bad option, profile or prompt file); 130
interrupted. Errors are one line on stderr, never a traceback (set SPECCHAT_DEBUG=1 for one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import click

from specchat import settings as settings_mod
from specchat.inputs import InputError
from specchat.settings import FIELDS, ProfileError, Settings

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandError(click.ClickException):
    """A one-line error with the exit status it should produce."""

    def __init__(self, message: str, exit_code: int = EXIT_RUNTIME):
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"specchat: error: {self.format_message()}", err=True)


class SettingOption(click.Option):
    """An option whose bad value from SPECCHAT_* names the variable, not the flag the user never typed."""

    def process_value(self, ctx, value):
        try:
            return super().process_value(ctx, value)
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
    try:
        return settings_mod.resolve({k: options.get(k) for k in FIELDS}, options.get("profile"))
    except ProfileError as error:
        raise CommandError(str(error), EXIT_USAGE) from error


def plain_unless_drafted(settings: Settings, options: dict) -> tuple[Settings, str | None]:
    """A profile's method comes with a draft for the profile's model. With another --model that has
    none, and no --method or --draft, chat and run decode plainly (and say so) rather than fail
    on a flag the user never gave. Returns the settings and the note to show, if any."""
    from specchat.heads import effective_draft, needs_draft

    if options.get("model") and not options.get("method") and not options.get("draft") \
            and needs_draft(settings.method) and not effective_draft(settings):
        note = (f"no {settings.method} draft for {settings.model}: plain decoding "
                f"(--method and --draft choose one)")
        return dataclasses.replace(settings, method="vanilla"), note
    return settings, None


def model_loader(settings: Settings):
    """`load(name, gguf_file=None)`: loads a model (the target, or a draft model) the way `settings` say."""
    from specchat.target import ModelSpec, load_target

    def load_model(name: str, gguf_file: str | None = None):
        return load_target(ModelSpec(model=name, gguf_file=gguf_file, dtype=settings.dtype, device=settings.device,
                                     quantize=settings.quantize, trust_remote_code=settings.trust_remote_code))

    return load_model


def build_session(settings: Settings, note: str | None = None):
    """Load the target (and the method's drafter) and open a chat session; `note` is shown once the
    target has loaded (so that a model that cannot load is the only message)."""
    from specchat.chat import ChatFormat, TemplateError, resolve_template
    from specchat.engine import Engine, GenerationSettings
    from specchat.sampling import SamplingParams, make_generator
    from specchat.session import ChatSession
    from specchat.target import ModelLoadError

    from drafters import HeadLoadError
    from specchat.heads import effective_draft, needs_draft
    from specchat.methods import MethodError, build_proposer

    try:
        sampling = SamplingParams(settings.temperature, settings.top_p, settings.top_k)
    except ValueError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
    if settings.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be >= 1, got {settings.max_new_tokens}", EXIT_USAGE)
    wanted = needs_draft(settings.method)
    if wanted and not effective_draft(settings):
        raise CommandError(f"--method {settings.method} needs --draft: {wanted}", EXIT_USAGE)
    load_model = model_loader(settings)
    try:
        target = load_model(settings.model, settings.gguf_file)
        chat_format = ChatFormat(target.tokenizer, template=resolve_template(settings.chat_template))
    except (ModelLoadError, TemplateError) as error:
        raise CommandError(str(error)) from error
    if note:
        click.echo(f"specchat: {note}", err=True)
    generation = GenerationSettings(max_new_tokens=settings.max_new_tokens, sampling=sampling,
                                    stop_ids=chat_format.stop_ids)
    try:
        proposer = build_proposer(settings, target, load_model)
    except MethodError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
    except (HeadLoadError, ModelLoadError) as error:
        raise CommandError(str(error)) from error
    engine = Engine(target, proposer)
    rng = make_generator(settings.seed, target.device)
    return ChatSession(engine, chat_format, generation, rng, system=settings.system)


def open_chat(settings: Settings, profile: str | None, note: str | None = None):
    """The session for `settings`, wrapped so that its method and settings can change mid-chat."""
    from specchat.live import LiveChat

    return LiveChat(build_session(settings, note), settings, profile, model_loader(settings))


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
    if not sys.stdin.isatty():
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise CommandError("empty prompt (stdin held no text)", EXIT_USAGE)
        answer_once(open_chat(settings, profile, note), prompt)
        return
    from specchat.repl import run_repl

    if note:  # now: once the prompt is up, a line from the loading thread would cut into it
        click.echo(f"specchat: {note}", err=True)
    run_repl(lambda: open_chat(settings, profile), settings.model)


def answer_once(chat, prompt: str) -> None:
    """Answer one prompt like a Unix tool: the answer on stdout, the statistics line on stderr."""
    from specchat.engine import ContextLengthError
    from specchat.ui import ChatUI

    ui = ChatUI.for_streams(info_on_stderr=True)
    writer = ui.answer(chat.session.chat_format.decoder() if chat.settings.show_accept else None)
    try:
        for event in chat.reply(prompt):
            writer.write(event)
    except ContextLengthError as error:
        raise CommandError(str(error)) from error
    finally:
        writer.close()
    ui.end_answer()
    report = chat.report()
    if chat.settings.compare:
        report.comparison = chat.compare_last_turn()
    ui.stats(report)


@cli.command()
@click.argument("inputs", nargs=-1)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default="-",
              help="Where the records go (default: stdout).")
@click.option("--format", "output_format", type=click.Choice(["jsonl", "text"]), default="jsonl", show_default=True,
              help="jsonl: one JSON record per prompt, with statistics; text: only the answers, one per turn, "
                   "with a statistics line per answer on stderr.")
@click.option("--trace", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write one JSON line per draft-verify cycle (the tree and what was accepted) to this file.")
@settings_options
def run(inputs, output, output_format, trace, **options):
    """Answer prompt files (.txt, .jsonl, or - for stdin); one JSON record per line of input."""
    from contextlib import ExitStack

    from rich.console import Console

    from specchat.inputs import read_prompts
    from specchat.ui import ChatUI

    settings, profile = resolve_settings(options)
    settings, note = plain_unless_drafted(settings, options)
    try:
        records = read_prompts(list(inputs) or ["-"])
    except InputError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
    chat = open_chat(settings, profile, note)
    failures = 0
    with ExitStack() as files:
        sink = files.enter_context(click.open_file(output, "w", encoding="utf-8", atomic=False))
        trace_file = files.enter_context(open(trace, "w", encoding="utf-8")) if trace else None
        ui = ChatUI(Console(file=sink, soft_wrap=True), Console(stderr=True, soft_wrap=True)) \
            if output_format == "text" else None
        for done, record in enumerate(records):
            try:
                result = answer_record(chat, record, settings, trace_file, ui)
            except KeyboardInterrupt:
                click.echo(f"\nspecchat: interrupted; kept the {done - failures} finished records", err=True)
                raise
            if result is None:
                failures += 1
            elif ui is None:
                sink.write(json.dumps(result, ensure_ascii=False) + "\n")
                sink.flush()  # records are written as they complete, so a failure later loses nothing
    if failures:
        raise CommandError(f"{failures} of {len(records)} prompts failed (see above)")


def answer_record(chat, record, settings: Settings, trace_file=None, ui=None) -> dict | None:
    """Answer every turn of one prompt record in a fresh conversation; None if it failed.

    With a `ui` (`--format text`), answers stream to it as they come, statistics below each.
    """
    from specchat.engine import ContextLengthError
    from specchat.heads import effective_draft
    from specchat.ui import stats_line

    session = chat.session
    session.conversation.system = record.system if record.system is not None else settings.system
    session.clear()
    session.conversation.messages.extend(record.history)
    turns = []
    for turn_index, prompt in enumerate(record.turns):
        pieces, cycle_index = [], 0
        writer = ui.answer(session.chat_format.decoder() if settings.show_accept else None) if ui else None
        try:
            for event in chat.reply(prompt):
                pieces.append(event.text)
                if writer is not None:
                    writer.write(event)
                if trace_file is not None and event.step.cycle is not None:
                    line = {"id": record.id, "turn": turn_index, "cycle": cycle_index, **event.step.cycle.record()}
                    if cycle_index == 0:
                        line["context_ids"] = session.last_prompt_ids
                    trace_file.write(json.dumps(line) + "\n")
                    cycle_index += 1
        except ContextLengthError as error:
            click.echo(f"specchat: error: {record.where}: {error}", err=True)
            return None
        finally:
            if writer is not None:
                writer.close()
        comparison = chat.compare_last_turn() if settings.compare else None
        turn = {"prompt": prompt, "response": "".join(pieces), **session.last_stats.record()}
        turns.append({**turn, **comparison.record()} if comparison else turn)
        if ui is not None:
            ui.end_answer()
            ui.note(stats_line(session.last_stats, comparison=comparison))
    return {"id": record.id, "category": record.category, "method": settings.method,
            "model": settings.model, "draft": effective_draft(settings), "turns": turns}


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
        raise CommandError("give the profile as NAME or as --profile, not both", EXIT_USAGE)
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
              help="Comma-separated methods: vanilla, eagle, eagle2, deagle, jakiro, sps, pld, hf-assisted, hf-pld.")
@click.option("--draft-for", "draft_for", multiple=True, metavar="METHOD=PATH",
              help="Draft head or model for one method (repeatable); sps and hf-assisted take a small model.")
@click.option("--limit", type=int, default=None, help="Use the first N questions (a 2-turn MT-bench question is 2 turns).")
@click.option("--repeat", type=int, default=1, show_default=True, help="Runs over the questions per method.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Warm-up answers per method (not measured).")
@click.option("--output", "-o", "output_dir", type=click.Path(file_okay=False), default="bench-results", show_default=True,
              help="Folder for results.json, results.csv and the plots.")
@settings_options
def bench_command(inputs, methods, draft_for, limit, repeat, warmup, output_dir, **options):
    """Measure methods against plain decoding on prompt files (Spec-Bench protocol)."""
    from specchat.bench_run import run_bench

    settings, profile = resolve_settings(options)
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    run_bench(list(inputs), chosen, dict(item.split("=", 1) for item in draft_for if "=" in item), settings,
              profile, limit, repeat, warmup, output_dir)


@cli.command(name="train")
@click.option("--kind", type=click.Choice(["eagle", "eagle3", "jakiro"]), required=True, help="Head format to train.")
@click.option("--data", "data_files", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="Training data (ShareGPT JSON, chat/Alpaca/prompt JSONL); repeat for several files.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder for the trained head.")
@click.option("--model", default=None, help="Target model (default: the profile's).")
@click.option("--gguf-file", default=None, help="GGUF file inside the --model folder or hub repo.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              help="Target dtype for regeneration and feature extraction.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--profile", envvar="SPECCHAT_PROFILE", help="Profile whose model is the target.")
@click.option("--regenerate/--no-regenerate", default=False,
              help="Let the target write the answers (needed for prompt-only data; better heads).")
@click.option("--regenerate-batch", type=int, default=32, show_default=True, help="Prompts per generation batch.")
@click.option("--regenerate-max-tokens", type=int, default=512, show_default=True, help="Longest regenerated answer.")
@click.option("--regenerate-temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature of regenerated answers (0: greedy).")
@click.option("--max-tokens", type=int, default=2048, show_default=True, help="Longest training sequence (tokens).")
@click.option("--limit", type=int, default=None, help="Use at most this many conversations.")
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
@click.option("--held-out", type=float, default=0.02, show_default=True, help="Share of conversations held out.")
@click.option("--eval-every", type=int, default=200, show_default=True, help="Held-out evaluation interval (steps).")
@click.option("--checkpoint-every", type=int, default=200, show_default=True, help="Checkpoint interval (steps).")
@click.option("--resume/--no-resume", default=False, help="Continue from OUTPUT/checkpoint.")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Where regenerated answers and features are kept (default: under the cache, keyed by model and data).")
@click.option("--prepare-only/--no-prepare-only", default=False, help="Stop after regeneration and feature extraction.")
@click.option("--max-shard-mb", type=float, default=None,
              help="Split the weights into indexed shards of at most this many MB (default: one file).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for shuffling, splitting and initialisation.")
def train_command(kind, data_files, output, model, gguf_file, dtype, device, profile, regenerate, regenerate_batch,
                  regenerate_max_tokens, regenerate_temperature, max_tokens, limit, draft_vocab, intermediate_size,
                  ttt_steps, epochs, max_steps, lr, warmup, batch_tokens, held_out, eval_every, checkpoint_every,
                  resume, work_dir, prepare_only, max_shard_mb, seed):
    """Train an EAGLE, EAGLE-3 or Jakiro draft head for a target model."""
    from pathlib import Path

    from specchat.target import ModelLoadError, ModelSpec, load_target
    from specchat.train import data as data_mod
    from specchat.train import pipeline
    from specchat.train.trainer import TrainConfig
    from specchat.ui import TrainingProgress

    settings, _ = resolve_settings({"model": model, "gguf_file": gguf_file, "profile": profile})
    try:
        target = load_target(ModelSpec(model=settings.model, gguf_file=settings.gguf_file, dtype=dtype, device=device))
    except ModelLoadError as error:
        raise CommandError(str(error)) from error
    target.model.requires_grad_(False)
    options = pipeline.PrepareOptions(
        data=list(data_files), regenerate=regenerate, regenerate_batch=regenerate_batch,
        regenerate_max_tokens=regenerate_max_tokens, regenerate_temperature=regenerate_temperature,
        max_tokens=max_tokens, limit=limit, held_out=held_out, seed=seed)
    work = Path(work_dir) if work_dir else pipeline.default_work_dir(settings.model, options)
    log = lambda message: click.echo(f"specchat train: {message}", err=True)  # noqa: E731
    log(f"work folder {work}")
    with TrainingProgress() as bars:
        try:
            store, summary = pipeline.prepare(target, options, work, need_aux=kind == "eagle3", log=log,
                                              progress=bars.stage)
        except (data_mod.DataError, pipeline.TrainError) as error:
            raise CommandError(str(error), EXIT_USAGE) from error
        if prepare_only:
            log(f"prepared {len(store)} sequences in {work}")
            return
        summary["held_out_fraction"] = held_out
        config = TrainConfig(kind=kind, learning_rate=lr, warmup_steps=warmup, epochs=epochs, max_steps=max_steps,
                             batch_tokens=batch_tokens, ttt_steps=ttt_steps, draft_vocab=draft_vocab,
                             intermediate_size=intermediate_size, eval_every=eval_every,
                             checkpoint_every=checkpoint_every, seed=seed)
        shard = int(max_shard_mb * 2**20) if max_shard_mb else None
        record = pipeline.train_head(target, store, config, Path(output), summary, resume, log, bars.training, shard)
    accuracy = record["held_out_top1"][-1]["top1_by_step"] if record["held_out_top1"] else []
    log(f"wrote {output} ({record['steps']} steps, {record['tokens_seen']:,} tokens; "
        f"held-out top-1 by step {accuracy})")


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, standalone_mode=False, prog_name="specchat")
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
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
    except (RuntimeError, ValueError, OSError, MemoryError) as error:
        # Anything not already turned into a message: one line, unless a traceback is asked for.
        if os.environ.get("SPECCHAT_DEBUG"):
            raise
        click.echo(f"specchat: error: {type(error).__name__}: {error} (SPECCHAT_DEBUG=1 shows where)", err=True)
        sys.exit(EXIT_RUNTIME)
