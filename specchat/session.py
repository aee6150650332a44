"""A chat on top of the engine: text in, streamed text out, with per-turn statistics.

Statistics follow the field's definitions (vLLM, SGLang, Spec-Bench):
- tau (mean acceptance length) = new tokens / target forward passes, the bonus token included,
  so plain decoding has tau = 1.0;
- acceptance rate = accepted draft tokens / draft tokens the target verified;
- tokens/s = new tokens / wall time of the turn, prefill included.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specchat.chat import ChatFormat, Conversation
from specchat.engine import Engine, GenerationSettings, StepResult


class Rates:
    """The field's derived numbers, for any counter with new_tokens, seconds, target_forwards,
    draft_tokens and accepted_tokens."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass
class TurnStats(Rates):
    """Counters for one reply."""

    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    target_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    accept_lengths: list[int] = field(default_factory=list)  # tokens per speculative cycle, bonus included
    finish_reason: str | None = None

    def add(self, step: StepResult) -> None:
        self.new_tokens += len(step.tokens)
        self.seconds += step.seconds
        self.target_forwards += step.target_forwards
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        self.draft_tokens += step.draft_tokens
        self.accepted_tokens += sum(step.drafted)
        if step.prefill:
            self.prefill_seconds += step.seconds
        elif step.cycle is not None:
            self.accept_lengths.append(len(step.tokens))
        self.finish_reason = step.finish_reason or self.finish_reason

    def record(self) -> dict:
        """The fields a `run` turn record carries (besides prompt and response)."""
        return {
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tau": round(self.tau, 4),
            "target_forwards": self.target_forwards,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "finish_reason": self.finish_reason,
            "accept_lengths": self.accept_lengths,
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            # accepted draft tokens / draft tokens the target verified (every tree node counts)
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
        }


@dataclass
class TurnEvent:
    """One streamed piece of a reply: the step and the text it made printable."""

    text: str
    step: StepResult


class ChatSession:
    """A conversation with the target: keeps the messages, streams replies, counts."""

    def __init__(self, engine: Engine, chat_format: ChatFormat, settings: GenerationSettings,
                 rng: torch.Generator | None = None, system: str | None = None):
        self.engine = engine
        self.chat_format = chat_format
        self.settings = settings
        self.rng = rng
        self.conversation = Conversation(system=system)
        self.last_stats: TurnStats | None = None
        self.last_prompt_ids: list[int] = []  # what the target's cache held before the latest reply

    def clear(self) -> None:
        self.conversation = Conversation(system=self.conversation.system)

    def prompt_ids(self) -> list[int]:
        return self.chat_format.prompt_ids(self.conversation)

    def reply(self, user_text: str) -> Iterator[TurnEvent]:
        """Add the user's message and stream the assistant's reply.

        The reply joins the conversation when the stream ends; if the consumer stops early
        (Ctrl-C), the partial reply is kept and marked `"interrupted": True`.
        """
        self.conversation.add_user(user_text)
        prompt = self.last_prompt_ids = self.prompt_ids()
        decoder = self.chat_format.decoder()
        stats = self.last_stats = TurnStats()
        finished = False
        try:
            for step in self.engine.generate(prompt, self.settings, self.rng):
                stats.add(step)
                text = decoder.push(step.tokens)
                if step.finish_reason:  # the last step also releases what the decoder held back
                    text += decoder.flush()
                yield TurnEvent(text=text, step=step)
            finished = True
        finally:
            if stats.new_tokens == 0:
                self.conversation.messages.pop()  # nothing was answered (e.g. the prompt was too long)
            else:
                decoder.flush()
                message = {"role": "assistant", "content": decoder.text}
                if not finished:
                    message["interrupted"] = True
                self.conversation.messages.append(message)
