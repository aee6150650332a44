"""Draft heads bundled with specchat, trained with `specchat train` for the embedded default model.

Each sub-folder is a head in its published format (config.json + model.safetensors) with the
training.json that records how it was made. `--draft NAME` finds them by folder name; which
method takes which head by default is said in `specchat.methods`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_heads() -> dict[str, Path]:
    root = resources.files(__name__)
    return {entry.name: Path(str(entry)) for entry in root.iterdir()
            if entry.is_dir() and (Path(str(entry)) / "config.json").is_file()}
