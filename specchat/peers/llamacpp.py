"""llama.cpp as `specchat bench` peers: its binding's decoding, and its own EAGLE-3 speculation with specchat's head.

- `llamacpp`: llama.cpp (llama-cpp-python, the optional extra `peers`) decoding the very GGUF file
  the target was loaded from, with the same threads; `llamacpp-lookup`: the same with its prompt
  lookup decoding. This is what most CPU users run (ollama wraps it), so it is the number to beat.
  Sampling is the plain distribution (temperature only: no top-k 40, min-p or repetition penalty
  of its defaults).
- `llamacpp-eagle3`: llama.cpp speculating with an EAGLE-3 head itself (`--spec-type draft-eagle3`),
  and `export-head --format llamacpp`, the head as it reads it.

The binding does not expose llama.cpp's EAGLE-3 loop, so `llamacpp-eagle3` runs llama.cpp's own
server, `llama-server`, built from the llama.cpp that llama-cpp-python's source distribution
vendors (the same llama.cpp as the binding's: BUILD), in a process of its own on the target's GGUF
file, answering the bench's prompts as token ids over its HTTP API on localhost. It drafts with
llama.cpp's defaults as a user gets them (a chain of up to 3 tokens).

The head reaches llama.cpp as a GGUF written by llama.cpp's own converter (`convert_hf_to_gguf.py`
and the `gguf` package of that source tree; PyPI's gguf 0.19.0 lacks the EAGLE-3 architecture) from
vLLM's speculators layout, whose `eagle_aux_hidden_state_layer_ids` name the target layers whose
*inputs* the head reads, as llama.cpp reads them (`llama_set_embeddings_layer_inp`), and whose
`norm_before_residual` says which layer the head has. The converter takes the target's Hugging Face
folder for its vocabulary (llama.cpp checks that draft and target share it) and hidden size.

SPECCHAT_LLAMACPP_DIR names that source tree with its build (default: `<cache>/peers/llama.cpp`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from drafters import Verifier
from specchat import exports, methods
from specchat.chat import ChatFormat, Turn
from specchat.decode import GenerationSettings, Target, cache_dir
from specchat.peers import PEER_CONTEXT, ConversationRunner, PeerUnavailable
from specchat.peers.process import PeerFailed, PeerRunner, end, exported_once, last_line, run_tool
from specchat.peers.worker import with_stop
from specchat.settings import Settings
from specchat.sources import locate, resolve_folder, source_gguf
from specchat.stats import Stats

# llama-cpp-python's LlamaPromptLookupDecoding defaults (16-36 tok/s with 10 tokens here, measured 2026-11-22).
LOOKUP_TOKENS, LOOKUP_NGRAM = 10, 2
TOOLS_DIR = "SPECCHAT_LLAMACPP_DIR"
VERSION = "0.3.36"  # llama-cpp-python's, as the `peers` extra pins it: the same llama.cpp as the `llamacpp` peers
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # built with GCC 12, ggml's AMX matmul segfaults at the first decode
# The binding (the `llamacpp` peers), built as llama-server is (BUILD): native, without AMX.
BINDING_BUILD = (f"CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'\" "
                 "pip install 'specchat[peers]'")
# Its EAGLE-3 path reads the target's layer inputs where a model's graph exposes them, which this llama.cpp's Qwen2
# graph does not (its first request aborts: "layer input tensor is null"): one line, as its Llama graph has it.
QWEN2_PATCH = ("sed -i 's|^    for (int il = 0; il < n_layer; ++il) {$|&\\n        res->t_layer_inp[il] = inpL;|' "
               '"$D/src/models/qwen2.cpp"')
BUILD = (f'D=${{{TOOLS_DIR}:-~/.cache/specchat/peers/llama.cpp}}; mkdir -p "$D" && '
         f'pip download --no-deps --no-binary :all: llama-cpp-python=={VERSION} -d "$D" && '
         f'tar xzf "$D/llama_cpp_python-{VERSION}.tar.gz" -C "$D" --strip-components=3 '
         f'llama_cpp_python-{VERSION}/vendor/llama.cpp && {QWEN2_PATCH} && '
         f'cmake -S "$D" -B "$D/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF '
         f'-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS="{NO_AMX}" -DCMAKE_CXX_FLAGS="{NO_AMX}" && '
         f'cmake --build "$D/build" --target llama-server -j')
SERVER = Path("build") / "bin" / "llama-server"
CONVERTER = "convert_hf_to_gguf.py"
HEAD_FILE = "head.gguf"  # what `export-head --format llamacpp` writes into its folder
# The head's weights as a llama.cpp user converts a small draft for a CPU: 8-bit (its float16 matmuls are slower
# there; specchat's own head runs 4-bit on its kernel).
HEAD_TYPE = "q8_0"
START_SECONDS = 300  # the server loads the target and the head, and warms up
ANSWER_SECONDS = 3600


# ---------------------------------------------------------------------------------------------
# The binding: llamacpp, llamacpp-lookup


class LlamaCppRunner(ConversationRunner):
    """llama.cpp on the target's GGUF file: a conversation's turns through the high-level generator,
    which reuses its cache for the shared prefix, as our engine does."""

    def __init__(self, gguf, chat_format: ChatFormat, settings: GenerationSettings, seed: int | None, threads: int,
                 context: int, lookup: bool):
        # An optional extra (a native build): imported only when this peer runs.
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(LOOKUP_NGRAM, LOOKUP_TOKENS) if lookup else None
        # With a draft model it keeps logits for every position, and 0.3.36 then fails on a prompt
        # longer than one batch (its last, shorter batch is copied as a full one): one batch per prompt.
        batch = context if lookup else 512
        self.llm = Llama(model_path=str(gguf), n_ctx=context, n_batch=batch, n_ubatch=batch, n_threads=threads,
                         n_threads_batch=threads, seed=seed if seed is not None else 0, draft_model=draft,
                         verbose=False)
        self.chat_format, self.settings = chat_format, settings
        self.forwards = 0
        evaluate = self.llm.eval

        def counted(tokens):  # every forward of the model passes here (prefill, plain steps, lookup batches)
            self.forwards += 1
            return evaluate(tokens)

        self.llm.eval = counted
        super().__init__()

    def close(self) -> None:
        self.llm.close()

    def turn(self, prompt: str) -> Turn:
        self.conversation.add_user(prompt)
        ids = self.chat_format.prompt_ids(self.conversation)
        sampling, budget = self.settings.sampling, self.settings.max_new_tokens
        self.forwards = 0
        new, first_token_seconds = [], 0.0
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                       min_p=0.0, repeat_penalty=1.0):
            if not new:
                first_token_seconds = time.perf_counter() - start
            new.append(token)
            if token in self.settings.stop_ids or len(new) >= budget:
                break
        seconds = time.perf_counter() - start
        return self.answered(new, Stats(new_tokens=len(new), seconds=seconds, prefill_seconds=first_token_seconds,
                                        target_forwards=self.forwards))


def _llamacpp(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
              lookup: bool) -> tuple[LlamaCppRunner, None]:
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable(f"needs llama-cpp-python; on x86 build it without AMX (GCC 12 segfaults there): {BINDING_BUILD}")
    gguf = source_gguf(target.spec)
    if gguf is None:
        raise PeerUnavailable(f"{target.name} has no GGUF file for llama.cpp to read")
    context = min(target.max_context, PEER_CONTEXT)
    return LlamaCppRunner(gguf, chat_format, generation, settings.seed, torch.get_num_threads(), context, lookup), None


def llamacpp(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
             load_model) -> tuple[LlamaCppRunner, None]:
    return _llamacpp(settings, target, chat_format, generation, lookup=False)


def llamacpp_lookup(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                    load_model) -> tuple[LlamaCppRunner, None]:
    return _llamacpp(settings, target, chat_format, generation, lookup=True)


# ---------------------------------------------------------------------------------------------
# llama-server: llamacpp-eagle3, and the head as llama.cpp reads it


def tools() -> Path:
    """The llama.cpp source tree with its built server (BUILD), or PeerUnavailable saying how to build it."""
    folder = Path(os.environ.get(TOOLS_DIR) or cache_dir() / "peers" / "llama.cpp").expanduser()
    if not (folder / SERVER).is_file() or not (folder / CONVERTER).is_file():
        raise PeerUnavailable(f"needs llama.cpp's llama-server built from llama-cpp-python {VERSION}'s source in "
                              f"{folder} (or ${TOOLS_DIR}): {BUILD}")
    return folder


def convert_head(head: Path, output: Path, verifier: Verifier, feature_layers: tuple[int, ...] | None,
                 target_folder: Path, tree: Path) -> Path:
    """The EAGLE-3 head in `head` as a GGUF llama.cpp loads (module docstring), written into `output`
    by the converter of the llama.cpp source `tree`; `target_folder` is the target's Hugging Face folder."""
    if importlib.util.find_spec("sentencepiece") is None:  # the converter tries it first for every vocabulary
        raise PeerUnavailable("llama.cpp's converter needs sentencepiece: pip install sentencepiece")
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specchat-llamacpp-") as work:
        staged = Path(work) / "speculators"
        # The layout names a verifier, which llama.cpp does not read: the target's hub id where known.
        exports.stage_eagle3(head, staged, "speculators",
                             dataclasses.replace(verifier, name=verifier.name or target_folder.name), feature_layers,
                             "llama.cpp")
        gguf = output / HEAD_FILE
        run_tool([sys.executable, str(tree / CONVERTER), str(staged), "--target-model-dir", str(target_folder),
                  "--outtype", HEAD_TYPE, "--outfile", str(gguf)],
                 cache_dir() / "peers" / "export-llamacpp-head.log", "llama.cpp's head conversion",
                 env={"PYTHONPATH": str(tree / "gguf-py"), "HF_HUB_OFFLINE": "1"})
    return gguf


def export_named(head: str, output: str | Path, verifier: str | None = None,
                 max_position_embeddings: int | None = None, model: str | None = None) -> list[Path]:
    """`export-head --format llamacpp`: the head `head` names, for the target `model` (default: the one
    its training record names), whose converted folder gives the vocabulary."""
    tree = tools()
    folder, target, layers, target_folder = exports.named_with_target(head, verifier, max_position_embeddings, model)
    return [convert_head(folder, Path(output), target, layers, target_folder, tree)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def failure(log: Path) -> str:
    """Why llama-server ended, from its log: its failed assertion or its last error line (a crash
    ends the log with a backtrace)."""
    lines = log.read_text(errors="replace").splitlines()
    said = [line.strip() for line in lines if "GGML_ASSERT" in line or " E " in line or "error" in line.lower()]
    return said[-1] if said else last_line(log)


class LlamaServer:
    """A `llama-server` process on localhost, loaded (its output into `<cache>/peers/<name>.log`)."""

    def __init__(self, command: list[str], name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = cache_dir() / "peers" / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)],
                                            stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except PeerFailed as error:
            self.close()
            raise PeerUnavailable(f"{name} did not start: {error}") from error

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerFailed(f"llama-server ended ({failure(self.log)}; its log: {self.log})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        raise PeerFailed(f"llama-server was not ready within {START_SECONDS} s (its log: {self.log})")

    def complete(self, request: dict) -> dict:
        body = json.dumps(request).encode()
        post = urllib.request.Request(self.url + "/completion", data=body,
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(post, timeout=ANSWER_SECONDS) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise PeerFailed(f"llama-server answered {error.code}: {error.read().decode(errors='replace')[:300]} "
                             f"(its log: {self.log})") from error
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            if self.process.poll() is not None:
                raise PeerFailed(f"llama-server ended ({failure(self.log)}; its log: {self.log})") from error
            raise PeerFailed(f"llama-server did not answer ({error}; its log: {self.log})") from error

    def close(self) -> None:
        end(self.process, self.process.terminate, seconds=30)


class LlamaServerRunner(PeerRunner):
    """A bench runner answering through llama-server's /completion: the prompt as token ids (the
    model's own chat template), its cache reused for the conversation's shared prefix, the plain
    distribution (temperature, top-k and top-p only: none of its other samplers' defaults).
    Each speculative step yields its accepted drafts and one token more, so the target's forwards
    are the new tokens less the accepted drafts (the prefill's giving the first)."""

    def turn(self, prompt: str):
        self.conversation.add_user(prompt)
        sampling = self.settings.sampling
        start = time.perf_counter()
        reply = self.peer.complete({
            "prompt": self.chat_format.prompt_ids(self.conversation), "n_predict": self.settings.max_new_tokens,
            "temperature": sampling.temperature, "top_k": sampling.top_k or 0, "top_p": sampling.top_p,
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "seed": self.seed, "cache_prompt": True,
            "return_tokens": True, "stream": False})
        seconds = time.perf_counter() - start
        tokens = with_stop(reply["tokens"], {"max_new_tokens": self.settings.max_new_tokens,
                                             "stop": self.settings.stop_ids})
        timings = reply["timings"]
        drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        return self.answered(tokens, Stats(
            new_tokens=len(tokens), seconds=seconds, prefill_seconds=timings["prompt_ms"] / 1000,
            target_forwards=timings["predicted_n"] - accepted, draft_tokens=drafted, accepted_tokens=accepted))


def llamacpp_eagle3(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                    load_model) -> tuple[LlamaServerRunner, None]:
    tree = tools()
    gguf = source_gguf(target.spec)
    if gguf is None:
        raise PeerUnavailable(f"{target.name} has no GGUF file for llama.cpp to read")
    source = resolve_folder(settings.draft)
    folder = Path(locate(target.spec, torch.bfloat16))  # the converter's vocabulary and hidden size
    head = exported_once("llamacpp-head", [source, folder], lambda output: convert_head(
        source, output, exports.target_of(source), exports.feature_layers(source), folder, tree)) / HEAD_FILE
    threads = str(torch.get_num_threads())
    command = [str(tree / SERVER), "-m", str(gguf), "-md", str(head), "--spec-type", "draft-eagle3",
               "-c", str(min(target.max_context, PEER_CONTEXT)), "-np", "1", "-t", threads, "-tb", threads,
               "-td", threads, "-tbd", threads, "--no-webui"]
    return LlamaServerRunner(LlamaServer(command, settings.method), chat_format, generation, settings.seed), None


# What runs each of its methods (all peers': `specchat.bench.run.RUNNERS`).
RUNNERS = {methods.LLAMACPP: llamacpp, methods.LLAMACPP_LOOKUP: llamacpp_lookup,
           methods.LLAMACPP_EAGLE3: llamacpp_eagle3}
