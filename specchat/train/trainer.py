"""Training a draft head on the target's features: the head, its optimiser and the loop.

The recipes' losses and the held-out evaluation are in `specchat.train.losses`, the batches and
the data order in `specchat.train.batches`; the head is built from its format's class, so this
module has no per-format code either. Optimiser: AdamW with betas (0.9, 0.95), linear warm-up then
cosine decay, gradients clipped by value to 0.5 (EAGLE's trainer); the weights stay float32.

Every tensor is placed on one `device` (the target's), decided once in `train`; the feature store
stays on the CPU and each batch is moved where it is used (or, with `LiveFeatures`, the target
computes each batch's features there). The only host reads are the progress report, evaluations,
checkpoints and, with live features, each pass's argmax (which chooses the scored positions).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from drafters import FORMATS, DraftHead
from specchat.decode import synchronize
from specchat.tracing import Profiler
from specchat.train import checkpoint as ckpt
from specchat.train.batches import epoch_plan, host_batch, to_device
from specchat.train.losses import autocast, batch_loss, evaluate, training_attention
from specchat.train.options import TRAIN_ROWS, TrainOptions, on_device

# EAGLE's optimiser settings.
ADAM_BETAS, GRAD_CLIP_VALUE = (0.9, 0.95), 0.5
# `--trace`: the optimizer steps profiled and timed by phase, after the run's first few (memory
# allocation, cuBLAS's choices and the reader's first batches are behind by then).
TRACE_AFTER, TRACE_STEPS = 5, 3


@dataclass
class TrainConfig:
    """How a head trains; the defaults are `specchat train`'s (TrainOptions, where each is explained)."""

    kind: str  # eagle | eagle3 | jakiro (drafters.FORMATS)
    learning_rate: float = TrainOptions.lr
    warmup_steps: int = TrainOptions.warmup
    epochs: float = TrainOptions.epochs
    max_steps: int | None = None
    batch_tokens: int = TrainOptions.batch_tokens
    batch_size: int | None = None  # None: TRAIN_ROWS, by device
    ttt_steps: int | None = None  # None: the paper's
    draft_vocab: int | None = None  # None: PAPER_DRAFT_VOCAB (EAGLE-3's size); eagle/jakiro heads then draft over it too
    intermediate_size: int | None = None  # None: the target's
    eval_every: int = TrainOptions.eval_every
    eval_sequences: int = 64
    eval_steps: int = 4  # unrolled steps for the held-out top-1 accuracy and the simulated tau
    checkpoint_every: int = TrainOptions.checkpoint_every
    checkpoint_precision: str = TrainOptions.checkpoint_precision
    max_minutes: float | None = None
    seed: int = TrainOptions.seed
    weight_decay: float = 0.0
    trace: str | None = None  # a folder for the profiler's summary of a few steps (`StepTrace`)

    def steps_unrolled(self) -> int:
        return self.ttt_steps or head_class(self.kind).paper_unrolled_steps

    def rows(self, device: torch.device) -> int:
        return self.batch_size or on_device(TRAIN_ROWS, device)


# ---------------------------------------------------------------------------------------------
# Draft vocabulary and heads


def head_class(kind: str) -> type[DraftHead]:
    """The head class of a format (its module's declared HEAD)."""
    return FORMATS[kind].HEAD


def assistant_token_counts(store) -> Counter:
    """How often each token id appears at assistant positions."""
    counts = Counter()
    for tokens, mask in store.tokens_and_masks():
        counts.update(tokens[mask].tolist())
    return counts


def covered_share(counts: Counter, vocab) -> float:
    """The share of the counted assistant tokens that the token ids `vocab` cover."""
    total = sum(counts.values())
    return sum(counts[t] for t in vocab) / total if total else 0.0


def draft_vocabulary(store, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens at assistant positions (ascending ids, on the CPU), and the
    share of assistant tokens they cover."""
    counts = assistant_token_counts(store)
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:  # pad with the smallest unused ids so the vocabulary has the asked size
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long), covered_share(counts, chosen)


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
    phases: dict | None = None  # with --trace: where the traced steps' time went (`StepTrace.record`)


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _digest(values) -> str:
    return hashlib.sha1(np.asarray(values, dtype=np.int64).tobytes()).hexdigest()[:16]


def fingerprint(vocab: torch.Tensor | None, head, store, train_ids, config: TrainConfig, rows: int) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint."""
    return {"kind": config.kind, "head_config": head.config.to_dict(),
            "draft_vocab": None if vocab is None else _digest(vocab.numpy()),
            "train_sequences": _digest(train_ids), "positions": int(store.lengths().sum()),
            "batch_size": rows, "batch_tokens": config.batch_tokens, "batches": "packed", "seed": config.seed,
            "ttt_steps": config.steps_unrolled()}


class StepTrace:
    """Where an optimizer step's time goes: the profiler's summary of TRACE_STEPS steps after the
    run's first TRACE_AFTER, and those steps' wall time by phase, into `folder`. A phase is timed up to
    its `mark`, which synchronizes the device: only while the steps are traced, so the other steps
    keep the device's queue full. A profiler that fails (CUPTI busy or missing, a full disk) is said
    in the record, and training and the phases' timing go on: a GPU block's head matters more.

    The phases: `features` (the reader thread's batch, moved to the device, and with live features
    the target's forward), `forward` (the head's unrolled steps and the loss), `backward`, and
    `optimizer` (the learning rate, clipping and AdamW)."""

    PHASES = ("features", "forward", "backward", "optimizer")

    def __init__(self, folder: str | None, device: torch.device):
        self.folder, self.device = folder, device
        self.tracing = False  # in a traced step now
        self.profiler: Profiler | None = None
        self.failure: str | None = None  # what the profiler could not do
        self.seconds, self.tokens, self.steps, self.since = Counter(), 0, 0, 0.0
        self.passes = self.positions = 0  # the traced steps' forward passes and their padded positions

    def before(self, run_step: int) -> None:
        """Before the run's step `run_step` (0 = its first): start tracing at TRACE_AFTER."""
        if self.folder is None or run_step != TRACE_AFTER:
            return
        self.tracing = True
        try:
            profiler = Profiler(self.device)
            profiler.start()
            self.profiler = profiler
        except RuntimeError as error:
            self.failure = f"the profiler did not start: {error}"

    def start(self) -> None:
        """A traced step begins."""
        if self.tracing:
            synchronize(self.device)
            self.since = time.perf_counter()

    def mark(self, phase: str) -> None:
        """A traced step's `phase` ends here."""
        if self.tracing:
            synchronize(self.device)
            now = time.perf_counter()
            self.seconds[phase] += now - self.since
            self.since = now

    def count(self, rows: int, width: int) -> None:
        """A traced step's forward pass of `rows` rows of `width` positions (padding included)."""
        if self.tracing:
            self.passes, self.positions = self.passes + 1, self.positions + rows * width

    def after(self, tokens: int) -> dict | None:
        """After a step of `tokens` tokens; once the last traced step is done, the trace is written
        and the record returned."""
        if not self.tracing:
            return None
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens
        return self.finish() if self.steps == TRACE_STEPS else None

    def finish(self) -> dict | None:
        """Stop and write the trace (early, if the run ended before its last traced step); the record."""
        if not self.tracing:
            return None
        self.tracing = False
        if self.profiler is not None:
            try:
                self.profiler.stop()
                self.profiler.write(self.folder, "train-summary.txt")  # no chrome trace: 215 MB for three steps on a CPU
            except (RuntimeError, OSError) as error:
                self.failure = f"the profiler's summary was not written: {error}"
            self.profiler = None
        return self.record() if self.steps else None

    def record(self) -> dict:
        """The traced steps' seconds by phase, their shares, their forward passes and the share of those
        passes' positions that were padding, tokens per second (timed synchronously: a little slower
        than the untraced steps), and what the profiler could not do (None: nothing)."""
        total = sum(self.seconds.values())
        return {"steps": self.steps, "after_steps": TRACE_AFTER, "tokens": self.tokens, "passes": self.passes,
                "padding": round(1 - self.tokens / self.positions, 3) if self.positions else None,
                "seconds": {phase: round(self.seconds[phase], 4) for phase in self.PHASES},
                "shares": {phase: round(self.seconds[phase] / total, 3) for phase in self.PHASES},
                "tokens_per_second": round(self.tokens / total) if total else None, "profiler_failure": self.failure}


class Trainer:
    """One run of `train` over one head: its optimizer, data order, evaluations and checkpoints.

    `run` takes optimizer steps (`step`) over the passes `passes` reads ahead, evaluating the
    held-out sequences and writing checkpoints as they fall due; `start` first resumes from the
    checkpoint, or says that this run replaces it.
    """

    def __init__(self, head, target, store, train_ids: list[int], held_out: list[int], config: TrainConfig,
                 output: Path | None, progress=None, log: Callable[[str], None] | None = None,
                 on_best: Callable[[TrainState], None] | None = None, device: torch.device | None = None,
                 draft_vocab: torch.Tensor | None = None):
        self.head, self.store, self.config = head, store, config
        self.train_ids, self.held_out = train_ids, held_out
        self.progress, self.log, self.on_best = progress, log or (lambda message: None), on_best
        self.device = torch.device(device) if device is not None else target.device
        torch.manual_seed(config.seed)
        draft_vocab = self._place_vocabulary(target, draft_vocab)
        named = [(name, p) for name, p in head.named_parameters()
                 if p.requires_grad and not name.startswith("embed_tokens")]
        self.names, self.parameters = [name for name, _ in named], [p for _, p in named]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate, betas=ADAM_BETAS,
                                           weight_decay=config.weight_decay)
        self.lengths = store.lengths()
        self.rows = config.rows(self.device)
        self.steps = config.steps_unrolled()
        self.plans: dict[int, list] = {}
        self.total_steps = config.max_steps or max(1, round(config.epochs * len(self.plan(0))))
        self.precision = ckpt.choose_precision(head, config.checkpoint_precision)
        self.identity = fingerprint(draft_vocab, head, store, train_ids, config, self.rows)
        self.folder = output / ckpt.FOLDER if output is not None else None
        self.state = TrainState()
        self.trace = StepTrace(config.trace, self.device)

    def _place_vocabulary(self, target, draft_vocab: torch.Tensor | None) -> torch.Tensor | None:
        """Put the draft vocabulary and the target's LM-head rows for it on the device, and mark its
        tokens on the host; returns the vocabulary on the host (None: the whole target vocabulary)."""
        self.vocab = vocab_of(self.head)
        if self.vocab is not None:
            self.vocab = self.vocab.to(self.device)
            draft_vocab = draft_vocab if draft_vocab is not None else self.vocab.cpu()
        lm_weight = target.lm_head.weight.detach()
        self.lm_rows = (lm_weight[self.vocab] if self.vocab is not None else lm_weight).to(self.device, torch.float32)
        self.in_vocab = np.zeros(target.vocab_size, dtype=bool)
        self.in_vocab[draft_vocab.numpy() if self.vocab is not None else slice(None)] = True
        return draft_vocab if self.vocab is not None else None

    def plan(self, epoch: int) -> list:
        """Epoch `epoch`'s optimizer steps; the current and the next epoch's are kept."""
        if epoch not in self.plans:
            if len(self.plans) > 1:
                self.plans.pop(min(self.plans))
            self.plans[epoch] = epoch_plan(self.train_ids, self.lengths, self.rows, self.config.batch_tokens,
                                           self.config.seed, epoch)
        return self.plans[epoch]

    def start(self, resume: bool) -> None:
        """Continue from the checkpoint (with `resume`), or say that this run replaces the one there."""
        folder = self.folder
        if resume and folder is not None and ckpt.exists(folder):
            loaded = ckpt.load(folder)
            changed = [key for key, value in self.identity.items() if loaded.meta["fingerprint"].get(key) != value]
            if changed:
                raise ckpt.ResumeError(f"{folder} was written for other {', '.join(changed)}; "
                                       "resume with the same data and options, or train into a new folder")
            ckpt.restore(loaded, self.head, self.optimizer, self.names, self.device)
            self.state = TrainState(**{**loaded.meta["state"], "stopped": None})
            self.log(f"resumed from {folder} at step {self.state.step:,}/{self.total_steps:,} "
                     f"(epoch {self.state.epoch + 1}, {loaded.meta['precision']} checkpoint)")
        elif resume and folder is not None:
            self.log(f"no checkpoint in {folder}: starting at step 0")
        elif folder is not None and ckpt.exists(folder):
            self.log(f"starting at step 0: this run's checkpoints replace the one in {folder} "
                     "(--resume continues it)")

    def run(self) -> TrainState:
        """Train up to the last step, or until the time limit (which leaves a checkpoint)."""
        self.head.train()
        self.started, self.base_seconds = time.perf_counter(), self.state.seconds
        source = self.passes()
        try:
            with training_attention(self.device):
                run_step = 0
                while self.state.step < self.total_steps and not self.state.stopped:
                    self.trace.before(run_step)
                    self.step(*next(source))
                    run_step += 1
        finally:
            self.state.phases = self.trace.finish() or self.state.phases
            source.close()
        self.head.eval()
        return self.state

    def step(self, epoch: int, index: int, group: list[list[list[int]]], batches) -> None:
        """One optimizer step, then what falls due after it: progress, evaluation, the time limit, a checkpoint."""
        state, config = self.state, self.config
        state.epoch, state.step_in_epoch = epoch, index
        tokens, loss, hits, counts = self.optimizer_step(group, batches)
        state.phases = self.trace.after(tokens) or state.phases
        state.step += 1
        state.step_in_epoch += 1
        state.tokens_seen += tokens
        state.seconds = self.base_seconds + time.perf_counter() - self.started
        if self.progress:
            self.progress(state, self.total_steps, float(loss), int(hits) / max(1, counts))
        epoch_end = state.step_in_epoch == len(self.plan(state.epoch))
        if epoch_end:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        last = state.step == self.total_steps
        if self.held_out and (epoch_end or last or state.step % config.eval_every == 0):
            self.evaluate_held_out(epoch_end, last)
        elapsed = time.perf_counter() - self.started
        if config.max_minutes is not None and elapsed >= 60 * config.max_minutes and not last:
            state.stopped = f"time limit ({config.max_minutes:g} min)"
        if self.folder is not None and (epoch_end or last or state.stopped
                                        or state.step % config.checkpoint_every == 0):
            self.save_checkpoint()

    def optimizer_step(self, group: list[list[list[int]]], batches) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """One AdamW step over the group's forward passes: (tokens, loss, step-0 hits, their count)."""
        trace = self.trace
        trace.start()
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate(self.config, self.state.step, self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)
        tokens = int(sum(self.lengths[i] for packed in group for ids in packed for i in ids))
        loss = torch.zeros((), device=self.device)
        hits, counts = torch.zeros((), dtype=torch.long, device=self.device), 0
        trace.mark("optimizer")
        for batch in batches:
            trace.mark("features")
            trace.count(batch.rows, batch.width)
            with autocast(self.device):
                result = batch_loss(self.head, batch, self.lm_rows, self.vocab)
            trace.mark("forward")
            if result.loss is None:
                continue
            share = batch.real_tokens / tokens  # each pass's loss is a mean over its tokens
            (result.loss * share).backward()
            loss = loss + result.loss.detach() * share
            hits = hits + result.hits[0]
            counts += result.counts[0]
            trace.mark("backward")
        torch.nn.utils.clip_grad_value_(self.parameters, GRAD_CLIP_VALUE)
        self.optimizer.step()
        trace.mark("optimizer")
        return tokens, loss, hits, counts

    def passes(self):
        """(epoch, step in epoch, its forward passes, those passes as device batches) from the current
        position on; a reader thread prepares the next step's batches while the device works."""
        with ThreadPoolExecutor(1) as reader:
            epoch, index = self.state.epoch, self.state.step_in_epoch
            pending = self.read(reader, epoch, index)
            while True:
                group = self.plan(epoch)[index]
                upcoming = self.following(epoch, index)
                ahead = self.read(reader, *upcoming)
                yield epoch, index, group, (to_device(job.result(), self.device, self.store) for job in pending)
                (epoch, index), pending = upcoming, ahead

    def read(self, reader: ThreadPoolExecutor, epoch: int, index: int) -> list:
        """The host batches of step `index` of `epoch`, as jobs of the reader thread."""
        head = self.head
        return [reader.submit(host_batch, self.store, packed, self.steps, head.reads_fused_features, self.in_vocab,
                              head.predicts_two_ahead) for packed in self.plan(epoch)[index]]

    def following(self, epoch: int, index: int) -> tuple[int, int]:
        return (epoch, index + 1) if index + 1 < len(self.plan(epoch)) else (epoch + 1, 0)

    def evaluate_held_out(self, epoch_end: bool, last: bool) -> None:
        """Evaluate the held-out sequences, keep the best, and say how it went at an epoch's end or the last step."""
        state, config = self.state, self.config
        result = evaluate(self.head, self.store, self.held_out[: config.eval_sequences], self.vocab, self.device,
                          self.rows, config.eval_steps, config.batch_tokens)
        record = {"step": state.step, "epoch": state.epoch + state.step_in_epoch / max(1, len(self.plan(state.epoch))),
                  "tokens_seen": state.tokens_seen, **result}
        state.evaluations.append(record)
        if state.best is None or record["tau"] > state.best["tau"]:
            state.best = record
            if self.on_best:
                self.on_best(state)
        if epoch_end or last:
            best = state.best
            self.log(f"{f'epoch {state.epoch}' if epoch_end else 'last step'} (step {state.step:,}): "
                     f"held-out top-1 by step {record['top1_by_step']}, simulated tau {record['tau']:.3f} "
                     f"(best {best['tau']:.3f} at step {best['step']:,})")

    def save_checkpoint(self) -> None:
        tensors, optimizer_meta = ckpt.collect(self.head, self.optimizer, self.names, self.precision, self.device)
        ckpt.save(self.folder, tensors, {"precision": self.precision, "state": asdict(self.state),
                                         "fingerprint": self.identity, "optimizer": optimizer_meta,
                                         "total_steps": self.total_steps})


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
    trainer = Trainer(head, target, store, train_ids, held_out, config, output, progress=progress, log=log,
                      on_best=on_best, device=device, draft_vocab=draft_vocab)
    trainer.start(resume)
    return trainer.run()
