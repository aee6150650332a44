"""Batches: which sequences train together, and the arrays one forward pass reads.

An optimizer step takes about `batch_tokens` tokens, as one or more forward passes of up to
`batch_size` sequences each, right-padded to the longest (sequences are grouped by length, so
padding stays small), flattened to the [m, F] the head's layers take, with the training-time
test's attention kept within each row (`UnrolledKeys(rows)`). Which positions each unrolled step
trains on is worked out on the host from the stored masks, so the device runs gathers of known
size and never waits on a value. The feature store stays on the CPU: a batch is read there
(`host_batch`, off the training thread) and moved where it is used (`to_device`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

SORT_WINDOW_BATCHES = 8  # sequences are grouped by length within windows of this many batches


@dataclass
class Selection:
    """The positions one unrolled step is scored on: `where` indexes the step's outputs, `target`
    the positions they predict (both flat indices into the batch), `count` how many (host-known)."""

    where: torch.Tensor
    target: torch.Tensor
    count: int


@dataclass
class Batch:
    """Several sequences, right-padded to `width` and flattened to rows * width positions, on a device."""

    rows: int
    width: int
    tokens: torch.Tensor  # [m] long
    positions: torch.Tensor  # [m] position within its row
    last: torch.Tensor  # [m] flat index of the row's last real position
    features: torch.Tensor  # [m, F] the head's input feature (bf16)
    final: torch.Tensor  # [m, H] the target's final normed state (bf16): teacher and regression target
    argmax: torch.Tensor  # [m] the target's argmax
    steps: list[Selection]  # per unrolled step
    far: Selection | None  # Jakiro's two-ahead output (step 0 only)
    real_tokens: int
    valid: list[torch.Tensor] | None = None  # evaluation: [m] bool per step, positions scored
    follows: list[torch.Tensor] | None = None  # evaluation: [m] bool per step, the next data token is the argmax


@dataclass
class HostBatch:
    """A batch's arrays on the host (built off the training thread), before `to_device`."""

    rows: int
    width: int
    arrays: dict[str, np.ndarray]
    steps: list[tuple[np.ndarray, np.ndarray]]
    far: tuple[np.ndarray, np.ndarray] | None
    real_tokens: int
    valid: list[np.ndarray] | None = None
    follows: list[np.ndarray] | None = None


def host_batch(store, ids: list[int], steps: int, fused: bool, in_vocab: np.ndarray | None, two_ahead: bool,
               evaluation: bool = False) -> HostBatch:
    """Read sequences `ids` and work out which positions every unrolled step is scored on.

    Training (`in_vocab` given) drops positions whose target argmax is outside the draft vocabulary;
    evaluation keeps them (a miss) and also returns full [m] masks for the simulated acceptance.
    """
    key = "aux" if fused else "final"
    names = ("final", "aux") if fused else ("final",)
    seqs = [store.arrays(i, names) for i in ids]
    rows, width = len(seqs), max(len(s["tokens"]) for s in seqs)
    tokens = np.zeros((rows, width), dtype=np.int64)
    argmax = np.zeros((rows, width), dtype=np.int64)
    last = np.zeros((rows, width), dtype=np.int64)
    feats = {name: np.zeros((rows, width, seqs[0][name].shape[1]), dtype=np.int16) for name in names}
    chosen = [([], []) for _ in range(steps)]
    far = ([], [])
    valid = [np.zeros(rows * width, dtype=bool) for _ in range(steps)] if evaluation else None
    follows = [np.zeros(rows * width, dtype=bool) for _ in range(steps)] if evaluation else None
    for row, seq in enumerate(seqs):
        n = len(seq["tokens"])
        base = row * width
        tokens[row, :n], argmax[row, :n] = seq["tokens"], seq["argmax"]
        last[row] = base + n - 1
        for name in names:
            feats[name][row, :n] = seq[name]
        t = np.arange(n)
        for step in range(steps):
            target = t + 1 + step  # the position whose distribution step `step` at t predicts
            ok = target + 1 < n
            t_ok, target_ok = t[ok], target[ok]
            keep = seq["mask"][target_ok + 1]
            if evaluation:
                valid[step][base + t_ok[keep]] = True
                follows[step][base + t_ok] = seq["tokens"][target_ok + 1] == seq["argmax"][target_ok]
            if in_vocab is not None:
                keep = keep & in_vocab[seq["argmax"][target_ok]]
            chosen[step][0].append(base + t_ok[keep])
            chosen[step][1].append(base + target_ok[keep])
        if two_ahead:
            ok = t + 3 < n
            t_ok = t[ok]
            keep = seq["mask"][t_ok + 3] & (in_vocab[seq["argmax"][t_ok + 2]] if in_vocab is not None else True)
            far[0].append(base + t_ok[keep])
            far[1].append(base + t_ok[keep] + 2)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
    return HostBatch(
        rows, width,
        {"tokens": tokens.reshape(-1), "argmax": argmax.reshape(-1), "last": last.reshape(-1),
         "features": feats[key].reshape(rows * width, -1), "final": feats["final"].reshape(rows * width, -1)},
        [(cat(w), cat(g)) for w, g in chosen], (cat(far[0]), cat(far[1])) if two_ahead else None,
        int(sum(len(s["tokens"]) for s in seqs)), valid, follows)


def to_device(host: HostBatch, device: torch.device) -> Batch:
    def put(array, dtype=None):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None:
            tensor = tensor.view(dtype)
        return tensor.to(device)

    a = host.arrays
    select = lambda pair: Selection(put(pair[0]), put(pair[1]), len(pair[0]))  # noqa: E731
    return Batch(
        host.rows, host.width, put(a["tokens"]),
        torch.arange(host.width, device=device).repeat(host.rows), put(a["last"]),
        put(a["features"], torch.bfloat16), put(a["final"], torch.bfloat16), put(a["argmax"]),
        [select(pair) for pair in host.steps], select(host.far) if host.far is not None else None,
        host.real_tokens,
        [put(v) for v in host.valid] if host.valid is not None else None,
        [put(f) for f in host.follows] if host.follows is not None else None,
    )



# ---------------------------------------------------------------------------------------------
# Data order


def micro_batches(order: list[int], lengths, rows: int, batch_tokens: int) -> list[list[int]]:
    """Consecutive groups of at most `rows` sequences and `batch_tokens` padded positions (a longer
    sequence goes alone)."""
    groups: list[list[int]] = []
    width = 0
    for i in order:
        wider = max(width, int(lengths[i]))
        if groups and len(groups[-1]) < rows and (len(groups[-1]) + 1) * wider <= batch_tokens:
            groups[-1].append(i)
            width = wider
        else:
            groups.append([i])
            width = int(lengths[i])
    return groups


def epoch_plan(train_ids: list[int], lengths, rows: int, batch_tokens: int, seed: int,
               epoch: int) -> list[list[list[int]]]:
    """The optimizer steps of one epoch, each a list of forward passes (lists of sequence ids) of
    about `batch_tokens` tokens together.

    A function of the seed and the epoch alone, so a resumed run needs only (epoch, step in epoch).
    With several sequences per pass, sequences are sorted by length within windows (little padding)
    and the passes are then shuffled.
    """
    rng = random.Random(f"specchat-train:{seed}:{epoch}")
    order = list(train_ids)
    rng.shuffle(order)
    if rows > 1:
        window = rows * SORT_WINDOW_BATCHES
        order = [i for s in range(0, len(order), window)
                 for i in sorted(order[s : s + window], key=lambda i: lengths[i])]
    passes = micro_batches(order, lengths, rows, batch_tokens)
    if rows > 1:
        rng.shuffle(passes)
    # An optimizer step takes passes while that brings its tokens nearer to batch_tokens.
    plan, group, tokens = [], [], 0
    for ids in passes:
        size = int(sum(lengths[i] for i in ids))
        if group and abs(tokens + size - batch_tokens) > abs(tokens - batch_tokens):
            plan.append(group)
            group, tokens = [], 0
        group.append(ids)
        tokens += size
    if group:
        plan.append(group)
    return plan

