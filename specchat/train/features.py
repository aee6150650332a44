"""Target features for training, computed once and kept in memory-mapped files.

Every training sequence runs through the (frozen) target once. What the recipes need from that
forward is stored per position: the final normed hidden state (EAGLE-1/Jakiro input, and the
teacher distribution through the target's LM head), optionally the three EAGLE-3 feature layers,
and the target's argmax. Training then reads slices of these files instead of re-running the
target every epoch. Extraction runs the target on padded batches of sequences, appends, and
records its progress in `index.json`, so an interrupted run continues where it stopped.

Everything stored is on the CPU (memory-mapped); the trainer moves what a batch needs to its device.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

LOGIT_CHUNK = 256  # positions per LM-head call on a CPU when taking the target's argmax (bounds memory)
WINDOW_BATCHES = 4  # extraction sorts by length within windows of this many batches' tokens
INDEX = "index.json"


def _bf16_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


class FeatureStore:
    """index.json + tokens.i32, mask.u8, argmax.i32, final.bf16 [N, H] and optionally aux.bf16 [N, 3H]."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.index = json.loads((self.folder / INDEX).read_text())
        total, final_width, aux_width = self.index["positions"], self.index["final_width"], self.index["aux_width"]
        self.offsets = self.index["offsets"]

        def open_array(name, dtype, width=None):
            if total == 0:
                return np.zeros((0,) if width is None else (0, width), dtype=dtype)
            shape = (total,) if width is None else (total, width)
            return np.memmap(self.folder / name, dtype=dtype, mode="r", shape=shape)

        self._tokens = open_array("tokens.i32", np.int32)
        self._mask = open_array("mask.u8", np.uint8)
        self._argmax = open_array("argmax.i32", np.int32)
        self._final = open_array("final.bf16", np.int16, final_width)
        self._aux = open_array("aux.bf16", np.int16, aux_width) if aux_width else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def feature_layers(self) -> list[int]:
        return self.index["aux_layers"]

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        start, end = self.offsets[i], self.offsets[i + 1]
        out = {
            "tokens": torch.from_numpy(np.array(self._tokens[start:end], dtype=np.int64)),
            "mask": torch.from_numpy(np.array(self._mask[start:end], dtype=np.int64)).bool(),
            "argmax": torch.from_numpy(np.array(self._argmax[start:end], dtype=np.int64)),
            "final": torch.from_numpy(np.array(self._final[start:end])).view(torch.bfloat16),
        }
        if self._aux is not None:
            out["aux"] = torch.from_numpy(np.array(self._aux[start:end])).view(torch.bfloat16)
        return out

    def lengths(self) -> np.ndarray:
        """Positions of every sequence."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def arrays(self, i: int, features: tuple[str, ...] = ("final",)) -> dict[str, np.ndarray]:
        """Sequence i as numpy arrays, read from the files: tokens, mask (bool), argmax and the named
        features ("final", "aux") as their bf16 bit patterns (int16)."""
        start, end = self.offsets[i], self.offsets[i + 1]
        out = {"tokens": np.asarray(self._tokens[start:end]), "mask": np.asarray(self._mask[start:end]).astype(bool),
               "argmax": np.asarray(self._argmax[start:end])}
        for name in features:
            out[name] = np.asarray((self._final if name == "final" else self._aux)[start:end])
        return out

    def tokens_and_masks(self):
        """All (tokens, mask) pairs, for counting token frequencies without touching features."""
        for i in range(len(self)):
            start, end = self.offsets[i], self.offsets[i + 1]
            yield np.asarray(self._tokens[start:end]), np.asarray(self._mask[start:end]).astype(bool)


def default_extract_tokens(device: torch.device) -> int:
    """Padded positions per target forward: a GPU wants wide batches, a CPU gains little past a few thousand."""
    return 32768 if device.type == "cuda" else 4096


def _logit_chunk(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else LOGIT_CHUNK


@torch.inference_mode()
def batch_features(target, id_lists: list[list[int]], layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's features (the `layers` hidden states, concatenated) and argmax for several
    sequences in one forward; per sequence ([n, F], [n]) on the target's device.

    Rows are right-padded: position t of every row keeps position id t, and causal attention keeps
    each real token from seeing the padding after it, so a row's states are those of running its
    sequence alone (the attention mask is passed too, as transformers documents for padded batches).
    """
    device = target.device
    width = max(len(ids) for ids in id_lists)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(id_lists), width), pad, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
    select = [i for i in layers if i != target.num_layers]
    out = target.decoder(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False,
                         output_hidden_states=select or False)
    final = out.last_hidden_state  # [rows, width, H], normed
    parts = [final if i == target.num_layers else out.hidden_states[i] for i in layers]
    features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    real = final[attention.to(device).bool()]  # [sum n, H], row after row
    chunk = _logit_chunk(device)
    argmax = torch.cat([target.lm_head(real[s : s + chunk]).argmax(-1) for s in range(0, len(real), chunk)])
    results, start = [], 0
    for row, ids in enumerate(id_lists):
        results.append((features[row, : len(ids)], argmax[start : start + len(ids)]))
        start += len(ids)
    return results


def _length_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """`indices` grouped, shortest first, into batches of at most `batch_tokens` padded positions."""
    batches: list[list[int]] = []
    for i in sorted(indices, key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def extract(folder: Path, sequences: list[tuple[list[int], list[int]]], target, aux_layers: tuple[int, ...] | None,
            progress: Callable[[int, int], None] | None = None, batch_tokens: int | None = None) -> FeatureStore:
    """Run the target over every (ids, mask) sequence and store what training needs (resumable).

    Sequences go through the target in padded batches of about `batch_tokens` positions, formed
    by length within windows of consecutive sequences; each window is written in order, so the
    store's sequence i is always `sequences[i]` and an interrupted run resumes at a window.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / INDEX
    fingerprint = {"count": len(sequences), "first": sequences[0][0][:32] if sequences else [],
                   "aux_layers": list(aux_layers or []), "target": target.name}
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    if index is None or index.get("fingerprint") != fingerprint:
        index = {"fingerprint": fingerprint, "offsets": [0], "positions": 0, "final_width": target.hidden_size,
                 "aux_width": target.hidden_size * len(aux_layers) if aux_layers else 0,
                 "aux_layers": list(aux_layers or []), "complete": False}
        for name in ("tokens.i32", "mask.u8", "argmax.i32", "final.bf16", "aux.bf16"):
            (folder / name).unlink(missing_ok=True)
    files = {name: open(folder / name, "ab") for name in ("tokens.i32", "mask.u8", "argmax.i32", "final.bf16")}
    if index["aux_width"]:
        files["aux.bf16"] = open(folder / "aux.bf16", "ab")
    # Drop anything written after the last recorded sequence (an interrupted write).
    row_bytes = {"tokens.i32": 4, "mask.u8": 1, "argmax.i32": 4, "final.bf16": 2 * index["final_width"],
                 "aux.bf16": 2 * index["aux_width"]}
    for name, handle in files.items():
        handle.truncate(index["positions"] * row_bytes[name])
    layers = tuple(aux_layers or ()) + (target.num_layers,)
    width = target.hidden_size
    batch_tokens = batch_tokens or default_extract_tokens(target.device)
    lengths = [len(ids) for ids, _ in sequences]
    try:
        start = len(index["offsets"]) - 1
        while start < len(sequences):
            # A window: consecutive sequences worth a few batches (their features wait in memory until written).
            end, tokens = start, 0
            while end < len(sequences) and (end == start or tokens + lengths[end] <= WINDOW_BATCHES * batch_tokens):
                tokens += lengths[end]
                end += 1
            done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for batch in _length_batches(list(range(start, end)), lengths, batch_tokens):
                for i, (features, argmax) in zip(batch, batch_features(target, [sequences[i][0] for i in batch], layers)):
                    done[i] = (features.to("cpu", torch.bfloat16), argmax.to("cpu", torch.int32))
            for i in range(start, end):
                ids, mask = sequences[i]
                features, argmax = done.pop(i)
                files["tokens.i32"].write(np.asarray(ids, dtype=np.int32).tobytes())
                files["mask.u8"].write(np.asarray(mask, dtype=np.uint8).tobytes())
                files["argmax.i32"].write(argmax.numpy().tobytes())
                files["final.bf16"].write(_bf16_bytes(features[:, -width:]))
                if aux_layers:
                    files["aux.bf16"].write(_bf16_bytes(features[:, :-width]))
                index["positions"] += len(ids)
                index["offsets"].append(index["positions"])
                if progress:
                    progress(i + 1, len(sequences))
            for handle in files.values():
                handle.flush()
            _write_index(index_path, index)
            start = end
        index["complete"] = True
    finally:
        for handle in files.values():
            handle.flush()
            handle.close()
        _write_index(index_path, index)
    return FeatureStore(folder)


def _write_index(path: Path, index: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(index))
    os.replace(tmp, path)
