"""Draft heads: one file per published architecture, and `load_head`, which tells a checkpoint's format.

    base.py        the config fields every head shares and the `DraftHead` interface
    layers.py      RMSNorm, SwiGLU, rotary embedding, attention, the head's KV cache
    checkpoint.py  config.json and weight files, strict loading
    eagle.py       EAGLE-1/2        eagle3.py  EAGLE-3        jakiro.py  Jakiro (MoE)

Each architecture module declares its NAME, the KEYS its checkpoints hold, its published
KEY_MAP, `matches(keys)` and `load(...)`. A head folder (local, bundled, or a hub id fetched
through the hub client) holds `config.json` and `model.safetensors` (or shards with an index, or
`pytorch_model.bin`). The format is told from the checkpoint's keys, and loading is strict: a
missing, unexpected or mis-shaped key, or a hidden size or vocabulary that is not the target's,
is an error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specchat.drafters import eagle, eagle3, jakiro
from specchat.drafters.base import DraftHead
from specchat.drafters.checkpoint import HeadLoadError, read_config, read_safetensors, read_weights, write_weights
from specchat import heads
from specchat.hub import HUB_ID, HubError, hub_folder

FORMATS = {module.KIND: module for module in (eagle, eagle3, jakiro)}  # in the order of methods.HEAD_FORMATS
# Told apart most specific first: a Jakiro checkpoint also has every key an EAGLE one has.
DETECTION_ORDER = (eagle3, jakiro, eagle)
HEAD_FILES = ["*.json", "*.safetensors", "*.bin"]
# specchat's extension for heads that use the target's LM head (EAGLE-1/2, Jakiro): the token ids
# they draft over. Other engines ignore the file and draft over the whole vocabulary, which is
# equally lossless, only slower on a CPU.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"

__all__ = ["DraftHead", "HeadLoadError", "load_head", "save_head", "FORMATS"]


def known_formats() -> str:
    return "; ".join(f"{module.NAME} ({module.KEYS})" for module in FORMATS.values())


def detect_kind(state: dict, source) -> str:
    keys = set(state)
    for module in DETECTION_ORDER:
        if module.matches(keys):
            return module.KIND
    raise HeadLoadError(f"{source}: unrecognised draft head format; known formats: {known_formats()}")


def map_keys(state: dict, key_map: dict[str, str]) -> dict:
    """Rename published key prefixes to the modules' names (`KEY_MAP` of an architecture)."""
    def mapped(key: str) -> str:
        for old, new in key_map.items():
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return {mapped(key): value for key, value in state.items()}


def resolve_folder(name: str) -> Path:
    """A bundled head by name, a head folder on disk, or a hub repository snapshot."""
    bundled = heads.bundled_heads()
    if name in bundled:
        return bundled[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HeadLoadError(f"{name} is a file; a draft head is a folder with config.json and weights")
    if not HUB_ID.match(name):
        raise HeadLoadError(f"no draft head {name!r}: not a folder and not a hub id (org/name)")
    try:
        return Path(hub_folder(name, HEAD_FILES))
    except HubError as error:  # a mistyped relative path looks like a hub id too: say both
        raise HeadLoadError(f"no draft head {name!r}: no such folder here ({Path.cwd()}), and as a hub id: {error}") \
            from error


def load_head(name: str, target, kind: str | None = None) -> DraftHead:
    """Load the draft head at `name` (folder or hub id) for `target`, in the target's dtype and device."""
    folder = resolve_folder(name)
    raw_config = read_config(folder)
    state, source = read_weights(folder)
    detected = detect_kind(state, source)
    if kind is not None and kind != detected:
        raise HeadLoadError(f"{source}: this is a {FORMATS[detected].NAME} head, not {FORMATS[kind].NAME}")
    module = FORMATS[detected]
    head = module.load(folder, raw_config, map_keys(state, module.KEY_MAP), source, target)
    vocab_path = folder / DRAFT_VOCAB_FILE
    if vocab_path.is_file() and head.uses_target_lm_head:
        ids = read_safetensors(vocab_path).get("token_ids")
        if ids is None or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or \
                (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size)):
            raise HeadLoadError(f"{vocab_path}: expected a 1-D integer tensor 'token_ids' of target token ids")
        head.restrict_vocab(ids.long())
    return head


def save_head(head: DraftHead, folder, dtype=None, max_shard_bytes: int | None = None) -> None:
    """Write a head in its published format: config.json + model.safetensors (shared tensors
    excluded), split into indexed shards past `max_shard_bytes`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, tensor in head.trainable_state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[key] = tensor.contiguous().cpu()
    write_weights(state, folder, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    if head.uses_target_lm_head and head.draft_to_target is not None:
        save_file({"token_ids": head.draft_to_target.cpu()}, folder / DRAFT_VOCAB_FILE)
