"""Head checkpoint files: config.json, weights in safetensors (single or sharded) or a weights-only
pickle, and strict loading of a state dict into a head.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn


class HeadLoadError(ValueError):
    """A draft head cannot be loaded; the one-line message names the file, key or mismatch."""


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise HeadLoadError(f"{folder}: no config.json (a draft head folder holds config.json and weights)") from error
    except (ValueError, OSError) as error:  # UnicodeDecodeError is a ValueError
        raise HeadLoadError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise HeadLoadError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The head's state dict from model.safetensors, from shards listed in model.safetensors.index.json
    (the Hugging Face sharded layout), or from pytorch_model.bin loaded with weights_only."""
    safetensors_path, index_path, pickle_path = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX, folder / "pytorch_model.bin"
    if safetensors_path.is_file():
        return read_safetensors(safetensors_path), safetensors_path
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise HeadLoadError(f"{index_path}: not a safetensors index ({error})") from error
        state = {}
        for shard in sorted(set(weight_map.values())):
            tensors = read_safetensors(folder / shard)
            wrong = [key for key in tensors if weight_map.get(key) != shard]
            if wrong:
                raise HeadLoadError(f"{folder / shard}: holds {', '.join(wrong[:4])}, which the index places elsewhere")
            state.update(tensors)
        absent = [key for key in weight_map if key not in state]
        if absent:
            raise HeadLoadError(f"{index_path}: lists {', '.join(absent[:4])}, which no shard holds")
        return state, index_path
    if pickle_path.is_file():
        try:
            state = torch.load(pickle_path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as error:
            # torch's message is several lines of advice, one of them to turn the protection off: not ours
            first_line = next(iter(str(error).strip().splitlines()), type(error).__name__)
            raise HeadLoadError(f"{pickle_path}: not a plain tensor file; specchat reads pickles only with "
                                f"weights_only=True ({first_line})") from error
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise HeadLoadError(f"{pickle_path}: holds a {type(state).__name__}, not a state dict of named tensors")
        return state, pickle_path
    raise HeadLoadError(f"{folder}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX} or pytorch_model.bin")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, or a HeadLoadError that names the file."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise HeadLoadError(f"{path}: cannot read ({error})") from error


def write_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None = None) -> list[Path]:
    """Write `state` as model.safetensors, or, past `max_shard_bytes`, as numbered shards with an
    index (the Hugging Face layout, which other engines read too). Returns the files written."""
    for stale in [folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, folder / WEIGHTS_FILE, metadata={"format": "pt"})
        return [folder / WEIGHTS_FILE]
    shards, size = [{}], 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    written, weight_map = [], {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written.append(folder / name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*written, folder / WEIGHTS_INDEX]


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: Path,
                optional: tuple[str, ...] = (), assign: bool = False) -> None:
    """Copy `state` into `module`, requiring every key with its exact shape and no extras.

    Keys in `optional` may be absent (the module keeps what the caller set up for them). `assign`:
    the module's tensors become `state`'s (a module built on the meta device, `built_empty`, has
    nothing to copy into).
    """
    expected = module.state_dict()
    missing = [key for key in expected if key not in state and key not in optional]
    unexpected = [key for key in state if key not in expected]
    if missing:
        raise HeadLoadError(f"{source}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing[:6])}"
                            + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        raise HeadLoadError(f"{source}: unexpected key{'s' if len(unexpected) > 1 else ''} "
                            f"{', '.join(unexpected[:6])}" + (" ..." if len(unexpected) > 6 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise HeadLoadError(f"{source}: {key} has shape {list(tensor.shape)}, expected {list(expected[key].shape)}")
    module.load_state_dict({k: v for k, v in state.items()}, strict=False, assign=assign)
    empty = [name for name, tensor in (*module.named_parameters(), *module.named_buffers()) if tensor.is_meta]
    if empty:  # an optional key absent where the module was built empty: nothing ever set it
        raise HeadLoadError(f"{source}: missing {', '.join(empty[:6])}")


@contextlib.contextmanager
def built_empty():
    """Modules built inside get their tensors on the meta device: no memory and no random initialization
    (~0.07 s for a 0.5B's EAGLE-3 head on a Xeon core) for weights that `load_strict(..., assign=True)`
    replaces next. Tensors passed in (the target's shared embedding) stay what they are."""
    with torch.device("meta"):
        yield
