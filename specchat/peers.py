"""Other tools' implementations, run by `specchat bench` on the same target, prompts and settings.

- `hf-assisted`: transformers' assisted generation, with a smaller model of the same tokenizer
  as the assistant;
- `hf-pld`: transformers' prompt lookup decoding.

Each builder (named by `specchat.methods`) returns a runner with the interface of
`specchat.bench.SessionRunner` and whatever it loaded, to be let go when the method is done.
Target forwards are counted with a forward hook, so τ means the same as for specchat's methods.
"""

from __future__ import annotations

import time

import torch

from specchat.chat import ChatFormat, Conversation
from specchat.engine import GenerationSettings
from specchat.inputs import PromptRecord
from specchat.settings import Settings
from specchat.stats import Stats
from specchat.target import Target

HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens default


class GenerateRunner:
    """A transformers `generate` peer (assisted generation or prompt lookup) on the same target."""

    def __init__(self, target: Target, chat_format: ChatFormat, settings: GenerationSettings, generate_kwargs: dict,
                 rng_seed: int | None):
        self.target, self.chat_format, self.settings = target, chat_format, settings
        self.kwargs = generate_kwargs
        self.seed = rng_seed
        self.forwards = 0
        self._hook = target.model.register_forward_pre_hook(self._count)  # every target forward passes here
        self.conversation: Conversation | None = None

    def close(self) -> None:
        self._hook.remove()

    def _count(self, module, args) -> None:
        self.forwards += 1

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.conversation = Conversation(system=record.system if record.system is not None else system)
        self.conversation.messages.extend(record.history)

    @torch.inference_mode()
    def turn(self, prompt: str) -> tuple[str, Stats, list[dict]]:
        self.conversation.add_user(prompt)
        ids = torch.tensor([self.chat_format.prompt_ids(self.conversation)], device=self.target.device)
        sampling = self.settings.sampling
        if not sampling.greedy and self.seed is not None:
            torch.manual_seed(self.seed)
        self.forwards = 0
        start = time.perf_counter()
        output = self.target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.settings.max_new_tokens,
            do_sample=not sampling.greedy, temperature=sampling.temperature or None,
            top_p=sampling.top_p if not sampling.greedy else None, top_k=sampling.top_k or None,
            eos_token_id=sorted(self.settings.stop_ids), pad_token_id=min(self.settings.stop_ids), **self.kwargs)
        seconds = time.perf_counter() - start
        new = output[0, ids.shape[1]:].tolist()
        decoder = self.chat_format.decoder()
        decoder.push(new)
        decoder.flush()
        self.conversation.add_assistant(decoder.text)
        return decoder.text, Stats(new_tokens=len(new), seconds=seconds, target_forwards=self.forwards), []


def hf_assisted(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                load_model) -> tuple[GenerateRunner, Target]:
    assistant = load_model(settings.draft)
    return GenerateRunner(target, chat_format, generation, {"assistant_model": assistant.model}, settings.seed), assistant


def hf_prompt_lookup(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                     load_model) -> tuple[GenerateRunner, None]:
    kwargs = {"prompt_lookup_num_tokens": HF_PLD_TOKENS}
    return GenerateRunner(target, chat_format, generation, kwargs, settings.seed), None


BUILDERS = {builder.__name__: builder for builder in (hf_assisted, hf_prompt_lookup)}
