"""Draft heads bundled with specchat, trained with `specchat train` for the embedded default model.

Each sub-folder is a head in its published format (config.json + model.safetensors) with the
training.json that records how it was made. `--draft NAME` finds them by folder name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Which bundled head each method uses by default, per embedded target model.
DEFAULT_HEADS = {
    "qwen2.5-coder-0.5b-instruct": {
        "eagle": "qwen2.5-coder-0.5b-eagle",
        "eagle2": "qwen2.5-coder-0.5b-eagle3",
        "deagle": "qwen2.5-coder-0.5b-eagle3",
        "jakiro": "qwen2.5-coder-0.5b-jakiro",
    },
}


def bundled_heads() -> dict[str, Path]:
    root = resources.files(__name__)
    return {entry.name: Path(str(entry)) for entry in root.iterdir()
            if entry.is_dir() and (Path(str(entry)) / "config.json").is_file()}


def bundled_head_for(target_name: str, method: str) -> str | None:
    name = DEFAULT_HEADS.get(target_name, {}).get(method)
    return name if name in bundled_heads() else None
