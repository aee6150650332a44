"""Draft-head architectures, one file each, and `load_head`, which recognises a checkpoint's format.

A head folder (local, or a hub id fetched through the hub client) holds `config.json` and
`model.safetensors` or `pytorch_model.bin`. The format is told from the checkpoint's keys, and
loading is strict: a missing, unexpected or mis-shaped key, or a hidden size or vocabulary that
is not the target's, is an error that names it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafters import eagle, eagle3, jakiro
from drafters.common import HeadLoadError, read_config, read_weights, write_weights

# kind -> (name, how its keys look, loader)
FORMATS = {
    "eagle": ("EAGLE-1/2", "fc [H, 2H] + layers.0.* without input_layernorm", eagle.load),
    "eagle3": ("EAGLE-3", "fc [H, 3H] + midlayer.* + norm + lm_head (+ d2t/t2d)", eagle3.load),
    "jakiro": ("Jakiro", "fc [H, 2H] + layers.0.* with mlp_moe.gate [4, H] and two experts", jakiro.load),
}
HEAD_FILES = ["*.json", "*.safetensors", "*.bin"]
# specchat's extension for heads that use the target's LM head (EAGLE-1/2, Jakiro): the token ids
# they draft over. Other engines ignore the file and draft over the whole vocabulary, which is
# equally lossless, only slower on a CPU.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def known_formats() -> str:
    return "; ".join(f"{name} ({keys})" for name, keys, _ in FORMATS.values())


def detect_kind(state: dict, source) -> str:
    keys = set(state)
    if any(k.startswith("midlayer.") for k in keys) or "layers.0.hidden_norm.weight" in keys:
        return "eagle3"
    if any(".mlp_moe." in k for k in keys):
        return "jakiro"
    if "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys:
        return "eagle"
    raise HeadLoadError(f"{source}: unrecognised draft head format; known formats: {known_formats()}")


def resolve_folder(name: str) -> Path:
    """A bundled head by name, a head folder on disk, or a hub repository snapshot."""
    from specchat.heads import bundled_heads

    bundled = bundled_heads()
    if name in bundled:
        return bundled[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HeadLoadError(f"{name} is a file; a draft head is a folder with config.json and weights")
    from specchat.target import HUB_ID, HubError, hub_folder

    if not HUB_ID.match(name):
        raise HeadLoadError(f"no draft head {name!r}: not a folder and not a hub id (org/name)")
    try:
        return Path(hub_folder(name, HEAD_FILES))
    except HubError as error:
        raise HeadLoadError(str(error)) from error


def load_head(name: str, target, kind: str | None = None):
    """Load the draft head at `name` (folder or hub id) for `target`, in the target's dtype and device."""
    folder = resolve_folder(name)
    raw_config = read_config(folder)
    state, source = read_weights(folder)
    detected = detect_kind(state, source)
    if kind is not None and kind != detected:
        raise HeadLoadError(f"{source}: this is a {FORMATS[detected][0]} head, not {FORMATS[kind][0]}")
    head = FORMATS[detected][2](folder, raw_config, state, source, target)
    vocab_path = folder / DRAFT_VOCAB_FILE
    if vocab_path.is_file() and hasattr(head, "restrict_vocab"):
        from safetensors.torch import load_file

        ids = load_file(vocab_path).get("token_ids")
        if ids is None or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or \
                (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size)):
            raise HeadLoadError(f"{vocab_path}: expected a 1-D integer tensor 'token_ids' of target token ids")
        head.restrict_vocab(ids.long())
    return head


def save_head(head, folder, dtype=None, max_shard_bytes: int | None = None) -> None:
    """Write a head in its published format: config.json + model.safetensors (shared tensors
    excluded), split into indexed shards past `max_shard_bytes`."""
    import json

    from safetensors.torch import save_file

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
    if head.kind in ("eagle", "jakiro") and head.draft_to_target is not None:
        save_file({"token_ids": head.draft_to_target.cpu()}, folder / DRAFT_VOCAB_FILE)
