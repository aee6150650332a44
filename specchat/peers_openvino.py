"""OpenVINO GenAI as `specchat bench` peers, and OpenVINO's layout of an EAGLE-3 head (`export-head --format openvino`).

- `openvino`: OpenVINO GenAI's plain decoding of the target, exported by optimum-intel with int4
  weights (its fastest plain decoding on these CPUs); `openvino-int8`: the same with int8 weights;
- `openvino-lookup`: its prompt lookup decoding (int4 weights);
- `openvino-eagle3`: its EAGLE-3 speculation (int4 weights) drafting with specchat's own head for
  the target, a chain of EAGLE3_CHAIN tokens.

Both packages pin versions of their own (transformers among them): they live in a virtual
environment of their own (INSTALL), whose Python `SPECCHAT_OPENVINO_PYTHON` names, and run there:
optimum-intel's `optimum-cli` exports into specchat's cache once, and GenAI decodes in a worker
(`specchat.peer_process`). OpenVINO runs with its defaults as a user gets them (bf16 inference
where the CPU has AVX512-BF16, f32 elsewhere; the worker reports which), 2 threads as every
method. Its defaults are not lossless against its own plain greedy output on a bf16 CPU.

The head: optimum-intel exports the SGLang layout (`LlamaForCausalLMEagle3` with `d2t`) into an
IR, with the target's tokenizer beside it. GenAI feeds it the outputs of the target layers its
IR's rt_info `hidden_layers_list` names, by default [2, L/2, L-3]: one above the EAGLE-3
convention (the *inputs* of layers 2, L/2 and L-3, i.e. the outputs of 1, L/2-1 and L-4, which
vLLM and SGLang follow and specchat's heads are trained on). The export writes the head's own
list there ([1, 11, 20] for the 0.5B's 24 layers), so that a user need not know.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

import drafters
from drafters import Verifier
from specchat import exports
from specchat.chat import ChatFormat
from specchat.decode import GenerationSettings, Target, cache_dir
from specchat import methods
from specchat.errors import SpecchatError
from specchat.peers import PeerUnavailable
from specchat.peer_process import Worker, WorkerRunner, exported_once, find_python, run_tool
from specchat.settings import Settings
from specchat.sources import locate, resolve_folder

OPENVINO_PYTHON = "SPECCHAT_OPENVINO_PYTHON"
VERSION = "2026.4.1"  # the OpenVINO GenAI INSTALL pins, whose traps this module works around
RUNTIME = "OpenVINO GenAI"  # the worker's name for it (`specchat.peer_worker.RUNTIMES`)
INSTALL = (f"python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install openvino-genai=={VERSION}.0 "
           "'optimum-intel[openvino]==2.2.0' && V/bin/pip install torch==2.13.0 && V/bin/pip uninstall -y torchvision")
LOOKUP_TOKENS, LOOKUP_NGRAM = 5, 3  # GenAI's prompt lookup: tokens proposed per step, longest n-gram matched (its samples')
EAGLE3_CHAIN = 3  # draft tokens per step for openvino-eagle3 (3-5 decoded fastest on these CPUs)
# What optimum-cli needs beside a head's weights and config: the target's tokenizer (GenAI loads it with the IR).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
# optimum-intel 2.2 loads an EAGLE-3 head through its own model_patcher.py as "remote code", and
# transformers then demands every package that file imports anywhere (diffusers, einops), which
# the export does not use; installing diffusers breaks optimum-cli otherwise (it pins another
# huggingface-hub and is then taken for the model's library). So the head's export skips the check.
OPTIMUM_CLI = (
    "import sys\n"
    "from transformers import dynamic_module_utils as modules\n"
    "modules.check_imports = modules.get_relative_imports\n"
    "from optimum.commands.optimum_cli import main\n"
    "sys.argv[0] = 'optimum-cli'\n"
    "main()\n")
# Run by the environment's Python: the draft IR's rt_info `hidden_layers_list`, which GenAI reads.
SET_HIDDEN_LAYERS = (
    "import json, sys, openvino as ov\n"
    "model = ov.Core().read_model(sys.argv[1])\n"
    "model.set_rt_info(json.loads(sys.argv[2]), ['hidden_layers_list'])\n"
    "ov.save_model(model, sys.argv[1] + '.new.xml', compress_to_fp16=False)\n")


def python() -> str:
    return find_python(OPENVINO_PYTHON, "openvino-genai", "OpenVINO GenAI and optimum-intel", INSTALL)


def optimum_cli(python_path: str, checks_imports: bool = True) -> list[str]:
    """`optimum-cli export openvino` of the environment of `python_path` (without the remote-code
    import check: OPTIMUM_CLI)."""
    if checks_imports:
        return [python_path, "-m", "optimum.commands.optimum_cli", *"export openvino".split()]
    return [python_path, "-I", "-c", OPTIMUM_CLI, *"export openvino".split()]


def export_target(python_path: str, folder: Path, weights: str) -> Path:
    """The target's IR with `weights` (int4 | int8) weights, exported once from its Hugging Face folder."""
    def make(output: Path) -> None:
        run_tool([*optimum_cli(python_path), "--model", str(folder), "--task",
                  "text-generation-with-past", "--weight-format", weights, str(output)],
                 cache_dir() / "peers" / f"export-openvino-{weights}.log", f"optimum-cli's {weights} export",
                 env={"HF_HUB_OFFLINE": "1"})

    return exported_once(f"openvino-{folder.name}-{weights}", [folder], make)


def export_head(head: Path, output: Path, verifier: Verifier, feature_layers: tuple[int, ...] | None,
                target_folder: Path, python_path: str) -> list[Path]:
    """The EAGLE-3 head in `head` as OpenVINO GenAI loads it (module docstring), written into `output`
    by optimum-intel in the environment of `python_path`; `target_folder` gives the tokenizer."""
    with tempfile.TemporaryDirectory(prefix="specchat-openvino-") as work:
        staged = Path(work) / "sglang"
        try:
            drafters.export_head(head, staged, "sglang", verifier, feature_layers=feature_layers)
        except drafters.HeadLoadError as error:
            raise SpecchatError(str(error)) from error
        config = json.loads((staged / "config.json").read_text())
        if config["architectures"] != ["LlamaForCausalLMEagle3"]:
            raise SpecchatError(f"{head}: OpenVINO GenAI drafts with EAGLE-3 heads only, not {config['architectures'][0]}")
        layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not layers:
            raise SpecchatError(f"{head}: the target layers the head reads are unknown (its training record names "
                                f"no target)")
        for name in TOKENIZER_FILES:
            if (target_folder / name).is_file():
                shutil.copyfile(target_folder / name, staged / name)
        log = cache_dir() / "peers" / "export-openvino-head.log"
        run_tool([*optimum_cli(python_path, checks_imports=False), "--model", str(staged), "--task",
                  "text-generation-with-past", "--trust-remote-code", str(output)], log, "optimum-cli's head export",
                 env={"HF_HUB_OFFLINE": "1"})
        model = output / "openvino_model.xml"
        run_tool([python_path, "-I", "-c", SET_HIDDEN_LAYERS, str(model), json.dumps(layers)], log,
                 "setting the head's hidden_layers_list")
        Path(str(model) + ".new.xml").replace(model)
        Path(str(model) + ".new.bin").replace(model.with_suffix(".bin"))
    return sorted(path for path in output.iterdir() if path.is_file())


def export_named(head: str, output: str | Path, verifier: str | None = None,
                 max_position_embeddings: int | None = None, model: str | None = None) -> list[Path]:
    """`export-head --format openvino`: the head `head` names, for the target `model` (default: the
    one its training record names), whose converted folder gives the tokenizer."""
    python_path = python()  # before anything converts
    folder, target, layers, target_folder = exports.named_with_target(head, verifier, max_position_embeddings, model)
    return export_head(folder, Path(output), target, layers, target_folder, python_path)


def _runner(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
            weights: str, lookup: bool = False, head: str | None = None) -> tuple[WorkerRunner, None]:
    python_path = python()
    folder = Path(locate(target.spec, torch.bfloat16))  # the weights all runtimes read (a GGUF's: dequantized)
    model = export_target(python_path, folder, weights)
    draft = None
    if head is not None:
        source = resolve_folder(head)
        draft = exported_once("openvino-head", [source, folder], lambda output: export_head(
            source, output, exports.target_of(source), exports.feature_layers(source), folder, python_path))
    load = {"runtime": RUNTIME, "model": str(model), "draft": draft and str(draft),
            "lookup": LOOKUP_NGRAM if lookup else 0,
            "draft_tokens": EAGLE3_CHAIN if head else LOOKUP_TOKENS, "threads": torch.get_num_threads(),
            "max_context": target.max_context}
    worker = Worker(python_path, load, settings.method, {})
    return WorkerRunner(worker, chat_format, generation, settings.seed), None


def openvino(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int4")


def openvino_int8(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int8")


def openvino_lookup(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int4", lookup=True)


def openvino_eagle3(settings, target, chat_format, generation, load_model):
    if not generation.sampling.greedy:
        raise PeerUnavailable(f"OpenVINO GenAI {VERSION}'s EAGLE-3 decoding fails when it samples (its check "
                              f"content_length <= prompt_ids.size() + m_generated_ids.size() in sequence_group.cpp): "
                              f"greedy only")
    return _runner(settings, target, chat_format, generation, "int4", head=settings.draft)


# What runs each of its methods (all peers': `specchat.bench_run.RUNNERS`).
RUNNERS = {methods.OPENVINO: openvino, methods.OPENVINO_INT8: openvino_int8, methods.OPENVINO_LOOKUP: openvino_lookup,
           methods.OPENVINO_EAGLE3: openvino_eagle3}
