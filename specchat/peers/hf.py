"""transformers' own speculation as `specchat bench` peers, on the loaded target itself.

- `hf-assisted`: assisted generation, with a smaller model of the same tokenizer as the assistant;
- `hf-pld`: prompt lookup decoding, HF_PLD_TOKENS tokens proposed per step (its default).

Both run `generate` on the very model specchat verifies with; a forward hook counts the target's
forwards, and a streamer times the first token (the prefill).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from specchat import methods
from specchat.chat import ChatFormat, Turn
from specchat.decode import GenerationSettings, Target
from specchat.peers import ConversationRunner
from specchat.settings import Settings
from specchat.stats import Stats

HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens default


class FirstTokenClock(BaseStreamer):
    """Times transformers' `generate` to its first new token (the prefill): `generate` hands a
    streamer the prompt first, then the new tokens as they come."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first_token_seconds = 0.0
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first_token_seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class GenerateRunner(ConversationRunner):
    """A transformers `generate` peer (assisted generation or prompt lookup) on the same target."""

    def __init__(self, target: Target, chat_format: ChatFormat, settings: GenerationSettings, generate_kwargs: dict,
                 rng_seed: int | None):
        self.target, self.chat_format, self.settings = target, chat_format, settings
        self.kwargs = generate_kwargs
        self.seed = rng_seed
        self.forwards = 0
        self._hook = target.model.register_forward_pre_hook(self._count)  # every target forward passes here
        super().__init__()

    def close(self) -> None:
        self._hook.remove()

    def _count(self, module, args) -> None:
        self.forwards += 1

    @torch.inference_mode()
    def turn(self, prompt: str) -> Turn:
        self.conversation.add_user(prompt)
        ids = torch.tensor([self.chat_format.prompt_ids(self.conversation)], device=self.target.device)
        sampling = self.settings.sampling
        if not sampling.greedy and self.seed is not None:
            torch.manual_seed(self.seed)
        self.forwards = 0
        clock = FirstTokenClock()
        output = self.target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.settings.max_new_tokens,
            do_sample=not sampling.greedy, temperature=sampling.temperature or None,
            top_p=sampling.top_p if not sampling.greedy else None, top_k=sampling.top_k or None,
            eos_token_id=sorted(self.settings.stop_ids), pad_token_id=min(self.settings.stop_ids), streamer=clock,
            **self.kwargs)
        seconds = time.perf_counter() - clock.start
        new = output[0, ids.shape[1]:].tolist()
        return self.answered(new, Stats(new_tokens=len(new), seconds=seconds, prefill_seconds=clock.first_token_seconds,
                                        target_forwards=self.forwards))


def hf_assisted(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                load_model) -> tuple[GenerateRunner, Target]:
    assistant = load_model(settings.draft)
    return GenerateRunner(target, chat_format, generation, {"assistant_model": assistant.model}, settings.seed), assistant


def hf_prompt_lookup(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                     load_model) -> tuple[GenerateRunner, None]:
    kwargs = {"prompt_lookup_num_tokens": HF_PLD_TOKENS}
    return GenerateRunner(target, chat_format, generation, kwargs, settings.seed), None


# What runs each of its methods (all peers': `specchat.bench.run.RUNNERS`).
RUNNERS = {methods.HF_ASSISTED: hf_assisted, methods.HF_PLD: hf_prompt_lookup}
