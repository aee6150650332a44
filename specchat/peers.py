"""Other tools' implementations, run by `specchat bench` on the same model, prompts and settings.

- `hf-assisted`: transformers' assisted generation, with a smaller model of the same tokenizer
  as the assistant; `hf-pld`: transformers' prompt lookup decoding. Both on the loaded target.
- `llamacpp`: llama.cpp (llama-cpp-python, the optional extra `peers`) decoding the very GGUF
  file the target was loaded from, with the same threads; `llamacpp-lookup`: the same with its
  prompt lookup decoding. This is what most CPU users run (ollama wraps it), so it is the number
  to beat. Prompts are the same token ids (the model's own chat template), sampling is the plain
  distribution (temperature only: no top-k 40, min-p or repetition penalty of its defaults).

OpenVINO GenAI and vLLM, which live in environments of their own, are in `specchat.peers_openvino`
and `specchat.peers_vllm`. Each builder (`RUNNERS`, by entry of `specchat.methods`; all the peers'
tables are joined in `specchat.bench_run.RUNNERS`) returns a runner (a `ConversationRunner`: the
interface of `specchat.bench.SessionRunner`) and whatever it loaded, to be let go when the method is done.
Target forwards are counted (a forward hook, or llama.cpp's evaluation calls), so τ means the
same as for specchat's methods; the time to the first token is the prefill.
"""

from __future__ import annotations

import importlib.util
import time

import torch
from transformers.generation.streamers import BaseStreamer

from specchat.chat import ChatFormat, Conversation, Turn
from specchat.decode import GenerationSettings, Target
from specchat.errors import SpecchatError
from specchat.inputs import PromptRecord
from specchat import methods
from specchat.settings import Settings
from specchat.stats import Stats
from specchat.sources import source_gguf

HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens default
# llama-cpp-python's LlamaPromptLookupDecoding defaults (16-36 tok/s with 10 tokens here, measured 2026-11-22).
LLAMACPP_LOOKUP_TOKENS, LLAMACPP_LOOKUP_NGRAM = 10, 2
LLAMACPP_MAX_CONTEXT = 4096  # allocated whole (with lookup, logits too: 2.5 GB); bench prompts and answers fit
LLAMACPP_BUILD = ("CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                  "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" pip install 'specchat[peers]'")


class PeerUnavailable(SpecchatError):
    """A peer cannot run here (its package is not installed, or the model has no GGUF file)."""


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


class ConversationRunner:
    """What every peer's bench runner shares (the interface of `specchat.bench.SessionRunner`): one
    conversation per question, whose turns it answers with token ids of the model's own chat template."""

    chat_format: ChatFormat

    def __init__(self):
        self.conversation: Conversation | None = None

    def close(self) -> None:
        pass

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.conversation = Conversation(system=record.system if record.system is not None else system)
        self.conversation.messages.extend(record.history)

    def answered(self, tokens: list[int], stats: Stats) -> Turn:
        """The turn that answered with `tokens`, added to the conversation."""
        decoder = self.chat_format.decoder()
        decoder.push(tokens)
        decoder.flush()
        self.conversation.add_assistant(decoder.text)
        return Turn(text=decoder.text, tokens=tokens, stats=stats, finished=True)


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


class LlamaCppRunner(ConversationRunner):
    """llama.cpp on the target's GGUF file: a conversation's turns through the high-level generator,
    which reuses its cache for the shared prefix, as our engine does."""

    def __init__(self, gguf, chat_format: ChatFormat, settings: GenerationSettings, seed: int | None, threads: int,
                 context: int, lookup: bool):
        # An optional extra (a native build): imported only when this peer runs.
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(LLAMACPP_LOOKUP_NGRAM, LLAMACPP_LOOKUP_TOKENS) if lookup else None
        # With a draft model it keeps logits for every position, and 0.3.36 then fails on a prompt
        # longer than one batch (its last, shorter batch is copied as a full one): one batch per prompt.
        batch = context if lookup else 512
        self.llm = Llama(model_path=str(gguf), n_ctx=context, n_batch=batch, n_ubatch=batch, n_threads=threads,
                         n_threads_batch=threads, seed=seed if seed is not None else 0, draft_model=draft,
                         verbose=False)
        self.chat_format, self.settings = chat_format, settings
        self.forwards = 0
        evaluate = self.llm.eval

        def counted(tokens):  # every forward of the model passes here (prefill, plain steps, lookup batches)
            self.forwards += 1
            return evaluate(tokens)

        self.llm.eval = counted
        super().__init__()

    def close(self) -> None:
        self.llm.close()

    def turn(self, prompt: str) -> Turn:
        self.conversation.add_user(prompt)
        ids = self.chat_format.prompt_ids(self.conversation)
        sampling, budget = self.settings.sampling, self.settings.max_new_tokens
        self.forwards = 0
        new, first_token_seconds = [], 0.0
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                       min_p=0.0, repeat_penalty=1.0):
            if not new:
                first_token_seconds = time.perf_counter() - start
            new.append(token)
            if token in self.settings.stop_ids or len(new) >= budget:
                break
        seconds = time.perf_counter() - start
        return self.answered(new, Stats(new_tokens=len(new), seconds=seconds, prefill_seconds=first_token_seconds,
                                        target_forwards=self.forwards))


def _llamacpp(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
              lookup: bool) -> tuple[LlamaCppRunner, None]:
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable(f"needs llama-cpp-python; on x86 build it without AMX (GCC 12 segfaults there): {LLAMACPP_BUILD}")
    gguf = source_gguf(target.spec)
    if gguf is None:
        raise PeerUnavailable(f"{target.name} has no GGUF file for llama.cpp to read")
    context = min(target.max_context, LLAMACPP_MAX_CONTEXT)
    return LlamaCppRunner(gguf, chat_format, generation, settings.seed, torch.get_num_threads(), context, lookup), None


def llamacpp(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
             load_model) -> tuple[LlamaCppRunner, None]:
    return _llamacpp(settings, target, chat_format, generation, lookup=False)


def llamacpp_lookup(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                    load_model) -> tuple[LlamaCppRunner, None]:
    return _llamacpp(settings, target, chat_format, generation, lookup=True)


# What runs each of these tools' methods (all peers': `specchat.bench_run.RUNNERS`).
RUNNERS = {methods.HF_ASSISTED: hf_assisted, methods.HF_PLD: hf_prompt_lookup, methods.LLAMACPP: llamacpp,
           methods.LLAMACPP_LOOKUP: llamacpp_lookup}
