"""Target features for training, computed once and kept in memory-mapped files.

Every training sequence runs through the (frozen) target once. What the recipes need from that
forward is stored per position: the final normed hidden state (EAGLE-1/Jakiro input, and the
teacher distribution through the target's LM head), optionally the three EAGLE-3 feature layers,
and the target's argmax. Training then reads slices of these files instead of re-running the
target every epoch. Extraction appends and records its progress in `index.json`, so an
interrupted run continues where it stopped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specchat.decode.cache import KVCache

LOGIT_CHUNK = 256  # positions per LM-head call when taking the target's argmax (bounds memory)
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

    def tokens_and_masks(self):
        """All (tokens, mask) pairs, for counting token frequencies without touching features."""
        for i in range(len(self)):
            start, end = self.offsets[i], self.offsets[i + 1]
            yield np.asarray(self._tokens[start:end]), np.asarray(self._mask[start:end]).astype(bool)


@torch.inference_mode()
def extract(folder: Path, sequences: list[tuple[list[int], list[int]]], target, aux_layers: tuple[int, ...] | None,
            progress: Callable[[int, int], None] | None = None) -> FeatureStore:
    """Run the target over every (ids, mask) sequence and store what training needs (resumable)."""
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
    try:
        for i in range(len(index["offsets"]) - 1, len(sequences)):
            ids, mask = sequences[i]
            out = target.forward(torch.tensor([ids], device=target.device), KVCache(), logits_for="none",
                                 feature_layers=layers)
            width = target.hidden_size
            final = out.features[:, -width:]
            argmax = torch.cat([target.lm_head(final[s : s + LOGIT_CHUNK]).argmax(-1)
                                for s in range(0, len(ids), LOGIT_CHUNK)])
            files["tokens.i32"].write(np.asarray(ids, dtype=np.int32).tobytes())
            files["mask.u8"].write(np.asarray(mask, dtype=np.uint8).tobytes())
            files["argmax.i32"].write(argmax.to(torch.int32).cpu().numpy().tobytes())
            files["final.bf16"].write(_bf16_bytes(final))
            if aux_layers:
                files["aux.bf16"].write(_bf16_bytes(out.features[:, :-width]))
            index["positions"] += len(ids)
            index["offsets"].append(index["positions"])
            if i % 20 == 0 or i == len(sequences) - 1:
                for handle in files.values():
                    handle.flush()
                _write_index(index_path, index)
            if progress:
                progress(i + 1, len(sequences))
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
