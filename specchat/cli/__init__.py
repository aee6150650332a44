"""The `specchat` command line: `chat`, `run`, `serve`, `bench`, `profiles` and `runtime-check` here; `data`,
`train` and `export-head` (the draft heads' commands) in `specchat.cli.heads`, registered below.

Commands only parse their options and hand them to the assembly layer (`specchat.app`), the
batch runner (`specchat.batch`), the server (`specchat.serve`), the bench (`specchat.bench`) or
the runtime check (`specchat.runtime_check`, which parses its own). Exit status: 0 success;
1 a runtime error (a model or head that cannot be loaded, a prompt longer than the context, ...);
2 a usage error (bad option, profile or prompt file); 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM, handled like Ctrl-C: finished records kept, temporary files removed). Errors are one
line on stderr, never a traceback (set SPECCHAT_DEBUG=1 for one).

torch and transformers load only inside the commands that need them (marked where imported),
so `--help`, `profiles` and the chat prompt come up at once; the REPL's prompt_toolkit only for a
chat in a terminal. `--verbose` says the start's phases, each with the seconds since the process
started (the decoding core's debug lines, `specchat.logs`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
from contextlib import ExitStack, contextmanager

import click
from rich.console import Console

import specchat
from specchat import serve as serving
from specchat import settings as settings_mod
from specchat.cli import cache, heads
from specchat.errors import SpecchatError, Terminated, UsageError, summary
from specchat.inputs import atomic_output, check_outputs, read_prediction, read_prompts, read_stdin
from specchat.logs import show_core_messages
from specchat.methods import METHODS, bench_methods, drafted_for_model
from specchat.settings import FALSE_WORDS, FIELDS, TRUE_WORDS, ProfileError, Settings
from specchat.ui import ChatUI

log = logging.getLogger(__name__)

EXIT_OK, EXIT_INTERRUPTED = 0, 130
EXIT_RUNTIME, EXIT_USAGE, EXIT_TERMINATED = SpecchatError.exit_code, UsageError.exit_code, Terminated.exit_code
# A group called without its command: click 8.2 and later raise this usage error, whose message is the
# group's help (click 8.1 shows the help itself and exits; then nothing is caught here)
NO_COMMAND_GIVEN = getattr(click.exceptions, "NoArgsIsHelpError", ())
terminal_chat_ran = False  # set by `chat` when its terminal chat starts: main() then leaves at once
piped_chat_ran = False  # set by `chat` when it answers a pipe: main() then leaves at once, run as the command itself


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


def command_settings(options: dict, verbose: bool) -> tuple[Settings, str, str | None]:
    """What a command that answers prompts (chat, run, serve) runs with: the resolved settings, the
    profile, and the note `drafted_for_model` has for them; the core's messages shown from here
    on (with `verbose`, the start's phases)."""
    show_core_messages(verbose)
    settings, profile = resolve_settings(options)
    settings, note = drafted_for_model(settings, options)
    return settings, profile, note


def open_chat(settings: Settings, profile: str, note: str | None = None, answers_by_default: bool = False):
    """The chat for `settings`; `note` is shown once the target has loaded (so that a model that
    cannot load gives the only message); `answers_by_default`: `--answer-index auto` means on."""
    log.debug("read the command line")
    if log.isEnabledFor(logging.DEBUG) and (note_on_bytecode := compiles_at_each_start()):  # (--verbose only)
        log.debug(note_on_bytecode)
    with collector_paused():
        from specchat import app  # torch loads here (and transformers, where the model needs it: specchat.sources)
    log.debug("imported torch and specchat's decoding core")
    return app.open_chat(settings, profile, (lambda: click.echo(f"specchat: {note}", err=True)) if note else None,
                         answers_by_default)


def compiles_at_each_start() -> str | None:
    """Why this start compiled specchat's own modules, where it did: Python may not write compiled
    copies (PYTHONDONTWRITEBYTECODE, `-B`: many container images set it) and an editable install
    has none (pip compiles a wheel's as it installs); else None. 0.08-0.22 s of a 1.6 s warm start
    on an AVX-512 Xeon, and every start figure measured before 2026-11-30's last paid it."""
    if not sys.dont_write_bytecode or os.path.exists(importlib.util.cache_from_source(specchat.__file__)):
        return None
    return ("Python may not keep compiled modules here (PYTHONDONTWRITEBYTECODE or -B) and specchat has none: "
            "every start compiles them (~0.1-0.2 s)")


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for a block. Importing torch and specchat's core makes some
    hundred thousand objects that live as long as the process; the collector's passes over them free
    nothing and took ~0.1 s of a 1.8 s warm start (an Intel Xeon, AVX-512). Only the imports: a first
    start's conversions leave cyclic garbage the collector must free (paused through the whole load,
    the 1.5B's first start peaked at 7.1 GB instead of 5.8 and spent 21 s of system time instead of 14)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


VERBOSE = click.option("--verbose", is_flag=True,
                       help="Say the start's phases on stderr, each with the seconds since the process started "
                            "(imports, finding the model, the kernel, loading, the draft, the first token).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="specchat")
def cli():
    """Chat with a local LLM, faster, through lossless speculative decoding."""


@cli.command()
@click.option("--predict", metavar="FILE", default=None,
              help="Text the answers will mostly repeat (the file being edited, say): every answer is drafted "
                   "from it too (OpenAI's predicted outputs); the answers stay exactly the model's.")
@VERBOSE
@settings_options
def chat(predict, verbose, **options):
    """Chat in the terminal; with a pipe on stdin, answer what it holds and exit."""
    settings, profile, note = command_settings(options, verbose)
    prediction = read_prediction(predict) if predict is not None else None

    def opened(note: str | None = None):
        chat = open_chat(settings, profile, note, answers_by_default=True)
        chat.set_prediction(prediction, predict)
        return chat

    if sys.stdout is None or sys.stdout.closed:
        raise UsageError("standard output is closed: the answers would have nowhere to go")
    if sys.stdin is None or not sys.stdin.isatty():
        prompt = read_stdin()
        if not prompt.strip():
            raise UsageError("empty prompt (stdin held no text)")
        global piped_chat_ran
        piped_chat_ran = True
        chat = opened(note)  # (torch is loaded now)
        from specchat.batch import answer_piped

        answer_piped(chat, prompt)
        return
    if note:  # now: once the prompt is up, a line from the loading thread would cut into it
        click.echo(f"specchat: {note}", err=True)
    global terminal_chat_ran
    terminal_chat_ran = True  # however the chat ends, main() then ends the process at once
    from specchat.repl import run_repl  # prompt_toolkit loads here: a piped prompt has no use for it

    run_repl(opened, settings.model)


@cli.command()
@click.argument("inputs", nargs=-1)
@click.option("--output", "-o", type=click.Path(dir_okay=False, allow_dash=True), default="-",
              help="Where the records go (default: stdout).")
@click.option("--format", "output_format", type=click.Choice(["jsonl", "text"]), default="jsonl", show_default=True,
              help="jsonl: one JSON record per prompt, with statistics; text: only the answers, one per turn, "
                   "with a statistics line per answer on stderr.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line per draft-verify cycle (the tree, what was accepted and the candidates the "
                   "tree was chosen from) to this file.")
@click.option("--atomic/--no-atomic", default=False,
              help="Write --output to a temporary file and put it in place when the run ends: an interrupted "
                   "run then leaves the old file untouched instead of the records finished so far.")
@VERBOSE
@settings_options
def run(inputs, output, output_format, trace, atomic, verbose, **options):
    """Answer prompt files (.txt, .jsonl, or - for stdin); one JSON record per line of input."""
    settings, profile, note = command_settings(options, verbose)
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


@cli.command()
@click.option("--host", default=serving.DEFAULT_HOST, show_default=True,
              help="Where to listen; beyond this machine (not a loopback address) an API key is required.")
@click.option("--port", type=click.IntRange(0, 65535), default=serving.DEFAULT_PORT, show_default=True, help="The port.")
@click.option("--api-key", envvar="SPECCHAT_API_KEY", default=None, show_envvar=False,
              help="Clients must send 'Authorization: Bearer KEY' (also SPECCHAT_API_KEY).")
@click.option("--served-model-name", default=None, help="The model's name for clients (default: --model's value).")
@click.option("--max-waiting", type=click.IntRange(0), default=serving.MAX_WAITING, show_default=True,
              help="Requests queued behind the one being answered before new ones get 429.")
@VERBOSE
@settings_options
def serve(host, port, api_key, served_model_name, max_waiting, verbose, **options):
    """Serve the model behind an OpenAI-compatible endpoint (POST /v1/chat/completions)."""
    settings, profile, note = command_settings(options, verbose)
    if not serving.is_local(host) and not api_key:
        raise UsageError(f"--host {host} serves beyond this machine: give an API key (--api-key or SPECCHAT_API_KEY)")
    serving.check_installed()
    from specchat.serve import app as server  # starlette, uvicorn and torch load here

    server.serve(open_chat(settings, profile, note), host, port, api_key, served_model_name, max_waiting)


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
@click.option("--methods", default=None,
              help=f"Comma-separated methods: {', '.join(METHODS)}; METHOD+KEY=VALUE gives one a method setting of "
                   "its own (deagle+lookup=off). [default: vanilla, the profile's method, pld]")
@click.option("--draft-for", "draft_for", multiple=True, metavar="METHOD=PATH",
              help="Draft head or model for one method (repeatable); sps and hf-assisted take a small model.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use the first N questions (a 2-turn MT-bench question is 2 turns).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Runs over the questions per method.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Warm-up answers per method (not measured).")
@click.option("--interleave", is_flag=True,
              help="Every method answers each question in turn (a drifting machine slows all alike); no peak memory.")
@click.option("--breakdown", is_flag=True,
              help="Time where each decoding cycle goes (products, attention, rest of the forward, drafting, "
                   "bookkeeping): results.json and breakdown.png.")
@click.option("--output", "-o", "output_dir", type=click.Path(file_okay=False), default="bench-results", show_default=True,
              help="Folder for results.json, results.csv and the plots.")
@settings_options
def bench_command(inputs, methods, draft_for, limit, repeat, warmup, interleave, breakdown, output_dir, **options):
    """Measure methods against plain decoding on prompt files (Spec-Bench protocol)."""
    from specchat.bench import run_bench  # torch and transformers load here

    settings, profile = resolve_settings(options)
    if methods is None:  # the method chat would run, also where --model has no draft for the profile's
        settings, _ = drafted_for_model(settings, options)
    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods is not None else bench_methods(settings)
    run_bench(list(inputs), chosen, draft_paths(draft_for), settings, profile, limit, repeat, warmup, output_dir,
              interleave, breakdown)


def draft_paths(items: tuple[str, ...]) -> dict[str, str]:
    """--draft-for's METHOD=PATH items by method (a label with settings of its own keeps its `=`:
    deagle+lookup=off=PATH)."""
    paths = {}
    for item in items:
        label, _, path = item.rpartition("=")
        if not label or not path:
            raise UsageError(f"--draft-for {item}: expected METHOD=PATH")
        paths[label] = path
    return paths


@cli.command(name="runtime-check", add_help_option=False, context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def runtime_check_command(args):
    """Measure the decoding runtime's own cost: a real model's shape, random weights, an oracle drafter."""
    from specchat import runtime_check  # torch and transformers load here; it parses its own options (--help)

    runtime_check.main(list(args))


cli.add_command(heads.data)
cli.add_command(heads.train_command)
cli.add_command(heads.export_head_command)
cli.add_command(cache.cache)


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

    A piped chat ends so too, once its answer is out, where `main` runs the process's own command
    line (the `specchat` script, `python -m specchat`; not a caller's, whose interpreter goes on):
    the shutdown's clearing of torch's modules took ~1 s of a 5-6 s piped start on 2 Zen 3 cores.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or the reader went away
            pass
    os._exit(code if isinstance(code, int) else EXIT_OK if code is None else EXIT_RUNTIME)


def main(argv: list[str] | None = None) -> None:
    global terminal_chat_ran, piped_chat_ran
    terminal_chat_ran = piped_chat_ran = False
    with sigterm_raises_terminated():
        try:
            run_command(argv)
            exit_code = None
        except SystemExit as done:
            exit_code = done.code
        except Terminated as stop:  # SIGTERM while an error was being reported
            click.echo(f"specchat: {stop.message}", err=True)
            exit_code = EXIT_TERMINATED
    if terminal_chat_ran or (piped_chat_ran and argv is None):
        leave_at_once(exit_code)
    if exit_code is not None:
        sys.exit(exit_code)


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
    except NO_COMMAND_GIVEN as asked:  # `specchat` (or `specchat data`) alone: the help, not an error line
        click.echo(asked.format_message(), err=True)
        sys.exit(EXIT_USAGE)
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
        click.echo(f"specchat: error: {summary(error)} (SPECCHAT_DEBUG=1 shows where)", err=True)
        sys.exit(EXIT_RUNTIME)
