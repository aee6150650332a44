"""The stages on the GPU machine (`device`): the runtime check and the CUDA tests, the bench,
answering the prompts, training the head; run in the call, or detached as a chain that outlives it
(`--detach`, `--wait`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import click

from specchat.train.agenda import plan
from specchat.train.agenda.back import back
from specchat.train.agenda.pieces import receive

class Stages:
    """The stages of one call, each logged to $OUT/agenda.log and timed in $OUT/agenda.json."""

    def __init__(self, out: Path):
        self.out, self.started, self.record = out, time.monotonic(), {"stages": []}
        self.env = {**os.environ, "PYTHONPATH": f"{plan.THERE / 'site'}:{Path.cwd()}", "HF_HUB_OFFLINE": "1",
                    "XDG_CACHE_HOME": str(plan.THERE / "cache"), "PYTHONUNBUFFERED": "1"}

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def run(self, stage: str, *command: str, log: str | None = None, env: dict | None = None) -> int:
        """One command, its output shown and kept in $OUT/LOG (appended), its status and time recorded."""
        started = time.monotonic()
        click.echo(f"[agenda {self.minutes():.1f} min] {stage}: {' '.join(command)}", err=True)
        with open(self.out / (log or f"{stage}.log"), "a") as sink:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env={**self.env, **(env or {})})
            for line in process.stdout:
                sys.stderr.write(line)
                sink.write(line)
            status = process.wait()
        return self._recorded(stage, command, status, started)

    def _recorded(self, stage: str, command: tuple[str, ...], status: int, started: float, **extra) -> int:
        """A finished stage's status and time into $OUT/agenda.json; its status."""
        self.record["stages"].append({"stage": stage, "command": list(command), "status": status,
                                      "seconds": round(time.monotonic() - started, 1), **extra})
        (self.out / "agenda.json").write_text(json.dumps(self.record, indent=1) + "\n")
        return status

    def beside(self, stage: str, *command: str) -> Callable[[], int]:
        """Start one command beside the stages that follow, its output kept in $OUT/STAGE.log; the
        returned function waits for it and records its status and time."""
        started, sink = time.monotonic(), open(self.out / f"{stage}.log", "a")
        click.echo(f"[agenda {self.minutes():.1f} min] {stage} (beside what follows): {' '.join(command)}", err=True)
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=self.env)

        def finish() -> int:
            status = process.wait()
            sink.close()
            return self._recorded(stage, command, status, started, beside=True)
        return finish

    def specchat(self, stage: str, *args: str, log: str | None = None, env: dict | None = None) -> int:
        return self.run(stage, sys.executable, "-m", "specchat", *args, log=log, env=env)


@click.command()
@click.argument("piece", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--check", is_flag=True,
              help="The runtime check on random weights of the real shapes (the engine's fixed envelope eager, "
                   "regeneration's slot steps, the envelope compiled), and the CUDA tests.")
@click.option("--bench", is_flag=True,
              help="specchat bench on the real 0.5B (plain decoding, the default, prompt lookup).")
@click.option("--answer-minutes", type=float, default=None, help="Answer the prompts (both temperatures) this long.")
@click.option("--train-minutes", type=float, default=None,
              help="Train the EAGLE-3 head this long (resumes); detached, at most what --deadline-in leaves.")
@click.option("--train-rate", type=float, default=plan.PLANNED_TRAIN_RATE, show_default=True,
              help="Training tokens per second planned: the learning-rate schedule ends after the steps that "
                   "--train-minutes take at this rate (more data than that is not seen twice).")
@click.option("--batch", type=int, default=plan.REGENERATE_SLOTS, show_default=True, help="Sequences answered at once.")
@click.option("--model", default=None, help="The target to answer with and train for (default: the embedded 0.5B).")
@click.option("--device", "where", default="cuda", show_default=True, help="Where to answer and train.")
@click.option("--back", "bring_back", is_flag=True,
              help="After answering and after training: the answers not brought back yet and the head, in pieces.")
@click.option("--detach", is_flag=True,
              help="Run the stages in a process session of their own, on a copy of this checkout, and return at "
                   "once: they outlive the call (the machine stays while calls follow), those that need the model "
                   "wait for its last piece, and --wait brings their results back.")
@click.option("--deadline-in", type=float, default=None,
              help="Seconds of device time the block has left: a detached training stage ends in time for the way back.")
@click.option("--wait", "wait_for", type=click.Choice(plan.CHAIN_STAGES), default=None,
              help="Wait for the detached stages up to this one (or --limit), then bring back what they left.")
@click.option("--limit", type=float, default=540, show_default=True, help="Seconds --wait waits at most.")
@click.option("--chain", is_flag=True, hidden=True)  # the detached process itself
def device(piece, check, bench, answer_minutes, train_minutes, train_rate, batch, model, where, bring_back, detach,
           deadline_in, wait_for, limit, chain):
    """On the GPU machine: take PIECE in, then run the stages asked for, in the agenda's order."""
    target = ("--device", where) + (("--model", model) if model else ())
    out = _chain() if chain else Path(os.environ.get("OUT", plan.THERE / "out"))
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages(out)
    if not chain:
        missing = receive(piece)
        click.echo(f"[agenda] {len(missing)} files still to come" + (f" ({missing[0]}, ...)" if missing else ": all here"),
                   err=True)
        if not missing:
            (plan.THERE / "ready").touch()
        if deadline_in is not None:
            (plan.THERE / "deadline").write_text(str(time.time() + deadline_in))
        if detach:
            flags = [flag for flag, asked in (("--check", check), ("--bench", bench), ("--back", bring_back)) if asked]
            for flag, value in (("--answer-minutes", answer_minutes), ("--train-minutes", train_minutes),
                                ("--train-rate", train_rate), ("--batch", batch), ("--model", model), ("--device", where)):
                flags += [flag, str(value)] if value is not None else []
            return _detach(flags)
        if wait_for:
            return _gather(wait_for, limit, out)
        if missing and (bench or answer_minutes or train_minutes):
            raise click.ClickException("the model, heads or prompts are not all here yet: send the other pieces first")

    def finished(stage: str) -> None:  # for --wait
        if chain:
            (_chain() / f"{stage}.done").touch()

    tests = None
    tests_beside = check and chain and bool(train_minutes)  # beside answering and training, after the bench
    if check:
        stages.run("gpu", "nvidia-smi", "-L", log="runtime-0.5b.log")
        # The fixed envelope eager; regeneration's slot steps (15,176 answers took 158 s on the
        # 2026-11-26 second block's H200, ~21 ms a step at 512 slots where a few ms were planned: the
        # slot check says where); then the envelope with the compiled forward (the whole forward's
        # first step shapes were still compiling after 150 s there; it now compiles one layer).
        # None may take the block.
        # Last, the seeds' scale (issue 49): Llama 3.1 8B's shape, random weights, τ 2-5 and a random
        # head of the published EAGLE-3 head's layout.
        envelope = ("--shape", "qwen2.5-0.5b", "--runtime", "fixed", "--tokens", "128", "--head", "--nodes", "7", "63",
                    "--repeats", "2")
        for stage, options in (("runtime-0.5b", envelope),
                               ("runtime-slots", ("--shape", "qwen2.5-0.5b", "--runtime", "none", "--slots", *plan.SLOT_COUNTS,
                                                  "--spans", "256", "1024")),
                               ("runtime-0.5b-compiled", (*envelope, "--compile")),
                               ("runtime-8b", ("--shape", "llama-3.1-8b", "--runtime", "fixed", "--tokens", "64", "--head",
                                               "--nodes", "7", "63", "--depths", "1", "2", "3", "4", "--repeats", "1"))):
            stages.run(stage, "timeout", "150", sys.executable, *plan.RUNTIME_CHECK, *options,
                       "--trace", str(plan.THERE / "trace" / stage), "-o", str(out / f"{stage}.json"))
        _tar_within(plan.THERE / "trace", out / "trace.tgz")
        if not tests_beside:
            stages.run("test-cuda", *plan.CUDA_TESTS)
        finished("check")
    if chain and (bench or answer_minutes or train_minutes):
        while not (plan.THERE / "ready").is_file():  # the foreground call that brought the last piece says so
            time.sleep(2)
        receive(None)  # the heads into this checkout
    if bench:  # the default as a user gets it (on CUDA: captured steps, their forward compiled)
        stages.specchat("bench", "bench", "docs/prompts/cpu10.jsonl", "--device", "cuda", "--methods", plan.BENCH_METHODS,
                        "--limit", "5", "--max-new-tokens", "128", "--temperature", "0", "-o", str(plan.THERE / "bench"))
        _tar_within(plan.THERE / "bench", out / "bench.tgz")
        finished("bench")
    if tests_beside:  # they check correctness, not speed: never beside the bench
        tests = stages.beside("test-cuda", *plan.CUDA_TESTS)
    if answer_minutes:
        stages.specchat("regenerate", "data", "regenerate", str(plan.THERE / "data"), *target, "--batch", str(batch),
                        "--max-minutes", f"{answer_minutes:g}")
        stages.specchat("status", "data", "status", str(plan.THERE / "data"), log="status.txt")
        if bring_back:
            back(_stage_out(out, "answer", chain))
        finished("answer")
    if train_minutes:
        minutes = _train_minutes(train_minutes) if chain else train_minutes
        # --trace: where a step's time goes (issue 49: twice today's tokens a second, said where before
        # choosing how); the summary comes back with the logs, the phases in the head's training.json.
        traced = plan.THERE / "trace" / "train"
        stages.specchat("train", "train", *plan.TRAIN_ARGS, *target, "--data", str(plan.THERE / "data"),
                        "--work-dir", str(plan.THERE / "work"), "-o", str(plan.THERE / "head"), "--max-minutes", f"{minutes:g}",
                        "--max-steps", str(max(1, int(60 * minutes * train_rate / plan.TRAIN_BATCH_TOKENS))),
                        "--trace", str(traced))
        if (traced / "train-summary.txt").is_file():
            shutil.copy(traced / "train-summary.txt", out / "trace-train-summary.txt")
        if tests is not None:
            tests()
        if bring_back:
            back(_stage_out(out, "train", chain))
        finished("train")
    click.echo(f"[agenda] done in {stages.minutes():.1f} min", err=True)


def _detach(flags: list[str]) -> None:
    """Start `device --chain FLAGS` in a new process session, from a copy of this checkout (the
    next call lays the checkout anew under it), its output in the chain's log."""
    source = plan.THERE / "src"
    shutil.rmtree(source, ignore_errors=True)
    # Not the hidden folders (.gpu's pieces, a virtual environment, .git) nor caches.
    shutil.copytree(Path.cwd(), source, symlinks=True, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info"))
    shutil.rmtree(_chain(), ignore_errors=True)
    _chain().mkdir(parents=True)
    argv = ["--chain", *flags]
    with open(_chain() / "chain.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "specchat.train.agenda", "device", *argv], cwd=source, stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (_chain() / "pid").write_text(str(process.pid))
    click.echo(f"[agenda] detached: device {' '.join(argv)} (log: {_chain() / 'chain.log'})", err=True)


def _stage_out(out: Path, stage: str, chain: bool) -> Path:
    """Where a stage's returned pieces go: this call's $OUT, or the chain's folder for the stage."""
    if not chain:
        return out
    (out / stage).mkdir(exist_ok=True)
    return out / stage


def _train_minutes(asked: float) -> float:
    """The training minutes a detached chain can give: what it was asked, or what the block's
    deadline leaves after loading, the last evaluation and the way back, at least one."""
    deadline = plan.THERE / "deadline"
    if not deadline.is_file():
        return asked
    left = (float(deadline.read_text()) - time.time() - plan.TRAIN_OVERHEAD_SECONDS) / 60
    return max(1.0, min(asked, int(100 * left) / 100))  # down to the hundredth


def _gather(stage: str, limit: float, out: Path) -> None:
    """Wait until the chain has finished `stage` (or has ended, or `limit` seconds), then put its
    logs (one tarball) and the pieces that stage left into $OUT."""
    ends = time.monotonic() + limit
    while time.monotonic() < ends and not (_chain() / f"{stage}.done").is_file() and _chain_running():
        time.sleep(2)
    pieces = sorted((_chain() / stage).glob("*.tgz.*"))  # where `_stage_out` put them
    with tarfile.open(out / f"{stage}-logs.tgz", "w:gz") as tar:
        tar.add(_chain(), arcname="chain", filter=lambda info: None if ".tgz." in info.name else info)
    for path in pieces:
        shutil.copy(path, out / path.name)
    click.echo((_chain() / "chain.log").read_text()[-4000:], err=True)
    state = "finished" if (_chain() / f"{stage}.done").is_file() else "NOT finished"
    click.echo(f"[agenda] {stage} {state}; back: {', '.join(sorted(p.name for p in out.iterdir()))}", err=True)


def _chain() -> Path:
    """The detached stages' folder: their logs, results and returned pieces (a folder per stage)."""
    return plan.THERE / "chain"


def _chain_running() -> bool:
    """Whether the detached chain's process is still there."""
    pid = _chain() / "pid"
    if not pid.is_file():
        return False
    try:
        os.kill(int(pid.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def _tar_within(folder: Path, target: Path) -> None:
    """`folder` as a gzipped tarball, if it is there and fits one returned file."""
    if folder.is_dir():
        with tarfile.open(target, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)
        if target.stat().st_size > plan.BACK_PIECE:
            target.unlink()
            click.echo(f"[agenda] {folder.name} is larger than a returned file: left there", err=True)


