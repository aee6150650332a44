"""`specchat export-head`: a draft head written in a layout vLLM, SGLang or OpenVINO GenAI loads as it is.

The conversion is `drafters.export_head`'s (files in, files out; no model loads). This module finds
the head (a bundled name, a folder, a hub id) and the defaults its training record gives: the
target (`drafters.Verifier`: its hub id, which the speculators layout names, its architectures and
its context, which every layout says) and the target layers an EAGLE-3 head reads, so that the
exported config says them.

OpenVINO's layout (`export_openvino`) is the SGLang one (`LlamaForCausalLMEagle3` with `d2t`)
turned into an IR by optimum-intel, with the target's tokenizer beside it, in OpenVINO's own
environment: optimum-intel and OpenVINO GenAI pin versions of their own (transformers among them),
so they live in a virtual environment of their own (OPENVINO_INSTALL), whose Python
`SPECCHAT_OPENVINO_PYTHON` names (`specchat.peers.openvino` decodes there too). GenAI feeds the
head the outputs of the target layers its IR's rt_info `hidden_layers_list` names, by default
[2, L/2, L-3]: one above the EAGLE-3 convention (the *inputs* of layers 2, L/2 and L-3, i.e. the
outputs of 1, L/2-1 and L-4, which vLLM and SGLang follow and specchat's heads are trained on).
The export writes the head's own list there ([1, 11, 20] for the 0.5B's 24 layers), so that a
user need not know. llama.cpp's GGUF of a head is made by llama.cpp's converter, beside the peer
that runs it (`specchat.peers.llamacpp.export_named`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

import drafters
from drafters import Verifier
from drafters.eagle3 import default_feature_layers
from specchat.decode import ModelSpec, cache_dir
from specchat.embedded import EMBEDDED_MODELS
from specchat.errors import SpecchatError
from specchat.hub import HUB_ID
from specchat.peers.process import find_python, run_tool
from specchat.sources import DraftHeadError, locate, resolve_folder

TRAINING_RECORD = "training.json"  # what `specchat train` writes beside a head

OPENVINO_PYTHON = "SPECCHAT_OPENVINO_PYTHON"
OPENVINO_VERSION = "2026.4.1"  # the OpenVINO GenAI OPENVINO_INSTALL pins, whose traps specchat works around
OPENVINO_INSTALL = (f"python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install "
                    f"openvino-genai=={OPENVINO_VERSION}.0 'optimum-intel[openvino]==2.2.0' && "
                    "V/bin/pip install torch==2.13.0 && V/bin/pip uninstall -y torchvision")
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


def export(head: str, layout: str, output: str | Path, verifier: str | None = None, speculative_tokens: int | None = None,
           max_shard_bytes: int | None = None, max_position_embeddings: int | None = None) -> list[Path]:
    """The head `head` names, written into `output` in `layout`; returns the files written."""
    return export_folder(resolve_folder(head), layout, output, verifier, speculative_tokens, max_shard_bytes,
                         max_position_embeddings)


def export_folder(folder: Path, layout: str, output: str | Path, verifier: str | None = None,
                  speculative_tokens: int | None = None, max_shard_bytes: int | None = None,
                  max_position_embeddings: int | None = None) -> list[Path]:
    """The head in `folder` (a name is not looked up: `export`), written into `output` in `layout`
    (one `drafters.export_head` writes); `speculative_tokens`: the speculators layout's proposal length
    (None: `drafters.SPECULATIVE_TOKENS`)."""
    speculative_tokens = drafters.SPECULATIVE_TOKENS if speculative_tokens is None else speculative_tokens
    try:
        return drafters.export_head(folder, output, layout, target_of(folder, verifier, max_position_embeddings),
                                    speculative_tokens, feature_layers(folder), max_shard_bytes)
    except drafters.HeadLoadError as error:
        raise DraftHeadError(str(error)) from error


def named_with_target(head: str, verifier: str | None = None, max_position_embeddings: int | None = None,
                      model: str | None = None) -> tuple[Path, Verifier, tuple[int, ...] | None, Path]:
    """For a runtime that reads the target's own files beside the head (OpenVINO's IR, llama.cpp's GGUF):
    the head's folder, its target as exports name it (`target_of`), the target layers it reads, and the
    converted Hugging Face folder of `model` (default: the target its training record names)."""
    folder = resolve_folder(head)
    model = model or target_name(folder)
    if model is None:
        raise SpecchatError(f"{head}: its training record names no target: say which model it drafts for (--model)")
    return (folder, target_of(folder, verifier, max_position_embeddings), feature_layers(folder),
            Path(locate(ModelSpec(model=model), torch.bfloat16)))


def target_of(folder: Path, verifier: str | None = None, max_position_embeddings: int | None = None) -> Verifier:
    """The head's target as an export names it: what is given, else its training record's (an
    embedded model's published facts where the record names one). A --verifier other than the
    recorded target takes nothing else of the record."""
    recorded = training_record(folder).get("target") or {}
    name = recorded.get("name")
    embedded = EMBEDDED_MODELS.get(name)
    if verifier and verifier != hub_id(name):
        recorded, embedded = {}, None
    return Verifier(
        name=verifier or hub_id(name),
        architectures=tuple(recorded.get("architectures") or (embedded.architectures if embedded else ())),
        max_position_embeddings=max_position_embeddings or recorded.get("max_position_embeddings")
        or (embedded.max_position_embeddings if embedded else None))


def feature_layers(folder: Path) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head reads by default, for the target its training record names."""
    layers = (training_record(folder).get("target") or {}).get("layers")
    return default_feature_layers(layers) if isinstance(layers, int) else None


def target_name(folder: Path) -> str | None:
    """The target its training record names, as specchat names models (an embedded one, a folder, a hub id)."""
    return (training_record(folder).get("target") or {}).get("name")


def training_record(folder: Path) -> dict:
    """The head's training.json, or nothing (a published head has none)."""
    try:
        record = json.loads((folder / TRAINING_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def hub_id(model: str | None) -> str | None:
    """The hub id of a target named as specchat names it: an embedded model's published one, or the name
    itself when it is a hub id (owner/name); None when it is neither (a local file or folder)."""
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model].hub_id
    if model and HUB_ID.match(model) and not Path(model).exists():
        return model
    return None


# ---------------------------------------------------------------------------------------------
# OpenVINO GenAI's layout, made by optimum-intel in its own environment


def openvino_python() -> str:
    """The Python of OpenVINO's environment (OPENVINO_PYTHON), or PeerUnavailable saying how to make one."""
    return find_python(OPENVINO_PYTHON, "openvino-genai", "OpenVINO GenAI and optimum-intel", OPENVINO_INSTALL)


def optimum_cli(python_path: str, checks_imports: bool = True) -> list[str]:
    """`optimum-cli export openvino` of the environment of `python_path` (without the remote-code
    import check: OPTIMUM_CLI)."""
    if checks_imports:
        return [python_path, "-m", "optimum.commands.optimum_cli", *"export openvino".split()]
    return [python_path, "-I", "-c", OPTIMUM_CLI, *"export openvino".split()]


EAGLE3_ARCHITECTURES = {"sglang": "LlamaForCausalLMEagle3", "speculators": "Eagle3Speculator"}  # by layout


def stage_eagle3(head: Path, staged: Path, layout: str, verifier: Verifier, layers: tuple[int, ...] | None,
                 tool: str) -> list[int]:
    """The EAGLE-3 head in `head` written in `layout` into `staged`, for `tool`'s converter; returns the
    target layers it reads (a head of another format, or one whose target is unknown, is said)."""
    try:
        drafters.export_head(head, staged, layout, verifier, feature_layers=layers)
    except drafters.HeadLoadError as error:
        raise SpecchatError(str(error)) from error
    config = json.loads((staged / "config.json").read_text())
    if config["architectures"] != [EAGLE3_ARCHITECTURES[layout]]:
        raise SpecchatError(f"{head}: {tool} drafts with EAGLE-3 heads only, not {config['architectures'][0]}")
    read = (config.get("eagle_config") or config).get("eagle_aux_hidden_state_layer_ids")
    if not read:
        raise SpecchatError(f"{head}: the target layers the head reads are unknown (its training record names no target)")
    return read


def export_openvino_head(head: Path, output: Path, verifier: Verifier, layers: tuple[int, ...] | None,
                         target_folder: Path, python_path: str) -> list[Path]:
    """The EAGLE-3 head in `head` as OpenVINO GenAI loads it (module docstring), written into `output`
    by optimum-intel in the environment of `python_path`; `target_folder` gives the tokenizer."""
    with tempfile.TemporaryDirectory(prefix="specchat-openvino-") as work:
        staged = Path(work) / "sglang"
        read = stage_eagle3(head, staged, "sglang", verifier, layers, "OpenVINO GenAI")
        for name in TOKENIZER_FILES:
            if (target_folder / name).is_file():
                shutil.copyfile(target_folder / name, staged / name)
        log = cache_dir() / "peers" / "export-openvino-head.log"
        run_tool([*optimum_cli(python_path, checks_imports=False), "--model", str(staged), "--task",
                  "text-generation-with-past", "--trust-remote-code", str(output)], log, "optimum-cli's head export",
                 env={"HF_HUB_OFFLINE": "1"})
        model = output / "openvino_model.xml"
        run_tool([python_path, "-I", "-c", SET_HIDDEN_LAYERS, str(model), json.dumps(read)], log,
                 "setting the head's hidden_layers_list")
        Path(str(model) + ".new.xml").replace(model)
        Path(str(model) + ".new.bin").replace(model.with_suffix(".bin"))
    return sorted(path for path in output.iterdir() if path.is_file())


def export_openvino(head: str, output: str | Path, verifier: str | None = None,
                    max_position_embeddings: int | None = None, model: str | None = None) -> list[Path]:
    """`export-head --format openvino`: the head `head` names, for the target `model` (default: the
    one its training record names), whose converted folder gives the tokenizer."""
    python_path = openvino_python()  # before anything converts
    folder, target, layers, target_folder = named_with_target(head, verifier, max_position_embeddings, model)
    return export_openvino_head(folder, Path(output), target, layers, target_folder, python_path)
