"""How much faster than plain decoding a reply was: an estimate, or an exact comparison.

Speedup is measured on the decoding phase: tokens after the first one per second, the prefill
(prompt processing and the first token) left out on both sides. In a chat the prefill depends on
what each engine already has cached - the conversation so far, or nothing after a method switch -
and not on the method, so including it would measure the cache rather than the speculation.

- The *estimate*: plain decoding would have spent one plain step per token after the first. Where
  the reply took enough plain steps itself (the pace takes them where drafting does not pay) their
  median time is that step; else the median of the plain steps kept for the reply's context-length
  bucket: those replies took there, and where they are too few, a few timed on the engine's own
  cache (trimmed back afterwards), so a session pays for a handful of steps per bucket, not per
  reply. A timed step is a whole one (the forward and the choice of the token), as plain decoding
  takes it.
- The *comparison* decodes the same prompt plainly on a separate engine (same target weights,
  own cache, same settings and random state) and measures the real ratio.

When a comparison finds the answers different, `Divergence` says where, and how close the plain
run's choice was there: in bf16 or quantized compute, a batched verification forward rounds
differently from a one-token forward, so where the top two logits (nearly) tie the two can pick
different tokens — numerics. A difference where plain decoding had a clear margin is a bug.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

import torch

from specchat.decode import Engine, GenerationSettings

# One untimed step warms up allocations; the median of the timed ones resists a noisy neighbour.
WARMUP_STEPS, TIMED_STEPS = 1, 3
# A reply's own plain steps stand for plain decoding's once there are this many of them.
OWN_PLAIN_STEPS = 4
KEPT_STEPS = 32  # plain steps kept per context bucket (the latest), for replies that took fewer
# A divergence where plain decoding's top-2 logits were closer than this counts as a near-tie.
NEAR_TIE_LOGITS = 0.5
SMALLEST_BUCKET = 64


def context_bucket(length: int) -> int:
    """The power of two at or above `length` (at least SMALLEST_BUCKET)."""
    bucket = SMALLEST_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


class PlainStepClock:
    """Seconds per plain decoding step of an engine's target, kept per context bucket: the plain steps
    replies took there and, where they took too few, a few timed ones; their median stands for plain
    decoding's step. One timing alone, kept for the session, put every later short reply's estimate
    off by as much as it was (the session's first, right after its first reply, 8% slow on a 2-vCPU
    Xeon: three of ten general10 replies 13-23% above the measured ratio)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.steps_by_bucket: dict[int, collections.deque[float]] = {}

    def seconds_per_step(self, stats=None) -> float:
        """The plain step time for a reply (`stats`, a `specchat.stats.Stats`): the median of its own
        plain steps where it took OWN_PLAIN_STEPS or more, else of those kept at the engine's current
        context length (this reply's among them; timed where fewer than TIMED_STEPS are kept)."""
        kept = self.steps_by_bucket.setdefault(context_bucket(self.engine.cache.length),
                                               collections.deque(maxlen=KEPT_STEPS))
        own = stats.plain_step_times if stats is not None else []
        kept.extend(own)
        if len(own) >= OWN_PLAIN_STEPS:
            return stats.plain_step_seconds
        if len(kept) < TIMED_STEPS:
            kept.extend(self.engine.plain_step_seconds(WARMUP_STEPS + TIMED_STEPS)[WARMUP_STEPS:])
        return statistics.median(kept)


def decoding_rate(new_tokens: int, seconds: float, prefill_seconds: float) -> float | None:
    """Tokens after the first per second of decoding (None if there was no decoding to time)."""
    decoding_seconds = seconds - prefill_seconds
    return (new_tokens - 1) / decoding_seconds if new_tokens > 1 and decoding_seconds > 0 else None


def estimated_speedup(new_tokens: int, seconds: float, prefill_seconds: float,
                      plain_step_seconds: float) -> float | None:
    """The reply's decoding rate over plain decoding's (one `plain_step_seconds` per token)."""
    rate = decoding_rate(new_tokens, seconds, prefill_seconds)
    return rate * plain_step_seconds if rate is not None else None


@dataclass(frozen=True)
class Divergence:
    """Where an answer first differs from plain decoding's, and plain decoding's margin there."""

    position: int | None  # index of the first differing token (None: only the texts were compared)
    margin: float | None  # plain decoding's top-1 minus top-2 logit at that token (None: not known)

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and self.margin < NEAR_TIE_LOGITS

    def record(self) -> dict:
        return {"first_difference": self.position, "plain_margin": None if self.margin is None else round(self.margin, 4),
                "near_tie": self.near_tie}


def divergence(tokens: list[int], plain_tokens: list[int], plain_margins: list[float]) -> Divergence | None:
    """None if the answers are the same token ids."""
    if tokens == plain_tokens:
        return None
    position = next((i for i, (a, b) in enumerate(zip(tokens, plain_tokens)) if a != b), min(len(tokens), len(plain_tokens)))
    return Divergence(position, plain_margins[position] if position < len(plain_margins) else None)


@dataclass
class Comparison:
    """The same reply decoded plainly."""

    tokens: list[int]
    seconds: float
    prefill_seconds: float
    speedup: float | None  # decoding rate of the method / decoding rate of plain decoding
    divergence: Divergence | None  # None: the same token ids

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def record(self) -> dict:
        return {"plain_seconds": round(self.seconds, 4), "plain_prefill_seconds": round(self.prefill_seconds, 4),
                "speedup": None if self.speedup is None else round(self.speedup, 4), "identical": self.identical,
                **(self.divergence.record() if self.divergence else {})}


def compare_plainly(plain: Engine, prompt_ids: list[int], settings: GenerationSettings, rng: torch.Generator | None,
                    tokens: list[int], seconds: float, prefill_seconds: float) -> Comparison:
    """Decode `prompt_ids` on the vanilla engine `plain`; compare with a reply of `tokens` that took
    `seconds`, `prefill_seconds` of them for the prefill."""
    plain_tokens, plain_margins, plain_seconds, plain_prefill = [], [], 0.0, 0.0
    for step in plain.generate(prompt_ids, settings, rng):
        plain_tokens.extend(step.tokens)
        plain_margins.extend(step.margins)
        plain_seconds += step.seconds
        plain_prefill += step.seconds if step.prefill else 0.0
    method_rate = decoding_rate(len(tokens), seconds, prefill_seconds)
    plain_rate = decoding_rate(len(plain_tokens), plain_seconds, plain_prefill)
    speedup = method_rate / plain_rate if method_rate is not None and plain_rate else None
    return Comparison(plain_tokens, plain_seconds, plain_prefill, speedup,
                      divergence(tokens, plain_tokens, plain_margins))
