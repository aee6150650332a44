"""Batches: which sequences train together, and the arrays one forward pass reads.

An optimizer step takes about `batch_tokens` tokens, as one or more forward passes. A pass packs
several sequences into each of up to `batch_size` rows (first fit, as wide as its longest
sequence), flattened to the [m, F] the head's layers take; every position keeps its position
within its own sequence, and attention stays within each sequence (`UnrolledKeys(rows,
documents)`), so a packed batch computes what each sequence alone would (its loss equals the
unpacked batch's) with little padding. Which positions each unrolled step trains on is worked out
on the host from the masks and the target's argmax, so the device runs gathers of known size.

The features come from a feature store on the CPU (`specchat.train.features.FeatureStore`: a
batch is read there by `host_batch`, off the training thread, and moved where it is used by
`to_device`), or are computed on the device by the target itself, per batch
(`specchat.train.features.LiveFeatures`): then `to_device` runs the target first and reads its
argmax back before the positions are chosen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Selection:
    """The positions one unrolled step is scored on: `where` indexes the step's outputs, `target`
    the positions they predict (both flat indices into the batch), `count` how many (host-known)."""

    where: torch.Tensor
    target: torch.Tensor
    count: int


@dataclass
class Batch:
    """Sequences packed into rows of `width` positions, flattened to rows * width, on a device."""

    rows: int
    width: int
    tokens: torch.Tensor  # [m] long
    positions: torch.Tensor  # [m] position within its sequence
    documents: torch.Tensor  # [m] which sequence of its row (-1: padding)
    last: torch.Tensor  # [m] flat index of the sequence's last position
    features: torch.Tensor  # [m, F] the head's input feature
    final: torch.Tensor  # [m, H] the target's final normed state: teacher and regression target
    argmax: torch.Tensor  # [m] the target's argmax
    steps: list[Selection]  # per unrolled step
    far: Selection | None  # Jakiro's two-ahead output (step 0 only)
    real_tokens: int
    valid: list[torch.Tensor] | None = None  # evaluation: [m] bool per step, positions scored
    follows: list[torch.Tensor] | None = None  # evaluation: [m] bool per step, the next data token is the argmax


@dataclass
class HostBatch:
    """A batch's arrays on the host (built off the training thread), before `to_device`; without
    features, argmax and selections where the target computes them on the device."""

    rows: int
    width: int
    arrays: dict[str, np.ndarray]
    real_tokens: int
    choice: tuple  # what picks the scored positions: (steps, in_vocab, two_ahead, evaluation)
    steps: list[tuple[np.ndarray, np.ndarray]] | None = None
    far: tuple[np.ndarray, np.ndarray] | None = None
    valid: list[np.ndarray] | None = None
    follows: list[np.ndarray] | None = None


def host_batch(store, rows: list[list[int]], steps: int, fused: bool, in_vocab: np.ndarray | None, two_ahead: bool,
               evaluation: bool = False) -> HostBatch:
    """Lay out the sequences `rows` (ids per row) and, where the store holds the target's argmax,
    work out which positions every unrolled step is scored on (`choose`).

    Training (`in_vocab` given) drops positions whose target argmax is outside the draft vocabulary;
    evaluation keeps them (a miss) and also returns full [m] masks for the simulated acceptance.
    """
    stored = store.holds_features
    names = (("final", "aux") if fused else ("final",)) if stored else ()
    seqs = [[store.arrays(i, names) for i in ids] for ids in rows]
    width = max(sum(len(s["tokens"]) for s in row) for row in seqs)
    m = len(rows) * width
    arrays = {"tokens": np.zeros(m, dtype=np.int64), "positions": np.zeros(m, dtype=np.int64),
              "documents": np.full(m, -1, dtype=np.int64), "last": np.arange(m, dtype=np.int64),
              "mask": np.zeros(m, dtype=bool)}
    if stored:
        arrays["argmax"] = np.zeros(m, dtype=np.int64)
        for name in names:
            arrays[name] = np.zeros((m, seqs[0][0][name].shape[1]), dtype=np.int16)
    for row, row_seqs in enumerate(seqs):
        base = row * width
        for document, seq in enumerate(row_seqs):
            n = len(seq["tokens"])
            span = slice(base, base + n)
            arrays["tokens"][span], arrays["mask"][span] = seq["tokens"], seq["mask"]
            arrays["positions"][span], arrays["documents"][span], arrays["last"][span] = np.arange(n), document, base + n - 1
            for name in ("argmax", *names) if stored else ():
                arrays[name][span] = seq[name]
            base += n
    if stored:
        arrays["features"] = arrays.pop("aux") if fused else arrays["final"]
    host = HostBatch(len(rows), width, arrays, int(sum(len(s["tokens"]) for row in seqs for s in row)),
                     (steps, in_vocab, two_ahead, evaluation))
    return choose(host, arrays["argmax"]) if stored else host


def choose(host: HostBatch, argmax: np.ndarray) -> HostBatch:
    """The positions each unrolled step is scored on, from the target's argmax [m]: step s at
    position t predicts the distribution at t + 1 + s, trained where the token after that is an
    assistant token (and, in training, the argmax there is in the draft vocabulary)."""
    steps, in_vocab, two_ahead, evaluation = host.choice
    a = host.arrays
    flat = np.arange(len(a["tokens"]))
    real = a["documents"] >= 0
    host.steps, host.valid, host.follows = [], [] if evaluation else None, [] if evaluation else None
    for step in range(steps):
        target = flat + 1 + step  # the position whose distribution step `step` at t predicts
        ok = real & (target + 1 <= a["last"])
        where, target = flat[ok], target[ok]
        keep = a["mask"][target + 1]
        if evaluation:
            host.valid.append(np.zeros(len(flat), dtype=bool))
            host.valid[-1][where[keep]] = True
            host.follows.append(np.zeros(len(flat), dtype=bool))
            host.follows[-1][where] = a["tokens"][target + 1] == argmax[target]
        if in_vocab is not None:
            keep = keep & in_vocab[argmax[target]]
        host.steps.append((where[keep], target[keep]))
    if two_ahead:
        ok = real & (flat + 3 <= a["last"])
        where = flat[ok]
        keep = a["mask"][where + 3] & (in_vocab[argmax[where + 2]] if in_vocab is not None else True)
        host.far = (where[keep], where[keep] + 2)
    return host


def to_device(host: HostBatch, device: torch.device, store=None) -> Batch:
    """The batch on `device`. Where its store holds no features (`LiveFeatures`), the store computes
    them and the argmax there first, and the scored positions are chosen from that argmax."""
    def put(array, dtype=None):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None:
            tensor = tensor.view(dtype)
        return tensor.to(device)

    a = host.arrays
    tokens, positions, documents = put(a["tokens"]), put(a["positions"]), put(a["documents"])
    if host.steps is None:
        features, final, argmax = store.compute(tokens.view(host.rows, host.width), positions.view(host.rows, host.width),
                                                documents.view(host.rows, host.width))
        choose(host, argmax.cpu().numpy())  # the one wait on the device per pass
    else:
        features, final, argmax = put(a["features"], torch.bfloat16), put(a["final"], torch.bfloat16), put(a["argmax"])
    select = lambda pair: Selection(put(pair[0]), put(pair[1]), len(pair[0]))  # noqa: E731
    return Batch(
        host.rows, host.width, tokens, positions, documents, put(a["last"]), features, final, argmax,
        [select(pair) for pair in host.steps], select(host.far) if host.far is not None else None,
        host.real_tokens,
        [put(v) for v in host.valid] if host.valid is not None else None,
        [put(f) for f in host.follows] if host.follows is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# Data order


def micro_batches(order: list[int], lengths, rows: int, batch_tokens: int) -> list[list[list[int]]]:
    """Consecutive sequences packed, first fit, into passes of at most `rows` rows as wide as the
    pass's longest sequence and at most `batch_tokens` positions (a longer sequence goes alone)."""
    passes: list[list[list[int]]] = []
    packed: list[list[int]] = []
    used: list[int] = []
    width = 0
    for i in order:
        n = int(lengths[i])
        wider = max(width, n)
        fit = next((row for row, filled in enumerate(used) if filled + n <= wider), None)
        if packed and fit is not None and len(packed) * wider <= batch_tokens:
            packed[fit].append(i)
            used[fit] += n
        elif packed and len(packed) < rows and (len(packed) + 1) * wider <= batch_tokens:
            packed.append([i])
            used.append(n)
        else:
            if packed:
                passes.append(packed)
            packed, used, wider = [[i]], [n], n
        width = wider
    if packed:
        passes.append(packed)
    return passes


def epoch_plan(train_ids: list[int], lengths, rows: int, batch_tokens: int, seed: int,
               epoch: int) -> list[list[list[list[int]]]]:
    """The optimizer steps of one epoch, each a list of forward passes (`micro_batches`) of about
    `batch_tokens` tokens together.

    A function of the seed and the epoch alone, so a resumed run needs only (epoch, step in epoch).
    Sequences come in a random order: long ones next to short ones pack with little padding.
    """
    rng = random.Random(f"specchat-train:{seed}:{epoch}")
    order = list(train_ids)
    rng.shuffle(order)
    # An optimizer step takes passes while that brings its tokens nearer to batch_tokens.
    plan, group, tokens = [], [], 0
    for packed in micro_batches(order, lengths, rows, batch_tokens):
        size = int(sum(lengths[i] for ids in packed for i in ids))
        if group and abs(tokens + size - batch_tokens) > abs(tokens - batch_tokens):
            plan.append(group)
            group, tokens = [], 0
        group.append(packed)
        tokens += size
    if group:
        plan.append(group)
    return plan
