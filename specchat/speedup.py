"""How much faster than plain decoding a reply was: an estimate, or an exact comparison.

Speedup follows Spec-Bench: tokens per second of the method divided by tokens per second of
plain decoding on the same machine, prefill included on both sides.

- The *estimate* times a few plain decoding steps of the target at the reply's context length
  (on the engine's own cache, which is trimmed back afterwards) and assumes plain decoding would
  have spent the same prefill plus one such step per further token. Timings are kept per
  context-length bucket, so a session pays for a handful of steps per bucket, not per reply.
- The *comparison* decodes the same prompt plainly on a separate engine (same target weights,
  own cache, same settings and random state) and measures the real ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specchat.engine import Engine, GenerationSettings

# One untimed step warms up allocations; the median of the timed ones resists a noisy neighbour.
WARMUP_STEPS, TIMED_STEPS = 1, 3
SMALLEST_BUCKET = 64


def context_bucket(length: int) -> int:
    """The power of two at or above `length` (at least SMALLEST_BUCKET)."""
    bucket = SMALLEST_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


class PlainStepClock:
    """Seconds per plain decoding step of an engine's target, measured once per context bucket."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.seconds_by_bucket: dict[int, float] = {}

    def seconds_per_step(self) -> float:
        """The plain step time at the engine's current context length (measured if not known)."""
        bucket = context_bucket(self.engine.cache.length)
        if bucket not in self.seconds_by_bucket:
            self.seconds_by_bucket[bucket] = self._measure()
        return self.seconds_by_bucket[bucket]

    @torch.inference_mode()
    def _measure(self) -> float:
        engine, cache = self.engine, self.engine.cache
        committed = cache.length
        token = torch.tensor([[engine.context_ids[-1] if engine.context_ids else 0]], device=engine.target.device)
        timings = []
        try:
            for _ in range(WARMUP_STEPS + TIMED_STEPS):
                start = time.perf_counter()
                engine.target.forward(token, cache, logits_for="last")
                _synchronize(engine.target.device)
                timings.append(time.perf_counter() - start)
        finally:
            cache.trim(committed)  # the timed steps were scratch: the cache holds what it held before
        return statistics.median(timings[WARMUP_STEPS:])


def estimated_speedup(new_tokens: int, seconds: float, prefill_seconds: float, plain_step_seconds: float) -> float:
    """Plain decoding's estimated time for the same reply divided by the reply's real time."""
    plain_seconds = prefill_seconds + max(0, new_tokens - 1) * plain_step_seconds
    return plain_seconds / seconds if seconds > 0 else 0.0


@dataclass
class Comparison:
    """The same reply decoded plainly."""

    tokens: list[int]
    seconds: float
    speedup: float  # tokens/s of the method / tokens/s of plain decoding
    identical: bool  # the same token ids

    def record(self) -> dict:
        return {"plain_seconds": round(self.seconds, 4), "plain_tokens_per_s": round(self.tokens_per_s, 3),
                "speedup": round(self.speedup, 4), "identical": self.identical}

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def compare_plainly(plain: Engine, prompt_ids: list[int], settings: GenerationSettings,
                    rng: torch.Generator | None, tokens: list[int], seconds: float) -> Comparison:
    """Decode `prompt_ids` on the vanilla engine `plain` and compare with a reply of `tokens` in `seconds`."""
    plain_tokens, plain_seconds = [], 0.0
    for step in plain.generate(prompt_ids, settings, rng):
        plain_tokens.extend(step.tokens)
        plain_seconds += step.seconds
    method_rate = len(tokens) / seconds if seconds > 0 else 0.0
    plain_rate = len(plain_tokens) / plain_seconds if plain_seconds > 0 else 0.0
    return Comparison(plain_tokens, plain_seconds, method_rate / plain_rate if plain_rate else 0.0,
                      plain_tokens == tokens)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
