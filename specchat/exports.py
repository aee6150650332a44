"""`specchat export-head`: a draft head written in a layout vLLM or SGLang loads as it is.

The conversion is `drafters.export_head`'s (files in, files out; no model loads). This module finds
the head (a bundled name, a folder, a hub id) and the defaults its training record gives: the
target's hub id, which the speculators layout names as its verifier, and the target layers an
EAGLE-3 head reads, so that the exported config says them.
"""

from __future__ import annotations

import json
from pathlib import Path

import drafters
from drafters.eagle3 import default_feature_layers
from specchat.embedded import EMBEDDED_MODELS
from specchat.hub import HUB_ID
from specchat.sources import DraftHeadError, resolve_folder

TRAINING_RECORD = "training.json"  # what `specchat train` writes beside a head


def export(head: str, layout: str, output: str | Path, verifier: str | None = None, speculative_tokens: int = 5,
           max_shard_bytes: int | None = None) -> list[Path]:
    """The head `head` names, written into `output` in `layout`; returns the files written."""
    return export_folder(resolve_folder(head), layout, output, verifier, speculative_tokens, max_shard_bytes)


def export_folder(folder: Path, layout: str, output: str | Path, verifier: str | None = None,
                  speculative_tokens: int = 5, max_shard_bytes: int | None = None) -> list[Path]:
    """The head in `folder` (a name is not looked up: `export`), written into `output` in `layout`."""
    target = training_record(folder).get("target") or {}
    layers = target.get("layers")
    try:
        return drafters.export_head(folder, output, layout, verifier or hub_id(target.get("name")), speculative_tokens,
                                    default_feature_layers(layers) if isinstance(layers, int) else None,
                                    max_shard_bytes)
    except drafters.HeadLoadError as error:
        raise DraftHeadError(str(error)) from error


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
