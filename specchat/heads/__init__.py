"""Draft heads bundled with specchat, trained with `specchat train` for the embedded default model.

It also says which draft a method takes when none is given (this module stays free of torch, so
the command line can decide before the heavy imports).

Each sub-folder is a head in its published format (config.json + model.safetensors) with the
training.json that records how it was made. `--draft NAME` finds them by folder name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Methods that draft with a head (EAGLE-1/2, EAGLE-3 or Jakiro format).
HEAD_METHODS = ("eagle", "eagle2", "deagle", "jakiro")

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


def needs_draft(method: str) -> str | None:
    """What `--draft` must name for a method, or None if it takes no draft."""
    if method in HEAD_METHODS:
        return "a draft head (folder or hub id; EAGLE-1/2, EAGLE-3 or Jakiro format)"
    if method == "sps":
        return "a small draft model sharing the target's tokenizer (like --model)"
    return None


def default_draft(method: str, target_name: str) -> str | None:
    """The draft a method uses when none is given: a head bundled for this target, or (sps) the
    smaller embedded model that shares its tokenizer."""
    from specchat.embedded import DEFAULT_MODEL

    if method in ("sps", "hf-assisted"):
        return DEFAULT_MODEL if target_name == "qwen2.5-coder-1.5b-instruct" else None
    return bundled_head_for(target_name, method)


def effective_draft(settings) -> str | None:
    """`--draft` if given, else the default draft of the method for this target (None for no draft)."""
    if not needs_draft(settings.method):
        return settings.draft
    return settings.draft or default_draft(settings.method, settings.model)
