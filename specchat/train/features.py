"""Target features for training: computed once and kept in memory-mapped files, or computed by
the target on the device for every batch.

What the recipes need from the (frozen) target's forward, per position: the final normed hidden
state (EAGLE-1/Jakiro input, and the teacher distribution through the target's LM head),
optionally the three EAGLE-3 feature layers, and the target's argmax.

- `FeatureStore` (`extract`): every training sequence runs through the target once and the
  results are stored; training reads slices of these files instead of re-running the target every
  epoch. Extraction runs the target on padded batches, appends, and records its progress in
  `index.json`, so an interrupted run continues where it stopped. Everything stored is on the CPU
  (memory-mapped); the trainer moves what a batch needs to its device. A CPU's choice: its target
  forward costs more than the head's training.
- `LiveFeatures`: only the token ids stay on the host; each packed batch runs through the target
  on the device (`packed_features`) right before the head trains on it. A GPU's choice: features
  of 50k conversations would take hundreds of GB of files, and the 0.5B's forward costs a GPU
  less than reading them back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specchat.inputs import write_atomically
from specchat.train.batched import packed_attention, rows_forward
from specchat.train.options import EXTRACT_TOKENS, on_device

LOGIT_CHUNK = 256  # positions per LM-head call on a CPU when taking the target's argmax (bounds memory)
WINDOW_BATCHES = 4  # extraction sorts by length within windows of this many batches' tokens
INDEX = "index.json"


def _bf16_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


class FeatureStore:
    """index.json + tokens.i32, mask.u8, argmax.i32, final.bf16 [N, H] and optionally aux.bf16 [N, 3H]."""

    holds_features = True

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
    """Padded positions per target forward (`EXTRACT_TOKENS`: a GPU wants wide batches)."""
    return on_device(EXTRACT_TOKENS, device)


def _logit_chunk(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else LOGIT_CHUNK


@torch.inference_mode()
def batch_features(target, id_lists: list[list[int]], layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's features (the `layers` hidden states, concatenated) and argmax for several
    sequences in one forward; per sequence ([n, F], [n]) on the target's device.

    Rows are right-padded: position t of every row keeps position id t, and causal attention keeps
    each real token from seeing the padding after it, so a row's states are those of running its
    sequence alone. The forward is the one decoding runs (`packed_features`, one sequence per row),
    so the features are those the head is given at inference: transformers' hidden-state records
    are not (under transformers 5.17 its index i is not the input of layer i). transformers'
    forward serves the families specchat's does not run (with the attention mask, as transformers
    documents for padded batches).
    """
    device = target.device
    width = max(len(ids) for ids in id_lists)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(id_lists), width), pad, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    if target.own_forward is not None:
        positions = torch.arange(width, device=device).expand(len(id_lists), width)
        features, argmax = packed_features(target, input_ids, positions, attention - 1, layers)  # padding: -1
        return [(features[row, : len(ids)], argmax[row, : len(ids)]) for row, ids in enumerate(id_lists)]
    select = [i for i in layers if i != target.num_layers]
    out = target.decoder(input_ids=input_ids, attention_mask=attention, use_cache=False,
                         output_hidden_states=select or False)
    final = out.last_hidden_state  # [rows, width, H], normed
    parts = [final if i == target.num_layers else out.hidden_states[i] for i in layers]
    features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    argmax = chunked_argmax(target, final[attention.bool()])  # [sum n], row after row
    results, start = [], 0
    for row, ids in enumerate(id_lists):
        results.append((features[row, : len(ids)], argmax[start : start + len(ids)]))
        start += len(ids)
    return results


def chunked_argmax(target, states: torch.Tensor) -> torch.Tensor:
    """The target's argmax after each of the final states [N, H], a chunk of LM-head rows at a time."""
    chunk = _logit_chunk(states.device)
    return torch.cat([target.lm_head(states[s : s + chunk]).argmax(-1) for s in range(0, len(states), chunk)])


@torch.no_grad()  # not inference mode: the head saves its inputs for its backward pass
def packed_features(target, input_ids: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor,
                    layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features (the `layers` hidden states, concatenated; the last one the final
    normed state) [R, n, F] and argmax [R, n] of packed rows (`specchat.train.batched.packed_attention`)."""
    forward = target.own_forward
    attention = packed_attention(documents, forward.scaling, forward.dtype)
    final, parts = rows_forward(forward, input_ids, positions, attention, layers)
    features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return features, chunked_argmax(target, final.flatten(0, 1)).view(input_ids.shape)


class LiveFeatures:
    """Training sequences (token ids and loss masks, on the host) whose target features the target
    computes on its device, one packed batch at a time (`specchat.train.batches.to_device`)."""

    holds_features = False

    def __init__(self, sequences: list[tuple[list[int], list[int]]], target, aux_layers: tuple[int, ...] | None):
        self.target, self.aux_layers = target, tuple(aux_layers or ())
        self.offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in sequences])]).astype(np.int64)
        self._tokens = np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in sequences])
        self._mask = np.concatenate([np.asarray(mask, dtype=bool) for _, mask in sequences])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def feature_layers(self) -> list[int]:
        return list(self.aux_layers)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def arrays(self, i: int, features: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """Sequence i's tokens and mask (its features come from `compute`)."""
        start, end = self.offsets[i], self.offsets[i + 1]
        return {"tokens": self._tokens[start:end], "mask": self._mask[start:end]}

    def tokens_and_masks(self):
        for i in range(len(self)):
            yield self._tokens[self.offsets[i] : self.offsets[i + 1]], self._mask[self.offsets[i] : self.offsets[i + 1]]

    def compute(self, tokens: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor):
        """The head's input features, the final states and the argmax [m, ...] of packed rows [R, n]."""
        layers = self.aux_layers + (self.target.num_layers,)
        features, argmax = packed_features(self.target, tokens, positions, documents, layers)
        features = features.flatten(0, 1)
        final = features[:, -self.target.hidden_size :]
        return (features[:, : -self.target.hidden_size] if self.aux_layers else final), final, argmax.flatten()


def live_features_fit(target, batch_tokens: int) -> bool:
    """Whether the target can compute a batch's features on its device beside the head's training:
    a CUDA device whose free memory holds, twice over, one batch's largest activations (a layer's
    MLP, the kept feature layers, a chunk of logits)."""
    if target.device.type != "cuda" or target.own_forward is None:
        return False
    text = target.config.get_text_config()
    activations = batch_tokens * (text.intermediate_size + 5 * target.hidden_size) * target.dtype.itemsize
    logits = _logit_chunk(target.device) * target.vocab_size * 4
    return 2 * (activations + logits) < torch.cuda.mem_get_info(target.device)[0]


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
            write_atomically(index_path, json.dumps(index))
            start = end
        index["complete"] = True
    finally:
        for handle in files.values():
            handle.flush()
            handle.close()
        write_atomically(index_path, json.dumps(index))
    return FeatureStore(folder)
