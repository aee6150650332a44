"""Training draft heads on stored target features: the EAGLE, EAGLE-3 and Jakiro recipes.

Notation per sequence of n positions: x_t the tokens, f_t the target's final normed hidden states,
p_t = softmax(LM head(f_t)) the target's distribution of x_{t+1}, a_t its argmax. The head's step
at position t reads (feature at t, x_{t+1}) and predicts f_{t+1}, hence the distribution of
x_{t+2}, whose teacher is p_{t+1}. A position is trained when x_{t+2} is an assistant token.

Recipes (constants are the papers' unless noted):
- eagle  (EAGLE, arXiv 2401.15077 §4): SmoothL1(f̂_{t+1}, f_{t+1}) + 0.1 × cross-entropy against
  p_{t+1}; inputs f_t get uniform noise U(-0.1, 0.1).
- eagle3 (EAGLE-3, arXiv 2503.01840 §3): training-time test — the head is unrolled for several
  steps, step i feeding its own step i-1 outputs, with loss sum_i 0.8^i × cross-entropy against
  p renormalised over the draft vocabulary; positions whose a_t is outside the draft vocabulary
  are left out. No feature regression.
- jakiro (Jakiro, arXiv 2502.06282; its reference trainer): the eagle loss on the left output plus
  0.5 × the same loss on the right (contrastive) output against f_{t+2} and p_{t+2}.

The cross-entropies run over the draft vocabulary (the most frequent target tokens in the training
responses): over the full 152k vocabulary they would dominate the cost on a CPU. Optimiser: AdamW
with betas (0.9, 0.95), linear warm-up then cosine decay, gradients clipped by value to 0.5
(EAGLE's trainer).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from drafters.eagle import EagleConfig, EagleHead
from drafters.eagle3 import Eagle3Config, Eagle3Head
from drafters.jakiro import JakiroConfig, JakiroHead
from specchat.train.unrolled import UnrolledKeys

# EAGLE's loss weights and input noise.
FEATURE_WEIGHT, PROBABILITY_WEIGHT, FEATURE_NOISE = 1.0, 0.1, 0.1
# EAGLE-3: training-time test unrolls 7 steps, step i weighted 0.8**i.
PAPER_TTT_STEPS, STEP_DECAY = 7, 0.8
# Jakiro: weight of the right (two-ahead) output's loss.
RIGHT_WEIGHT = 0.5
# EAGLE-3 uses a 32k draft vocabulary for Llama-3's 128k.
PAPER_DRAFT_VOCAB = 32000
# EAGLE's optimiser settings.
ADAM_BETAS, GRAD_CLIP_VALUE = (0.9, 0.95), 0.5


@dataclass
class TrainConfig:
    kind: str  # eagle | eagle3 | jakiro
    # The papers train 20-40 epochs over ~68k conversations with learning rates of 3e-5..9e-5 on
    # schedules of 800k steps; CPU runs take a few thousand steps, so the rate is higher.
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    epochs: float = 2.0
    max_steps: int | None = None
    batch_tokens: int = 8192  # tokens per optimizer step (gradient accumulation over sequences)
    ttt_steps: int | None = None  # None: the paper's 7 for eagle3, 1 for eagle/jakiro
    draft_vocab: int | None = None  # None: 32000 (EAGLE-3's size); eagle/jakiro heads then draft over it too
    intermediate_size: int | None = None  # None: the target's
    eval_every: int = 200
    eval_sequences: int = 64
    eval_steps: int = 4  # unrolled steps for the held-out top-1 accuracy
    checkpoint_every: int = 200
    seed: int = 0
    weight_decay: float = 0.0

    def steps_unrolled(self) -> int:
        if self.kind == "eagle3":
            return self.ttt_steps or PAPER_TTT_STEPS
        return self.ttt_steps or 1


# ---------------------------------------------------------------------------------------------
# Draft vocabulary and heads


def draft_vocabulary(store, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens at assistant positions (ascending ids), and the share of
    assistant tokens they cover."""
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


def build_head(kind: str, target, config: TrainConfig, vocab: torch.Tensor | None):
    text = target.config.get_text_config()
    common = dict(
        hidden_size=target.hidden_size, intermediate_size=config.intermediate_size or text.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        vocab_size=target.vocab_size, rms_norm_eps=text.rms_norm_eps,
        rope_theta=float((getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )
    if kind == "eagle3":
        head = Eagle3Head(Eagle3Config(**common, draft_vocab_size=len(vocab) if vocab is not None else target.vocab_size),
                          target.embed_tokens)
        if vocab is not None and len(vocab) != target.vocab_size:
            head.d2t.copy_(vocab - torch.arange(len(vocab)))
            head.t2d.zero_()[vocab] = True
            head.refresh_vocab_map()
            # Start the draft LM head from the target's rows of the same tokens.
            with torch.no_grad():
                head.lm_head.weight.copy_(target.lm_head.weight[vocab].float())
        return head
    cls, cfg = (EagleHead, EagleConfig) if kind == "eagle" else (JakiroHead, JakiroConfig)
    head = cls(cfg(**common, bias=True), target.embed_tokens, target.lm_head)
    if vocab is not None and len(vocab) != target.vocab_size:
        head.restrict_vocab(vocab)  # shipped with the head (draft_vocab.safetensors) and used at inference
    return head


def vocab_of(head) -> torch.Tensor | None:
    return head.draft_to_target


# ---------------------------------------------------------------------------------------------
# Unrolled forward and losses


def unrolled_outputs(head, seq: dict, steps: int, noise: float = 0.0, right: bool = False):
    """Run the head `steps` times over a sequence (training-time test); yields per step its output
    [n-1, H] (and, for Jakiro at step 0 with `right`, the two-ahead output)."""
    tokens = seq["tokens"]
    n = len(tokens)
    features = seq["aux"] if head.kind == "eagle3" else seq["final"]
    hidden = features[: n - 1].float()
    if noise:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
    keys = UnrolledKeys()
    positions = torch.arange(n - 1)
    for step in range(steps):
        # Step i at position t reads token x_{t+1+i}; past the end, the last token stands in (masked out).
        index = torch.clamp(positions + 1 + step, max=n - 1)
        if right and step == 0:
            out, contrast = head.forward_both(hidden, tokens[index], positions + step, None, keys)
            yield out, contrast
        else:
            out = head(hidden, tokens[index], positions + step, None, keys)
            yield out, None
        hidden = out


@torch.no_grad()
def teacher_log_probs(lm_rows: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """log p over the draft vocabulary at every position, from the target's final states (rows of its LM head)."""
    return torch.log_softmax((final.to(lm_rows.dtype) @ lm_rows.T).float(), dim=-1)


def _soft_ce(student_logp: torch.Tensor, teacher_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if not valid.any():
        return student_logp.sum() * 0
    return -(teacher_logp[valid].exp() * student_logp[valid]).sum(-1).mean()


def sequence_loss(head, seq: dict, config: TrainConfig, lm_rows: torch.Tensor, vocab: torch.Tensor | None,
                  in_vocab: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The recipe's loss on one sequence, and per unrolled step (correct, counted) top-1 hits."""
    n = len(seq["tokens"])
    final, mask, argmax = seq["final"], seq["mask"], seq["argmax"]
    positions = torch.arange(n - 1)
    steps = config.steps_unrolled()
    teacher_all = teacher_log_probs(lm_rows, final)  # shared by every step: it only shifts
    losses, hits = [], []
    outputs = unrolled_outputs(head, seq, steps, noise=FEATURE_NOISE if head.kind != "eagle3" else 0.0,
                               right=head.predicts_two_ahead)
    for step, (out, contrast) in enumerate(outputs):
        target_pos = positions + 1 + step  # the position whose feature/distribution this step predicts
        valid = target_pos + 1 < n
        target_pos = torch.clamp(target_pos, max=n - 1)
        valid &= mask[torch.clamp(target_pos + 1, max=n - 1)] & in_vocab[argmax[target_pos]]
        teacher = teacher_all[target_pos]
        student = head.log_probs(out)
        if head.kind == "eagle3":
            loss = STEP_DECAY ** step * _soft_ce(student, teacher, valid)
        else:
            regression = F.smooth_l1_loss(out.float(), final[target_pos].float(), reduction="none").mean(-1)
            loss = FEATURE_WEIGHT * (regression[valid].mean() if valid.any() else regression.sum() * 0)
            loss = loss + PROBABILITY_WEIGHT * _soft_ce(student, teacher, valid)
            if contrast is not None:  # Jakiro's right output predicts one position further
                far = torch.clamp(positions + 2, max=n - 1)
                far_valid = (positions + 3 < n) & mask[torch.clamp(positions + 3, max=n - 1)] & in_vocab[argmax[far]]
                far_regression = F.smooth_l1_loss(contrast.float(), final[far].float(), reduction="none").mean(-1)
                far_loss = FEATURE_WEIGHT * (far_regression[far_valid].mean() if far_valid.any() else far_regression.sum() * 0)
                far_loss = far_loss + PROBABILITY_WEIGHT * _soft_ce(head.log_probs(contrast), teacher_all[far], far_valid)
                loss = loss + RIGHT_WEIGHT * far_loss
        losses.append(loss)
        hits.append(_hits(student, vocab, argmax[target_pos], valid))
    return torch.stack(losses).sum(), hits


def _hits(student_logp: torch.Tensor, vocab: torch.Tensor | None, want: torch.Tensor, valid: torch.Tensor):
    guess = student_logp.argmax(-1)
    if vocab is not None:
        guess = vocab[guess]
    return int((guess[valid] == want[valid]).sum()), int(valid.sum())


@torch.no_grad()
def evaluate(head, store, indices: list[int], config: TrainConfig, lm_rows, vocab, in_vocab) -> list[float]:
    """Held-out top-1 accuracy per unrolled step (the draft's argmax equals the target's)."""
    head.eval()
    totals = [[0, 0] for _ in range(config.eval_steps)]
    for i in indices:
        seq = store.sequence(i)
        positions = torch.arange(len(seq["tokens"]) - 1)
        for step, (out, _) in enumerate(unrolled_outputs(head, seq, config.eval_steps)):
            target_pos = torch.clamp(positions + 1 + step, max=len(seq["tokens"]) - 1)
            valid = (positions + 2 + step < len(seq["tokens"])) & seq["mask"][torch.clamp(target_pos + 1, max=len(seq["tokens"]) - 1)]
            correct, count = _hits(head.log_probs(out), vocab, seq["argmax"][target_pos], valid)
            totals[step][0] += correct
            totals[step][1] += count
    head.train()
    return [round(c / t, 4) if t else 0.0 for c, t in totals]


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    evaluations: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _autocast(target):
    """bf16 matmuls on a CPU, where fp32 ones are several times slower; the fp32 weights stay the master copy."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=target.device.type == "cpu")


def train(head, target, store, train_ids: list[int], held_out: list[int], config: TrainConfig, output: Path,
          resume: bool = False, progress=None) -> TrainState:
    """Optimise `head` on the stored sequences; checkpoints under output/checkpoint."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    vocab = vocab_of(head)
    lm_weight = target.lm_head.weight.detach()
    lm_rows = (lm_weight[vocab] if vocab is not None else lm_weight).float()
    in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
    in_vocab[vocab if vocab is not None else slice(None)] = True
    parameters = [p for name, p in head.named_parameters() if p.requires_grad and not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, betas=ADAM_BETAS, weight_decay=config.weight_decay)
    tokens_per_epoch = sum(store.offsets[i + 1] - store.offsets[i] for i in train_ids)
    total_steps = config.max_steps or max(1, int(config.epochs * tokens_per_epoch / config.batch_tokens))
    state = TrainState()
    checkpoint = output / "checkpoint"
    if resume and (checkpoint / "state.pt").is_file():
        saved = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True)
        head.load_state_dict(saved["head"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        state = TrainState(**json.loads(saved["state"]))
        rng.seed(config.seed + state.step)
    head.train()
    order: list[int] = []
    started = time.perf_counter() - state.seconds
    window_loss, window_hits = [], [0, 0]
    while state.step < total_steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, state.step, total_steps)
        batch_tokens = 0
        optimizer.zero_grad(set_to_none=True)
        while batch_tokens < config.batch_tokens:
            if not order:
                order = list(train_ids)
                rng.shuffle(order)
            seq = store.sequence(order.pop())
            with _autocast(target):
                loss, hits = sequence_loss(head, seq, config, lm_rows, vocab, in_vocab)
            length = len(seq["tokens"])
            (loss * length / config.batch_tokens).backward()
            batch_tokens += length
            window_loss.append(loss.item())
            window_hits[0] += hits[0][0]
            window_hits[1] += hits[0][1]
        torch.nn.utils.clip_grad_value_(parameters, GRAD_CLIP_VALUE)
        optimizer.step()
        state.step += 1
        state.tokens_seen += batch_tokens
        state.seconds = time.perf_counter() - started
        if progress:
            progress(state, total_steps, sum(window_loss) / len(window_loss),
                     window_hits[0] / max(1, window_hits[1]))
        window_loss, window_hits = [], [0, 0]
        if held_out and (state.step % config.eval_every == 0 or state.step == total_steps):
            with _autocast(target):
                accuracy = evaluate(head, store, held_out[: config.eval_sequences], config, lm_rows, vocab, in_vocab)
            state.evaluations.append({"step": state.step, "tokens_seen": state.tokens_seen, "top1_by_step": accuracy})
        if state.step % config.checkpoint_every == 0 or state.step == total_steps:
            checkpoint.mkdir(parents=True, exist_ok=True)
            torch.save({"head": head.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                        "state": json.dumps(asdict(state))}, checkpoint / "state.pt")
    head.eval()
    return state
