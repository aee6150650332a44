"""`specchat export-head`: a draft head written in a layout vLLM, SGLang or OpenVINO GenAI loads as it is.

The conversion is `drafters.export_head`'s (files in, files out; no model loads). This module finds
the head (a bundled name, a folder, a hub id) and the defaults its training record gives: the
target (`drafters.Verifier`: its hub id, which the speculators layout names, its architectures and
its context, which every layout says) and the target layers an EAGLE-3 head reads, so that the
exported config says them. OpenVINO's layout is the SGLang one turned into OpenVINO's IR by
optimum-intel, in its own environment (`specchat.peers_openvino.export_named`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import drafters
from drafters import Verifier
from drafters.eagle3 import default_feature_layers
from specchat.decode import ModelSpec
from specchat.embedded import EMBEDDED_MODELS
from specchat.errors import SpecchatError
from specchat.hub import HUB_ID
from specchat.sources import DraftHeadError, locate, resolve_folder

TRAINING_RECORD = "training.json"  # what `specchat train` writes beside a head


def export(head: str, layout: str, output: str | Path, verifier: str | None = None, speculative_tokens: int = 5,
           max_shard_bytes: int | None = None, max_position_embeddings: int | None = None) -> list[Path]:
    """The head `head` names, written into `output` in `layout`; returns the files written."""
    return export_folder(resolve_folder(head), layout, output, verifier, speculative_tokens, max_shard_bytes,
                         max_position_embeddings)


def export_folder(folder: Path, layout: str, output: str | Path, verifier: str | None = None,
                  speculative_tokens: int = 5, max_shard_bytes: int | None = None,
                  max_position_embeddings: int | None = None) -> list[Path]:
    """The head in `folder` (a name is not looked up: `export`), written into `output` in `layout`
    (one `drafters.export_head` writes)."""
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
