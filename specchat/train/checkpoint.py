"""Training checkpoints: resumable, written atomically, in files small enough to move between machines.

A checkpoint is the folder OUTPUT/checkpoint/ holding `checkpoint.json` and safetensors files of
at most SHARD_BYTES (16 MiB) each; a tensor larger than that is stored as flat chunks. It holds:

- the head's weights (its `trainable_state_dict`, d2t/t2d included),
- AdamW's state (both moments, and its step count in the JSON),
- the torch RNG states (CPU, and the CUDA device's),
- the trainer's position: optimizer step, epoch and step within it (the order of every epoch is a
  function of the seed, so this is the data order position), tokens seen, evaluations, best so far,
- a fingerprint of what must not change across a resume (format, head config, draft vocabulary,
  training sequences, batch shape, seed).

Two precisions:
- exact: float32 weights and moments, 12 bytes per parameter. Resuming continues bit for bit
  (tested on the CPU).
- compact: bfloat16 weights, the second moment quantized to 8 bits per value on a logarithmic
  scale per block of 4096 values (one float32 min and max of log2 per block), and no first
  moment: 3 bytes per parameter. The resumed run restarts AdamW's momentum from zero (rebuilt
  within ~10 steps at beta1 = 0.9) and divides by the square root of a second moment that is off
  by at most 2^(s/508) - 1 where a block's values span s octaves (2.8% for 20 octaves), forgotten
  within ~20 steps at beta2 = 0.95; the fp32 master weights lose the bits bfloat16 does not hold
  (relative 2^-9, well under one step's update). Not bit-exact, by design.
`auto` writes exact when that fits in CHECKPOINT_BUDGET_BYTES (64 MiB, `specchat.train.options`),
else compact. EAGLE-3's head for Qwen2.5-0.5B (18.1M parameters with an 8192-token draft
vocabulary) is 217 MB exact, 54 MB compact.

Writing is atomic: the new files get fresh names, then `checkpoint.json` is replaced in one
rename, then the previous checkpoint's files are deleted. An interruption at any point leaves
the previous or the new checkpoint whole.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters import HeadLoadError, load_strict
from specchat.errors import UsageError
from specchat.train.options import CHECKPOINT_BUDGET_BYTES, CHECKPOINT_PRECISIONS

FOLDER, INDEX = "checkpoint", "checkpoint.json"  # OUTPUT/checkpoint/ beside the head; its index
FORMAT = "specchat-train-checkpoint"
VERSION = 1
SHARD_BYTES = 16 * 2**20
BLOCK = 4096  # values per quantization block of the compact second moment
LEVELS = 254  # codes 1..255 span a block's log2 range; code 0 is an exact zero


class ResumeError(UsageError, ValueError):
    """A checkpoint that cannot be resumed here (another format, data or batch shape, or damaged)."""


@dataclass
class Loaded:
    folder: Path
    meta: dict  # checkpoint.json
    tensors: dict[str, torch.Tensor]  # on the CPU


def exists(folder: Path) -> bool:
    return (Path(folder) / INDEX).is_file()


def parameter_count(head) -> int:
    return sum(t.numel() for t in head.trainable_state_dict().values() if t.is_floating_point())


def size_estimate(head, precision: str) -> int:
    """Bytes of a checkpoint of `head` at `precision` (exact or compact), file headers aside."""
    state = head.trainable_state_dict()
    fixed = sum(t.numel() * t.element_size() for t in state.values() if not t.is_floating_point())
    count = parameter_count(head)
    if precision == "exact":
        return fixed + 12 * count
    return fixed + 3 * count + 8 * (count // BLOCK + len(state))


def choose_precision(head, precision: str) -> str:
    if precision not in CHECKPOINT_PRECISIONS:
        raise UsageError(f"unknown checkpoint precision {precision!r} (use {', '.join(CHECKPOINT_PRECISIONS)})")
    if precision != "auto":
        return precision
    return "exact" if size_estimate(head, "exact") <= CHECKPOINT_BUDGET_BYTES else "compact"


# ---------------------------------------------------------------------------------------------
# Compact second moment: 8-bit log2 codes per block


def encode_log8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values -> (uint8 codes [n], float32 [blocks, 2] log2 ranges)."""
    flat = values.detach().float().reshape(-1).cpu()
    n = flat.numel()
    padded = torch.zeros((n + BLOCK - 1) // BLOCK * BLOCK)
    padded[:n] = flat
    blocks = padded.view(-1, BLOCK)
    positive = blocks > 0
    logs = torch.where(positive, blocks.clamp_min(torch.finfo(torch.float32).tiny).log2(), 0.0)
    lo = torch.where(positive, logs, torch.inf).amin(1)
    hi = torch.where(positive, logs, -torch.inf).amax(1)
    empty = ~positive.any(1)
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    span = (hi - lo).clamp_min(1e-12)
    codes = torch.where(positive, 1 + torch.round((logs - lo[:, None]) / span[:, None] * LEVELS), 0)
    return codes.to(torch.uint8).reshape(-1)[:n].contiguous(), torch.stack([lo, hi], dim=1)


def decode_log8(codes: torch.Tensor, ranges: torch.Tensor, shape) -> torch.Tensor:
    n = codes.numel()
    padded = torch.zeros((n + BLOCK - 1) // BLOCK * BLOCK)
    padded[:n] = codes.float()
    blocks = padded.view(-1, BLOCK)
    lo, hi = ranges[:, 0:1], ranges[:, 1:2]
    values = torch.where(blocks > 0, torch.exp2(lo + (blocks - 1) / LEVELS * (hi - lo)), 0.0)
    return values.reshape(-1)[:n].reshape(shape)


# ---------------------------------------------------------------------------------------------
# Saving and loading


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"rng/cpu": torch.get_rng_state()}
    if device.type == "cuda" and torch.cuda.is_available():
        states["rng/cuda"] = torch.cuda.get_rng_state(device)
    return states


def collect(head, optimizer, names: list[str], precision: str, device: torch.device) -> tuple[dict, dict]:
    """The tensors of a checkpoint (CPU) and what checkpoint.json says about the optimizer."""
    tensors = {}
    for key, value in head.trainable_state_dict().items():
        value = value.detach()
        if value.is_floating_point():
            value = value.to(torch.float32 if precision == "exact" else torch.bfloat16)
        tensors[f"head/{key}"] = value.cpu().contiguous()
    params = optimizer.param_groups[0]["params"]
    steps = set()
    for name, param in zip(names, params):
        state = optimizer.state.get(param)
        if not state:
            continue
        steps.add(float(state["step"]))
        if precision == "exact":
            tensors[f"adam/{name}/exp_avg"] = state["exp_avg"].detach().float().cpu().contiguous()
            tensors[f"adam/{name}/exp_avg_sq"] = state["exp_avg_sq"].detach().float().cpu().contiguous()
        else:
            codes, ranges = encode_log8(state["exp_avg_sq"])
            tensors[f"adam/{name}/exp_avg_sq.log8"] = codes
            tensors[f"adam/{name}/exp_avg_sq.ranges"] = ranges
    tensors.update(_rng_states(device))
    return tensors, {"parameters": names, "step": steps.pop() if len(steps) == 1 else None}


def _pieces(tensors: dict[str, torch.Tensor], limit: int):
    """(name, tensor) with every tensor over `limit` bytes cut into flat chunks named name@k."""
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if size <= limit:
            yield name, tensor, None
            continue
        per = max(1, limit // tensor.element_size())
        flat = tensor.reshape(-1)
        for k, start in enumerate(range(0, flat.numel(), per)):
            yield f"{name}@{k}", flat[start : start + per].clone(), (name, list(tensor.shape))


def save(folder: Path, tensors: dict[str, torch.Tensor], meta: dict, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write a checkpoint atomically (see the module doc); returns its checkpoint.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"step{meta['state']['step']:08d}-{uuid.uuid4().hex[:6]}"
    shards: list[dict[str, torch.Tensor]] = []
    used: list[int] = []
    chunked: dict[str, list] = {}
    budget = shard_bytes - 64 * 1024  # room for the safetensors header
    pieces = list(_pieces(tensors, budget))
    for name, tensor, whole in sorted(pieces, key=lambda p: -p[1].numel() * p[1].element_size()):
        size = tensor.numel() * tensor.element_size()
        # First fit, largest first: as few files as the sizes allow.
        k = next((k for k, u in enumerate(used) if u + size <= budget), None)
        if k is None:
            shards.append({})
            used.append(0)
            k = len(shards) - 1
        shards[k][name] = tensor
        used[k] += size
    for name, tensor, whole in pieces:  # chunk order as cut
        if whole is not None:
            chunked.setdefault(whole[0], [whole[1], str(tensor.dtype).removeprefix("torch."), []])[2].append(name)
    files, total = [], 0
    for k, shard in enumerate(shards, start=1):
        name = f"{stamp}-{k:02d}.safetensors"
        tmp = folder / (name + ".tmp")
        save_file(shard, str(tmp))
        os.replace(tmp, folder / name)
        files.append(name)
        total += (folder / name).stat().st_size
    meta = {**meta, "format": FORMAT, "version": VERSION, "files": files, "chunked": chunked, "bytes": total}
    text = json.dumps(meta, indent=1)
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, folder / INDEX)
    for stale in folder.iterdir():  # the previous checkpoint's files, and leftovers of interrupted writes
        if stale.name != INDEX and stale.name not in files:
            stale.unlink()
    return meta


def load(folder: Path) -> Loaded:
    folder = Path(folder)
    try:
        meta = json.loads((folder / INDEX).read_text())
    except (OSError, ValueError) as error:
        raise ResumeError(f"{folder / INDEX}: cannot read the checkpoint ({error})") from error
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ResumeError(f"{folder / INDEX}: not a version-{VERSION} specchat training checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for name in meta["files"]:
        path = folder / name
        if not path.is_file():
            raise ResumeError(f"{folder}: checkpoint file {name} is missing (copy every file of the checkpoint)")
        tensors.update(load_file(str(path)))
    for name, (shape, _, parts) in meta["chunked"].items():
        tensors[name] = torch.cat([tensors.pop(part) for part in parts]).reshape(shape)
    return Loaded(folder, meta, tensors)


def restore(loaded: Loaded, head, optimizer, names: list[str], device: torch.device) -> None:
    """Put the checkpoint's weights, optimizer state and RNG states back."""
    tensors, meta = loaded.tensors, loaded.meta
    state = {key.removeprefix("head/"): value for key, value in tensors.items() if key.startswith("head/")}
    trained = head.trainable_state_dict()  # what a checkpoint holds: the rest is the target's, set up by the head
    try:
        load_strict(head, state, loaded.folder, optional=tuple(key for key in head.state_dict() if key not in trained))
    except HeadLoadError as error:
        raise ResumeError(f"the head's weights do not fit: {error}") from error
    head.after_load()  # what the head derives from its loaded buffers (EAGLE-3's draft-to-target map)
    params = optimizer.param_groups[0]["params"]
    optimizer_state = {}
    adam_step = meta["optimizer"]["step"]
    for index, (name, param) in enumerate(zip(names, params)):
        if f"adam/{name}/exp_avg" in tensors:
            exp_avg, exp_avg_sq = tensors[f"adam/{name}/exp_avg"], tensors[f"adam/{name}/exp_avg_sq"]
        elif f"adam/{name}/exp_avg_sq.log8" in tensors:
            exp_avg_sq = decode_log8(tensors[f"adam/{name}/exp_avg_sq.log8"], tensors[f"adam/{name}/exp_avg_sq.ranges"],
                                     param.shape)
            exp_avg = torch.zeros_like(exp_avg_sq)
        else:
            continue
        optimizer_state[index] = {"step": torch.tensor(float(adam_step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": optimizer_state, "param_groups": saved["param_groups"]})
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"], device)
