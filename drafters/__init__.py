"""Draft heads: one file per published architecture, and `load_head`, which tells a checkpoint's format.

    base.py        the `DraftHead` interface, the `TargetParts` a head needs of its target
    layers.py      the config fields every head shares; RMSNorm, SwiGLU, rotary embedding,
                   attention, the decoder layer
    attention.py   grouped-query attention by the faster path for its shape
    cache.py       the head's KV cache (grows in place; trimmed and compacted explicitly)
    checkpoint.py  config.json and weight files, strict loading
    eagle.py       EAGLE-1/2        eagle3.py  EAGLE-3        jakiro.py  Jakiro (MoE)

A package of its own, importing torch, safetensors and the standard library only, so that anyone
can read, test and reuse the heads without the chat tool around them (specchat is one user).

Each architecture module declares its NAME, the KEYS its checkpoints hold, its published
KEY_MAP, its CONFIG class, its HEAD class, the LAYOUTS it is written in (`export_head`: the reference one, SGLang's,
vLLM's speculators one), `matches(keys)` and `load(...)`. A head folder holds `config.json` and
`model.safetensors` (or shards with an index, or `pytorch_model.bin`, read with weights_only).
The format is told from the checkpoint's keys, and loading is strict: a missing, unexpected or
mis-shaped key, or a hidden size or vocabulary that is not the target's, is a `HeadLoadError`
whose one-line message names it. Finding a folder (bundled heads, hub ids) is the caller's job.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafters import eagle, eagle3, jakiro
from drafters.base import DraftHead, TargetParts
from drafters.checkpoint import HeadLoadError, load_strict, read_config, read_safetensors, read_weights, write_weights
from drafters.layers import SPECULATIVE_TOKENS, Verifier

FORMATS = {module.KIND: module for module in (eagle, eagle3, jakiro)}
# Told apart most specific first: a Jakiro checkpoint also has every key an EAGLE one has.
DETECTION_ORDER = (eagle3, jakiro, eagle)
HEAD_FILES = ["*.json", "*.safetensors", "*.bin"]  # what a head folder holds (to fetch one)
# specchat's extension for heads that use the target's LM head (EAGLE-1/2, Jakiro): the token ids
# they draft over. Other engines ignore the file and draft over the whole vocabulary, which is
# equally lossless, only slower on a CPU.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"

LAYOUTS = ("eagle", "sglang", "speculators")  # what `export_head` writes (each format says which of them it has)
# Files a head folder may hold beside its weights and config, carried over by `export_head`.
CARRIED_FILES = (DRAFT_VOCAB_FILE, "training.json")

__all__ = ["DraftHead", "TargetParts", "Verifier", "HeadLoadError", "load_strict", "load_head", "SPECULATIVE_TOKENS", "save_head", "export_head", "FORMATS", "LAYOUTS"]


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


def load_head(folder: str | Path, target: TargetParts, kind: str | None = None) -> DraftHead:
    """Load the draft head in `folder` for `target`, in the target's dtype and device.

    `kind` (a key of FORMATS) is what the caller expects; another format is an error.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HeadLoadError(f"{folder} is not a folder; a draft head is a folder with config.json and weights")
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


def export_head(source, output, layout: str, verifier: Verifier = Verifier(), speculative_tokens: int = SPECULATIVE_TOKENS,
                feature_layers: tuple[int, ...] | None = None, max_shard_bytes: int | None = None) -> list[Path]:
    """Write the head in folder `source` in a published `layout` other engines load as it is (no
    conversion by hand), into folder `output`; returns the files written.

    "eagle" is the reference repositories' layout; "sglang" the same files, which SGLang reads as
    they are; "speculators" vLLM's (EAGLE-3 heads). `verifier` is the target: the speculators
    layout names it, and every layout says its context (max_position_embeddings; the head's own
    where the target's is not given, an error where neither is). `feature_layers`: the target
    layers to capture where the head does not say (the defaults for its target, so that the file
    says them). The weights keep their dtype.
    """
    source, output = Path(source), Path(output)
    raw, (state, where) = read_config(source), read_weights(source)
    module = FORMATS[detect_kind(state, where)]
    if layout not in module.LAYOUTS:
        raise HeadLoadError(f"{where}: a {module.NAME} head is written in the {', '.join(module.LAYOUTS)} "
                            f"layout{'s' if len(module.LAYOUTS) > 1 else ''}, not {layout}")
    context = verifier.max_position_embeddings or layer_fields(raw).get("max_position_embeddings")
    if not context:
        raise HeadLoadError(f"{source}: neither the head's config nor the target given says the target's context "
                            f"(max_position_embeddings); without it serving engines size the head's positions "
                            f"for 2048 or 8192 tokens and accept nothing beyond: give it")
    config = module.CONFIG.from_dict(raw, str(source / "config.json"))
    try:
        config_dict = config.layout_dict(layout, verifier, speculative_tokens, feature_layers)
    except HeadLoadError as error:
        raise HeadLoadError(f"{source}: {error}") from error
    layer_fields(config_dict)["max_position_embeddings"] = context
    state = map_keys(map_keys(state, module.KEY_MAP), module.LAYOUTS[layout])
    output.mkdir(parents=True, exist_ok=True)
    written = write_weights({key: tensor.contiguous() for key, tensor in state.items()}, output, max_shard_bytes)
    (output / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    written.append(output / "config.json")
    for name in CARRIED_FILES:
        if (source / name).is_file() and (source / name).resolve() != (output / name).resolve():
            shutil.copyfile(source / name, output / name)
            written.append(output / name)
    return written


def layer_fields(config: dict) -> dict:
    """The Llama fields of a head's config.json: at its top, or nested where the speculators layout puts them."""
    return config.get("transformer_layer_config", config)
