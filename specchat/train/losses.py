"""The recipes' losses and the held-out evaluation: the EAGLE, EAGLE-3 and Jakiro recipes.

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
responses): over the full 152k vocabulary they would dominate the cost on a CPU. Matrix products
run in bfloat16 under `autocast` (CPU and CUDA); the weights stay float32.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specchat.train.batches import Batch, Selection, host_batch, micro_batches, to_device
from specchat.train.unrolled import UnrolledKeys

# Jakiro: weight of the right (two-ahead) output's loss.
RIGHT_WEIGHT = 0.5


def autocast(device: torch.device):
    """bf16 matrix products (a CPU runs fp32 ones several times slower; a GPU's tensor cores want
    bf16); the fp32 weights stay the master copy."""
    enabled = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()
                                       and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type if device.type in ("cpu", "cuda") else "cpu", dtype=torch.bfloat16,
                          enabled=enabled)


# SDPA backends while training on CUDA (the target's live features, the head's forward and backward,
# the held-out evaluation): not cuDNN's, whose masked attention failed mid-run on an H100 (torch 2.11,
# "mha_graph.execute(...).is_good()" after 600 good steps: docs/bench-gpu/h100-block3/); the
# memory-efficient kernel takes the same boolean masks, with a backward.
TRAINING_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def training_attention(device: torch.device):
    """The SDPA backends training uses on `device` (on a CPU, torch's choice)."""
    return sdpa_kernel(TRAINING_SDPA) if device.type == "cuda" else nullcontext()


def unrolled_outputs(head, batch: Batch, steps: int, noise: float = 0.0, right: bool = False):
    """Run the head `steps` times over a batch (training-time test); yields per step its output
    [m, H] (and, for Jakiro at step 0 with `right`, the two-ahead output)."""
    hidden = batch.features.float()
    if noise:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    keys = UnrolledKeys(batch.rows, batch.documents)
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


def _soft_ce(student_logp: torch.Tensor, teacher_p: torch.Tensor) -> torch.Tensor:
    return -(teacher_p * student_logp).sum(-1).mean()


def _recipe_loss(head, out: torch.Tensor, chosen: Selection, batch: Batch, teacher_p: torch.Tensor):
    """The head's recipe on one output at the chosen positions: (loss, its log-probabilities)."""
    scored = out[chosen.where]
    student = head.log_probs(scored)
    loss = head.probability_loss_weight * _soft_ce(student, teacher_p[chosen.target])
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
    # p at every position, shared by every step (it only shifts), exponentiated once rather than per step
    teacher_p = teacher_log_probs(lm_rows, batch.final).exp_()
    losses, hits = [], []
    outputs = unrolled_outputs(head, batch, steps, noise=head.feature_noise, right=head.predicts_two_ahead)
    for step, (out, contrast) in enumerate(outputs):
        chosen = batch.steps[step]
        if chosen.count == 0:
            hits.append(torch.zeros((), dtype=torch.long, device=out.device))
            continue
        loss, student = _recipe_loss(head, out, chosen, batch, teacher_p)
        if contrast is not None and batch.far is not None and batch.far.count:
            loss = loss + RIGHT_WEIGHT * _recipe_loss(head, contrast, batch.far, batch, teacher_p)[0]
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


def evaluate(head, store, indices: list[int], vocab, device: torch.device, rows: int, steps: int,
             batch_tokens: int) -> dict:
    """Held-out top-1 accuracy per unrolled step (the draft's argmax equals the target's) and the
    simulated acceptance length tau (1 + accepted drafts per greedy chain of `steps`), over passes of
    up to `rows` packed rows and `batch_tokens` positions."""
    head.eval()
    lengths = store.lengths()
    ordered = sorted(indices, key=lambda i: lengths[i])
    hits = torch.zeros(steps, dtype=torch.long, device=device)
    accepted = torch.zeros((), dtype=torch.long, device=device)
    counts, chains = np.zeros(steps, dtype=np.int64), 0
    for group in micro_batches(ordered, lengths, rows, batch_tokens):
        host = host_batch(store, group, steps, head.reads_fused_features, None, False, evaluation=True)
        batch = to_device(host, device, store)
        counts += [int(v.sum()) for v in host.valid]
        chains += int(host.valid[0].sum())
        with autocast(device):
            step_hits, step_accepted = evaluation_sums(head, batch, vocab)
        hits += step_hits
        accepted += step_accepted
    head.train()
    top1 = [round(h / c, 4) if c else 0.0 for h, c in zip(hits.tolist(), counts.tolist())]
    return {"top1_by_step": top1, "tau": round(1 + int(accepted) / chains, 4) if chains else 1.0}
