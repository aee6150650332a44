"""Bench peers that run in a Python environment of their own (OpenVINO GenAI, vLLM).

Each pins its own torch, transformers and more, so it lives in a virtual environment beside
specchat's; an environment variable names that environment's Python (`find_python`), and the
peer runs there as a worker subprocess (`specchat.peers.worker`, whose docstring gives the
JSON-lines protocol). Its log (the runtime's own output) goes to `<cache>/peers/<name>.log`.
What a peer runs is exported once into specchat's cache (`exported_once`) and reused.

`WorkerRunner` is the bench runner around a worker: the same conversations, prompt token ids (the
model's own chat template), answers and statistics as specchat's own methods (τ = new tokens /
target forwards, the prefill's included).
"""

from __future__ import annotations

import hashlib
from importlib import metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from specchat.chat import ChatFormat, Turn
from specchat.decode import GenerationSettings, cache_dir
from specchat.errors import SpecchatError
from specchat.peers import ConversationRunner, PeerUnavailable
from specchat.stats import Stats

# Run as a file, by the other environment's Python with -I: isolated, which also keeps the worker's own
# folder off its path, where this package's vllm.py and openvino.py would shadow the runtimes it imports.
WORKER = Path(__file__).with_name("worker.py")
COMPLETE = "specchat-export.json"  # written last into an exported folder: its presence means "complete"


class PeerFailed(SpecchatError):
    """A peer's worker refused a request or ended (its log says more)."""


def find_python(variable: str, distribution: str, what: str, recipe: str) -> str:
    """The Python that has `distribution` installed: the one `$variable` names, else this one if it has it."""
    given = os.environ.get(variable)
    if given:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise PeerUnavailable(f"{variable}={given} is not a Python to run (expected e.g. /path/venv/bin/python)")
        return given
    try:
        metadata.version(distribution)
        return sys.executable
    except metadata.PackageNotFoundError:
        raise PeerUnavailable(f"needs {what} in a virtual environment of its own ({recipe}) named by "
                              f"{variable}=/that/venv/bin/python") from None


def run_tool(command: list[str], log: Path, what: str, env: dict | None = None) -> None:
    """Run an export tool of the peer's environment, its output into `log`; a failure is one line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        status = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                check=False).returncode
    if status != 0:
        raise PeerFailed(f"{what} failed ({last_line(log)}; the whole output: {log})")


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def exported_once(kind: str, sources: list[Path], make: Callable[[Path], None]) -> Path:
    """The folder `make(folder)` exports from `sources` into the cache, made the first time (under
    a lock, into a temporary folder renamed at the end) and reused while the sources are unchanged."""
    stamp = hashlib.sha256(json.dumps(
        [[str(path.resolve()), [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in sorted(path.iterdir())
                                if f.is_file()]] for path in sources]).encode()).hexdigest()[:16]
    folder = cache_dir() / "peers" / f"{kind}-{stamp}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / COMPLETE).is_file():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
            make(partial)
            (partial / COMPLETE).write_text(json.dumps({"kind": kind, "sources": [str(s) for s in sources]}) + "\n")
            partial.rename(folder)
    return folder


def end(process: subprocess.Popen, ask: Callable[[], None], seconds: float) -> None:
    """End a peer's process: `ask` it to, then kill it if it has not ended within `seconds`."""
    if process.poll() is None:
        ask()
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Worker:
    """A `specchat.peers.worker` process in another environment, loaded and answering requests."""

    def __init__(self, python: str, load: dict, name: str, env: dict[str, str]):
        self.name = name
        self.log = cache_dir() / "peers" / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([python, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, text=True,
                                            env={**os.environ, **env})
        try:
            self.about = self.ask({"op": "load", **load})["about"]
        except PeerFailed as error:
            self.close()
            raise PeerUnavailable(f"{name} did not load: {error}") from error

    def ask(self, request: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise PeerFailed(f"its worker ended ({last_line(self.log)}; its log: {self.log})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise PeerFailed(f"{reply['error']} (its log: {self.log})")
        return reply

    def close(self) -> None:
        end(self.process, self.process.stdin.close, seconds=60)  # the end of its input ends the worker


class PeerRunner(ConversationRunner):
    """A bench runner answering through a peer's own process (`peer`: a `Worker`, or
    `specchat.peers.llamacpp.LlamaServer`), which ends with the runner."""

    def __init__(self, peer, chat_format: ChatFormat, settings: GenerationSettings, seed: int | None):
        super().__init__()
        self.peer, self.chat_format, self.settings = peer, chat_format, settings
        self.seed = 0 if seed is None else seed

    def close(self) -> None:
        self.peer.close()


class WorkerRunner(PeerRunner):
    """A bench runner answering through a worker."""

    def turn(self, prompt: str) -> Turn:
        self.conversation.add_user(prompt)
        sampling = self.settings.sampling
        reply = self.peer.ask({
            "op": "generate", "prompt": self.chat_format.prompt_ids(self.conversation),
            "max_new_tokens": self.settings.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": self.seed, "stop": sorted(self.settings.stop_ids)})
        return self.answered(reply["tokens"], Stats(
            new_tokens=len(reply["tokens"]), seconds=reply["seconds"], prefill_seconds=reply["first_token_seconds"],
            target_forwards=reply["forwards"], draft_tokens=reply["draft_tokens"], accepted_tokens=reply["accepted_tokens"]))
