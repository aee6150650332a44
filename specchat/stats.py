"""The counters of decoding work, and the numbers the field derives from them.

Definitions as vLLM, SGLang and Spec-Bench use them:
- τ (mean acceptance length) = new tokens / target forward passes, the bonus token included, so
  plain decoding has τ = 1.0;
- acceptance rate = accepted draft tokens / draft tokens the target verified;
- tokens/s = new tokens / wall time, prefill included.

One record, `Stats`, counts a reply, a method's session totals and a bench run alike; records add
up with `+=`, and the derived numbers are always computed from the sums.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from specchat.decode import Arm, Source


@dataclass
class Stats:
    """What decoding did: tokens, time, forwards, drafts."""

    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    target_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_tokens: int = 0  # draft tokens the target verified
    accepted_tokens: int = 0  # of those, accepted
    accepted_from_lookup: int = 0  # of those, proposed by the lookup (alone, or the head too): hybrid drafting
    lookup_seconds: float = 0.0  # spent finding lookup continuations
    # After the prefill: the target's forwards, and with the target profiling their products and attention
    forward_seconds: float = 0.0
    products_seconds: float = 0.0
    attention_seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # tokens per speculative cycle, bonus included
    arms: dict[str, int] = field(default_factory=dict)  # decoding steps by what drafted them (`Arm` values)
    plain_step_times: list[float] = field(default_factory=list)  # seconds of each decoding step that verified no draft
    finish_reason: str | None = None  # of the latest reply counted

    def add_step(self, step) -> None:
        """Count one engine step (`specchat.decode.StepResult`)."""
        self.new_tokens += len(step.tokens)
        self.seconds += step.seconds
        self.target_forwards += step.target_forwards
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        self.draft_tokens += step.draft_tokens
        self.accepted_tokens += sum(step.drafted)
        self.finish_reason = step.finish_reason or self.finish_reason
        if step.prefill:
            self.prefill_seconds += step.seconds
            return
        self.forward_seconds += step.forward.forward_seconds
        self.products_seconds += step.forward.products_seconds
        self.attention_seconds += step.forward.attention_seconds
        tree = None if step.cycle is None else step.cycle.tree
        arm = Arm.PLAIN if tree is None or not len(tree) else step.cycle.arm or Arm.HEAD  # (a proposer naming none: a head)
        self.arms[arm.value] = self.arms.get(arm.value, 0) + 1
        if arm is Arm.PLAIN:
            self.plain_step_times.append(step.seconds)
        if tree is not None:
            self.accept_lengths.append(len(step.tokens))
            if tree.sources:  # the accepted nodes this step kept (an end of turn or the budget may cut the path)
                kept = step.cycle.accepted[: sum(step.drafted)]
                self.accepted_from_lookup += sum(tree.sources[node] != Source.HEAD for node in kept)
            self.lookup_seconds += step.cycle.lookup_seconds

    def __iadd__(self, other: Stats) -> Stats:
        """Every counter of `Stats` summed (lists joined, arms by arm); the latest finish reason kept."""
        for counter in dataclasses.fields(Stats):
            if counter.name == "finish_reason":
                self.finish_reason = other.finish_reason or self.finish_reason
            elif counter.name == "arms":
                self.arms = {arm: self.arms.get(arm, 0) + other.arms.get(arm, 0) for arm in self.arms | other.arms}
            else:
                setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))
        return self

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def record(self) -> dict:
        """The fields a `run` turn record carries (besides prompt and response)."""
        return {
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tau": rounded(self.tau),
            "target_forwards": self.target_forwards,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "finish_reason": self.finish_reason,
            "accept_lengths": self.accept_lengths,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "acceptance_rate": rounded(self.acceptance_rate),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_from_lookup": self.accepted_from_lookup,
            "lookup_seconds": round(self.lookup_seconds, 4),
            "arms": dict(self.arms),
        }

    @property
    def decoding_seconds(self) -> float:
        """The time after the prefill: what decoding rates and speedups divide by."""
        return self.seconds - self.prefill_seconds

    @property
    def plain_steps(self) -> int:
        """Decoding steps that verified no draft."""
        return self.arms.get(Arm.PLAIN.value, 0)

    @property
    def plain_step_seconds(self) -> float | None:
        """A plain step's median time in this record (None without plain steps): one step that a
        neighbour's work or a page fault slowed 1.5x moves it nothing (the mean of a reply's four
        moved its estimated speedup 17% off the measured one)."""
        return statistics.median(self.plain_step_times) if self.plain_step_times else None

    def arm_shares(self) -> dict[str, float]:
        """Each arm's share of the decoding steps (after the prefill), largest first."""
        steps = sum(self.arms.values())
        return {arm: count / steps for arm, count in sorted(self.arms.items(), key=lambda item: -item[1])}


def rounded(value: float | None, digits: int = 4) -> float | None:
    """A record's number, rounded (None stays None)."""
    return None if value is None else round(value, digits)
