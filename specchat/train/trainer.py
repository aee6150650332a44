"""Training draft heads on stored target features: the EAGLE, EAGLE-3 and Jakiro recipes.

Notation per sequence of n positions: x_t the tokens, f_t the target's final normed hidden states,
p_t = softmax(LM head(f_t)) the target's distribution of x_{t+1}, a_t its argmax. The head's step
at position t reads (feature at t, x_{t+1}) and predicts f_{t+1}, hence the distribution of
x_{t+2}, whose teacher is p_{t+1}. A position is trained when x_{t+2} is an assistant token.

Recipes, declared by each head class (`DraftHead.reads_fused_features`, `paper_unrolled_steps`,
`feature_noise`, `feature_loss_weight`, `probability_loss_weight`, `step_loss_decay`), so this
module has no per-format code:
- eagle  (EAGLE, arXiv 2401.15077 §4): SmoothL1(f̂_{t+1}, f_{t+1}) + 0.1 × cross-entropy against
  p_{t+1}; inputs f_t get uniform noise U(-0.1, 0.1).
- eagle3 (EAGLE-3, arXiv 2503.01840 §3): training-time test — the head is unrolled for several
  steps, step i feeding its own step i-1 outputs, with loss sum_i 0.8^i × cross-entropy against
  p renormalised over the draft vocabulary; positions whose a_t is outside the draft vocabulary
  are left out. No feature regression. Its input is the fused low/mid/high feature.
- jakiro (Jakiro, arXiv 2502.06282; its reference trainer): the eagle loss on the left output plus
  0.5 × the same loss on the right (contrastive) output against f_{t+2} and p_{t+2}
  (`predicts_two_ahead`).

The cross-entropies run over the draft vocabulary (the most frequent target tokens in the training
responses): over the full 152k vocabulary they would dominate the cost on a CPU. Optimiser: AdamW
with betas (0.9, 0.95), linear warm-up then cosine decay, gradients clipped by value to 0.5
(EAGLE's trainer).

Batches and devices: an optimizer step takes about `batch_tokens` tokens, as one or more forward
passes of up to `batch_size` sequences each, right-padded to the longest (sequences are grouped by
length, so padding stays small), flattened to the [m, F] the head's layers take, with the
training-time test's attention kept within each row (`UnrolledKeys(rows)`). Which positions each
unrolled step trains on is worked out on the host from the stored masks, so the device runs
gathers of known size and never waits on a value: the only host reads are the progress report,
evaluations and checkpoints. Every tensor is placed on one `device` (the target's), decided once
in `train`; the feature store stays on the CPU and each batch is moved where it is used.
Matrix products run in bfloat16 under autocast (CPU and CUDA); the weights stay float32.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from drafters import FORMATS, DraftHead
from specchat.train import checkpoint as ckpt
from specchat.train.unrolled import UnrolledKeys

# Jakiro: weight of the right (two-ahead) output's loss.
RIGHT_WEIGHT = 0.5
# EAGLE-3 uses a 32k draft vocabulary for Llama-3's 128k.
PAPER_DRAFT_VOCAB = 32000
# EAGLE's optimiser settings.
ADAM_BETAS, GRAD_CLIP_VALUE = (0.9, 0.95), 0.5
# Sequences per forward pass unless --batch-size says otherwise: a CPU gains nothing from padding
# rows together, a GPU needs them to be busy.
CPU_BATCH_SIZE, GPU_BATCH_SIZE = 1, 8
SORT_WINDOW_BATCHES = 8  # sequences are grouped by length within windows of this many batches


@dataclass
class TrainConfig:
    kind: str  # eagle | eagle3 | jakiro (drafters.FORMATS)
    # The papers train 20-40 epochs over ~68k conversations with learning rates of 3e-5..9e-5 on
    # schedules of 800k steps; CPU runs take a few thousand steps, so the rate is higher.
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    epochs: float = 2.0
    max_steps: int | None = None
    batch_tokens: int = 8192  # tokens per optimizer step (gradient accumulation over forward passes)
    batch_size: int | None = None  # sequences per forward pass; None: 1 on a CPU, 8 on a GPU
    ttt_steps: int | None = None  # None: the paper's (7 for eagle3, 1 for eagle/jakiro)
    draft_vocab: int | None = None  # None: 32000 (EAGLE-3's size); eagle/jakiro heads then draft over it too
    intermediate_size: int | None = None  # None: the target's
    eval_every: int = 200
    eval_sequences: int = 64
    eval_steps: int = 4  # unrolled steps for the held-out top-1 accuracy and the simulated tau
    checkpoint_every: int = 200
    checkpoint_precision: str = "auto"  # auto | exact | compact (see specchat.train.checkpoint)
    max_minutes: float | None = None  # stop (with a checkpoint) after this much training time
    seed: int = 0
    weight_decay: float = 0.0

    def steps_unrolled(self) -> int:
        return self.ttt_steps or head_class(self.kind).paper_unrolled_steps

    def rows(self, device: torch.device) -> int:
        return self.batch_size or (GPU_BATCH_SIZE if device.type == "cuda" else CPU_BATCH_SIZE)


# ---------------------------------------------------------------------------------------------
# Draft vocabulary and heads


def head_class(kind: str) -> type[DraftHead]:
    """The head class of a format: the `DraftHead` its module (drafters.FORMATS[kind]) defines for it."""
    module = FORMATS[kind]
    return next(cls for cls in vars(module).values()
                if isinstance(cls, type) and issubclass(cls, DraftHead) and getattr(cls, "kind", None) == kind)


def draft_vocabulary(store, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens at assistant positions (ascending ids, on the CPU), and the
    share of assistant tokens they cover."""
    counts = Counter()
    for tokens, mask in store.tokens_and_masks():
        counts.update(tokens[mask].tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:  # pad with the smallest unused ids so the vocabulary has the asked size
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    total = sum(counts.values())
    covered = sum(counts[t] for t in chosen) / total if total else 0.0
    return torch.tensor(sorted(chosen), dtype=torch.long), covered


def build_head(kind: str, target, config: TrainConfig, vocab: torch.Tensor | None) -> DraftHead:
    """A new head of `kind` for `target`, on the target's device (initialised from `config.seed`
    on the CPU, so every device starts from the same weights)."""
    text = target.config.get_text_config()
    fields = dict(
        hidden_size=target.hidden_size, intermediate_size=config.intermediate_size or text.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        vocab_size=target.vocab_size, rms_norm_eps=text.rms_norm_eps,
        rope_theta=float((getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )
    if vocab is not None and len(vocab) >= target.vocab_size:
        vocab = None
    torch.manual_seed(config.seed)
    return head_class(kind).fresh(fields, target, vocab)


def vocab_of(head) -> torch.Tensor | None:
    return head.draft_to_target


# ---------------------------------------------------------------------------------------------
# Batches


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
# Unrolled forward and losses


def unrolled_outputs(head, batch: Batch, steps: int, noise: float = 0.0, right: bool = False):
    """Run the head `steps` times over a batch (training-time test); yields per step its output
    [m, H] (and, for Jakiro at step 0 with `right`, the two-ahead output)."""
    hidden = batch.features.float()
    if noise:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    keys = UnrolledKeys(batch.rows)
    flat = torch.arange(len(batch.tokens), device=batch.tokens.device)
    for step in range(steps):
        # Step i at position t reads token x_{t+1+i}; past the row's end, its last token stands in (never scored).
        tokens = batch.tokens[torch.minimum(flat + 1 + step, batch.last)]
        if right and step == 0:
            out, contrast = head.forward_both(hidden, tokens, batch.positions + step, None, keys)
            yield out, contrast
        else:
            out = head(hidden, tokens, batch.positions + step, None, keys)
            yield out, None
        hidden = out


@torch.no_grad()
def teacher_log_probs(lm_rows: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """log p over the draft vocabulary at every position, from the target's final states (rows of its LM head)."""
    return torch.log_softmax((final.to(lm_rows.dtype) @ lm_rows.T).float(), dim=-1)


def _soft_ce(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    return -(teacher_logp.exp() * student_logp).sum(-1).mean()


def _recipe_loss(head, out: torch.Tensor, chosen: Selection, batch: Batch, teacher_all: torch.Tensor):
    """The head's recipe on one output at the chosen positions: (loss, its log-probabilities)."""
    scored = out[chosen.where]
    student = head.log_probs(scored)
    loss = head.probability_loss_weight * _soft_ce(student, teacher_all[chosen.target])
    if head.feature_loss_weight:
        loss = loss + head.feature_loss_weight * F.smooth_l1_loss(scored.float(), batch.final[chosen.target].float())
    return loss, student


@dataclass
class BatchResult:
    loss: torch.Tensor | None  # None: no position of the batch is scored
    hits: list[torch.Tensor]  # per unrolled step, a device scalar: top-1 agreements with the target
    counts: list[int]  # per unrolled step, positions scored


def batch_loss(head, batch: Batch, lm_rows: torch.Tensor, vocab: torch.Tensor | None) -> BatchResult:
    """The recipe's loss on a batch (each step's mean over its scored positions, summed over steps)
    and per unrolled step the top-1 hits."""
    steps = len(batch.steps)
    teacher_all = teacher_log_probs(lm_rows, batch.final)  # shared by every step: it only shifts
    losses, hits = [], []
    outputs = unrolled_outputs(head, batch, steps, noise=head.feature_noise, right=head.predicts_two_ahead)
    for step, (out, contrast) in enumerate(outputs):
        chosen = batch.steps[step]
        if chosen.count == 0:
            hits.append(torch.zeros((), dtype=torch.long, device=out.device))
            continue
        loss, student = _recipe_loss(head, out, chosen, batch, teacher_all)
        if contrast is not None and batch.far is not None and batch.far.count:
            loss = loss + RIGHT_WEIGHT * _recipe_loss(head, contrast, batch.far, batch, teacher_all)[0]
        losses.append(head.step_loss_decay ** step * loss)
        hits.append(_hits(student, vocab, batch.argmax[chosen.target]))
    total = torch.stack(losses).sum() if losses else None
    return BatchResult(total, hits, [s.count for s in batch.steps])


def _guess(student_logp: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    guess = student_logp.argmax(-1)
    return vocab[guess] if vocab is not None else guess


def _hits(student_logp: torch.Tensor, vocab: torch.Tensor | None, want: torch.Tensor) -> torch.Tensor:
    return (_guess(student_logp, vocab) == want).sum()


@torch.no_grad()
def evaluation_sums(head, batch: Batch, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Device sums for one evaluation batch: top-1 hits per unrolled step [steps], and draft tokens
    a greedy chain would have had accepted, summed over chain starts (scalar).

    The chain from position t drafts step 0, 1, ... and stops at the first draft that is not the
    target's argmax; a draft is fed on only where the data's next token is that argmax (true of
    greedily regenerated data), so the count is exact there and an underestimate elsewhere.
    """
    steps = len(batch.valid)
    flat = torch.arange(len(batch.tokens), device=batch.tokens.device)
    hits, accepted = [], torch.zeros((), dtype=torch.long, device=batch.tokens.device)
    alive = batch.valid[0]
    for step, (out, _) in enumerate(unrolled_outputs(head, batch, steps)):
        target = torch.minimum(flat + 1 + step, batch.last)
        correct = batch.valid[step] & (_guess(head.log_probs(out), vocab) == batch.argmax[target])
        hits.append(correct.sum())
        taken = alive & correct
        accepted = accepted + taken.sum()
        alive = taken & batch.follows[step]
    return torch.stack(hits), accepted


def evaluate(head, store, indices: list[int], config: TrainConfig, vocab, device: torch.device, rows: int) -> dict:
    """Held-out top-1 accuracy per unrolled step (the draft's argmax equals the target's) and the
    simulated acceptance length tau (1 + accepted drafts per greedy chain of `eval_steps`)."""
    head.eval()
    lengths = store.lengths()
    ordered = sorted(indices, key=lambda i: lengths[i])
    hits = torch.zeros(config.eval_steps, dtype=torch.long, device=device)
    accepted = torch.zeros((), dtype=torch.long, device=device)
    counts, chains = np.zeros(config.eval_steps, dtype=np.int64), 0
    for group in micro_batches(ordered, lengths, rows, config.batch_tokens):
        host = host_batch(store, group, config.eval_steps, head.reads_fused_features, None, False, evaluation=True)
        counts += [int(v.sum()) for v in host.valid]
        chains += int(host.valid[0].sum())
        batch = to_device(host, device)
        with _autocast(device):
            step_hits, step_accepted = evaluation_sums(head, batch, vocab)
        hits += step_hits
        accepted += step_accepted
    head.train()
    top1 = [round(h / c, 4) if c else 0.0 for h, c in zip(hits.tolist(), counts.tolist())]
    return {"top1_by_step": top1, "tau": round(1 + int(accepted) / chains, 4) if chains else 1.0}


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


def epoch_plan(train_ids: list[int], lengths, config: TrainConfig, rows: int, epoch: int) -> list[list[list[int]]]:
    """The optimizer steps of one epoch, each a list of forward passes (lists of sequence ids) of
    about `batch_tokens` tokens together.

    A function of the seed and the epoch alone, so a resumed run needs only (epoch, step in epoch).
    With several sequences per pass, sequences are sorted by length within windows (little padding)
    and the passes are then shuffled.
    """
    rng = random.Random(f"specchat-train:{config.seed}:{epoch}")
    order = list(train_ids)
    rng.shuffle(order)
    if rows > 1:
        window = rows * SORT_WINDOW_BATCHES
        order = [i for s in range(0, len(order), window) for i in sorted(order[s : s + window], key=lambda i: lengths[i])]
    passes = micro_batches(order, lengths, rows, config.batch_tokens)
    if rows > 1:
        rng.shuffle(passes)
    # An optimizer step takes passes while that brings its tokens nearer to batch_tokens.
    plan, group, tokens = [], [], 0
    for ids in passes:
        size = int(sum(lengths[i] for i in ids))
        if group and abs(tokens + size - config.batch_tokens) > abs(tokens - config.batch_tokens):
            plan.append(group)
            group, tokens = [], 0
        group.append(ids)
        tokens += size
    if group:
        plan.append(group)
    return plan


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    evaluations: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps of the current epoch done
    best: dict | None = None  # the evaluation with the highest simulated tau so far
    stopped: str | None = None  # why training stopped before its last step (the time limit)


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _autocast(device: torch.device):
    """bf16 matrix products (a CPU runs fp32 ones several times slower; a GPU's tensor cores want
    bf16); the fp32 weights stay the master copy."""
    enabled = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()
                                       and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type if device.type in ("cpu", "cuda") else "cpu", dtype=torch.bfloat16,
                          enabled=enabled)


def _digest(values) -> str:
    return hashlib.sha1(np.asarray(values, dtype=np.int64).tobytes()).hexdigest()[:16]


def fingerprint(vocab: torch.Tensor | None, head, store, train_ids, config: TrainConfig, rows: int) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint."""
    return {"kind": config.kind, "head_config": head.config.to_dict(),
            "draft_vocab": None if vocab is None else _digest(vocab.numpy()),
            "train_sequences": _digest(train_ids), "positions": int(store.lengths().sum()),
            "batch_size": rows, "batch_tokens": config.batch_tokens, "seed": config.seed,
            "ttt_steps": config.steps_unrolled()}


def train(head, target, store, train_ids: list[int], held_out: list[int], config: TrainConfig,
          output: Path | None, resume: bool = False, progress=None, log: Callable[[str], None] | None = None,
          on_best: Callable[[TrainState], None] | None = None, device: torch.device | None = None,
          draft_vocab: torch.Tensor | None = None) -> TrainState:
    """Optimise `head` on the stored sequences.

    `device` (default: the target's) is where the head, the target's LM-head rows and every batch
    live. Checkpoints go to output/checkpoint (none if `output` is None); with `resume` a run
    continues from the checkpoint there. After each epoch (and every `eval_every` steps) the
    held-out sequences are evaluated; `on_best` is called when the simulated tau is the best so far.
    `draft_vocab` is the head's draft vocabulary on the host (default: read from the head).
    """
    device = torch.device(device) if device is not None else target.device
    log = log or (lambda message: None)
    torch.manual_seed(config.seed)
    vocab = vocab_of(head)
    if vocab is not None:
        vocab = vocab.to(device)
        draft_vocab = draft_vocab if draft_vocab is not None else vocab.cpu()
    lm_weight = target.lm_head.weight.detach()
    lm_rows = (lm_weight[vocab] if vocab is not None else lm_weight).to(device, torch.float32)
    in_vocab = np.zeros(target.vocab_size, dtype=bool)
    in_vocab[draft_vocab.numpy() if vocab is not None else slice(None)] = True
    named = [(name, p) for name, p in head.named_parameters() if p.requires_grad and not name.startswith("embed_tokens")]
    names, parameters = [name for name, _ in named], [p for _, p in named]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, betas=ADAM_BETAS, weight_decay=config.weight_decay)
    lengths = store.lengths()
    rows = config.rows(device)
    steps = config.steps_unrolled()
    plans: dict[int, list] = {}

    def plan(epoch: int) -> list:
        if epoch not in plans:
            if len(plans) > 1:
                plans.pop(min(plans))
            plans[epoch] = epoch_plan(train_ids, lengths, config, rows, epoch)
        return plans[epoch]

    total_steps = config.max_steps or max(1, round(config.epochs * len(plan(0))))
    precision = ckpt.choose_precision(head, config.checkpoint_precision)
    identity = fingerprint(draft_vocab if vocab is not None else None, head, store, train_ids, config, rows)
    folder = output / "checkpoint" if output is not None else None
    state = TrainState()
    if resume and folder is not None and ckpt.exists(folder):
        loaded = ckpt.load(folder)
        changed = [key for key, value in identity.items() if loaded.meta["fingerprint"].get(key) != value]
        if changed:
            raise ckpt.ResumeError(f"{folder} was written for other {', '.join(changed)}; "
                                   "resume with the same data and options, or train into a new folder")
        ckpt.restore(loaded, head, optimizer, names, device)
        state = TrainState(**{**loaded.meta["state"], "stopped": None})
        log(f"resumed from {folder} at step {state.step:,}/{total_steps:,} (epoch {state.epoch + 1}, "
            f"{loaded.meta['precision']} checkpoint)")
    elif resume and folder is not None:
        log(f"no checkpoint in {folder}: starting from scratch")
    elif folder is not None and ckpt.exists(folder):
        log(f"starting from scratch: this run's checkpoints replace the one in {folder} (--resume continues it)")

    def save_checkpoint() -> None:
        tensors, optimizer_meta = ckpt.collect(head, optimizer, names, precision, device)
        ckpt.save(folder, tensors, {"precision": precision, "state": asdict(state), "fingerprint": identity,
                                    "optimizer": optimizer_meta, "total_steps": total_steps})

    def evaluation() -> None:
        result = evaluate(head, store, held_out[: config.eval_sequences], config, vocab, device, rows)
        record = {"step": state.step, "epoch": state.epoch + state.step_in_epoch / max(1, len(plan(state.epoch))),
                  "tokens_seen": state.tokens_seen, **result}
        state.evaluations.append(record)
        if state.best is None or record["tau"] > state.best["tau"]:
            state.best = record
            if on_best:
                on_best(state)

    def passes():
        """(epoch, step in epoch, its forward passes, those passes as device batches) from the current
        position on; a reader thread prepares the next step's batches while the device works."""
        def following(epoch: int, index: int) -> tuple[int, int]:
            return (epoch, index + 1) if index + 1 < len(plan(epoch)) else (epoch + 1, 0)

        with ThreadPoolExecutor(1) as reader:
            def read(epoch: int, index: int) -> list:
                return [reader.submit(host_batch, store, ids, steps, head.reads_fused_features, in_vocab,
                                      head.predicts_two_ahead) for ids in plan(epoch)[index]]

            epoch, index = state.epoch, state.step_in_epoch
            pending = read(epoch, index)
            while True:
                group = plan(epoch)[index]
                upcoming = following(epoch, index)
                ahead = read(*upcoming)
                yield epoch, index, group, (to_device(job.result(), device) for job in pending)
                (epoch, index), pending = upcoming, ahead

    def optimizer_step(group: list[list[int]], batches) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """One AdamW step over the group's forward passes: (tokens, loss, step-0 hits, their count)."""
        for param_group in optimizer.param_groups:
            param_group["lr"] = learning_rate(config, state.step, total_steps)
        optimizer.zero_grad(set_to_none=True)
        tokens = int(sum(lengths[i] for ids in group for i in ids))
        loss = torch.zeros((), device=device)
        hits, counts = torch.zeros((), dtype=torch.long, device=device), 0
        for batch in batches:
            with _autocast(device):
                result = batch_loss(head, batch, lm_rows, vocab)
            if result.loss is None:
                continue
            share = batch.real_tokens / tokens  # each pass's loss is a mean over its tokens
            (result.loss * share).backward()
            loss = loss + result.loss.detach() * share
            hits = hits + result.hits[0]
            counts += result.counts[0]
        torch.nn.utils.clip_grad_value_(parameters, GRAD_CLIP_VALUE)
        optimizer.step()
        return tokens, loss, hits, counts

    head.train()
    run_started = time.perf_counter()
    base_seconds = state.seconds
    source = passes()
    try:
        while state.step < total_steps:
            state.epoch, state.step_in_epoch, group, batches = next(source)
            tokens, loss, hits, counts = optimizer_step(group, batches)
            state.step += 1
            state.step_in_epoch += 1
            state.tokens_seen += tokens
            state.seconds = base_seconds + time.perf_counter() - run_started
            if progress:
                progress(state, total_steps, float(loss), int(hits) / max(1, counts))
            epoch_end = state.step_in_epoch == len(plan(state.epoch))
            if epoch_end:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
            last = state.step == total_steps
            if held_out and (epoch_end or last or state.step % config.eval_every == 0):
                evaluation()
                if epoch_end or last:
                    latest, best = state.evaluations[-1], state.best
                    log(f"{f'epoch {state.epoch}' if epoch_end else 'last step'} (step {state.step:,}): "
                        f"held-out top-1 by step {latest['top1_by_step']}, simulated tau {latest['tau']:.3f} "
                        f"(best {best['tau']:.3f} at step {best['step']:,})")
            elapsed = time.perf_counter() - run_started
            if config.max_minutes is not None and elapsed >= 60 * config.max_minutes and not last:
                state.stopped = f"time limit ({config.max_minutes:g} min)"
            if folder is not None and (epoch_end or last or state.stopped or state.step % config.checkpoint_every == 0):
                save_checkpoint()
            if state.stopped:
                break
    finally:
        source.close()
    head.eval()
    return state
