"""Assembly: from resolved settings to a loaded target, its drafter and a chat — for chat, run and bench.

Order matters to the user: values that can be checked without a model are checked first (a bad
temperature should not cost a model load), then the target loads, then the method's proposer.
Nothing here prints or exits; every failure is one of the errors of `specchat.errors`, which the
command line turns into one line and an exit status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from specchat.answers import AnswerStore
from specchat.chat import ChatFormat, ChatSession, resolve_template
from specchat.decode import Engine, GenerationSettings, ModelSpec, SamplingParams, Target, make_generator, options
from specchat.live import LiveChat
from specchat.methods import checked_draft
from specchat.proposers import LoadModel, build_proposer
from specchat.settings import Settings, resolve
from specchat.sources import load_target

log = logging.getLogger(__name__)


def model_loader(settings: Settings, packed_model: bool = False) -> LoadModel:
    """`load(name, gguf_file=None)`: loads a model (the target, or a draft model) the way `settings` say;
    `packed_model`: from its packed file where it has one, without transformers' model (`load_target`)."""
    def load_model(name: str, gguf_file: str | None = None) -> Target:
        return load_target(ModelSpec(model=name, gguf_file=gguf_file, dtype=settings.dtype, device=settings.device,
                                     quantize=settings.quantize, compile=settings.compile,
                                     cuda_graphs=settings.cuda_graphs,
                                     trust_remote_code=settings.trust_remote_code), packed_model)

    return load_model


def training_target(model: str | None, gguf_file: str | None, dtype: str, device: str, profile: str | None,
                    quantize: str = "none") -> Target:
    """The target that answers prompts for training data or that a head is trained for (`data
    regenerate`, `train`): the profile's model unless `model` says otherwise, loaded plainly (no
    compilation or CUDA graphs, and for training no quantization: it needs the exact activations).
    `quantize` (answering on a CPU): the kernel's quantized target, whose answers are a chat's on it."""
    settings, _ = resolve({"model": model, "gguf_file": gguf_file, "dtype": dtype, "device": device,
                           "quantize": quantize, "compile": "off", "cuda_graphs": "off"}, profile)
    return model_loader(settings)(settings.model, settings.gguf_file)


@dataclass(frozen=True)
class Checked:
    """What the settings give once checked, before any model loads."""

    sampling: SamplingParams
    template: str | None  # the --chat-template's text, or None for the tokenizer's own


def check(settings: Settings) -> Checked:
    """What can be checked before any model loads: the method's draft, the template file (each value
    was checked where it was parsed, `settings`)."""
    checked_draft(settings)
    return Checked(SamplingParams(settings.temperature, settings.top_p, settings.top_k),
                   resolve_template(settings.chat_template))


def load_chat_model(settings: Settings, checked: Checked, packed_model: bool = False) -> tuple[Target, ChatFormat]:
    """The target and its chat format (the template the settings name, else the tokenizer's)."""
    target = model_loader(settings, packed_model)(settings.model, settings.gguf_file)
    return target, ChatFormat(target.tokenizer, template=checked.template)


def generation_settings(settings: Settings, checked: Checked, chat_format: ChatFormat) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=settings.max_new_tokens, sampling=checked.sampling,
                              stop_ids=chat_format.stop_ids)


def answer_store(settings: Settings, target: Target, by_default: bool) -> AnswerStore | None:
    """This user's earlier answers under the target's tokenizer, where `--answer-index` wants them
    (auto: `by_default`, which chat says and run and bench do not)."""
    wanted = settings.answer_index == "on" or (settings.answer_index == options.AUTO and by_default)
    return AnswerStore.for_tokenizer(target.tokenizer) if wanted else None


def open_session(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
                 load_model: LoadModel, answers: AnswerStore | None = None, keep_answers: bool = False) -> ChatSession:
    """A chat session on a loaded target, decoding with the settings' method (its draft loads here);
    lookup drafts from the `answers` too, and the session adds its own to them where `keep_answers`."""
    engine = Engine(target, build_proposer(settings, target, load_model, answers))
    return ChatSession(engine, chat_format, generation, make_generator(settings.seed, target.device),
                       system=settings.system, answers=answers, keep_answers=keep_answers)


def open_chat(settings: Settings, profile: str | None, target_loaded: Callable[[], None] | None = None,
              answers_by_default: bool = False) -> LiveChat:
    """Everything `chat` and `run` need: the target, the method's proposer and a session around
    them, whose method and settings can change mid-chat. `target_loaded()` runs once the target
    has loaded (so that a model that cannot load gives the only message); `answers_by_default`: the
    command keeps and reads this user's earlier answers unless told otherwise (`answer_store`).

    The target and any draft model come from their packed files where they have them: a chat
    needs only their forward, not transformers' model (`specchat.decode.runtime.packed`)."""
    checked = check(settings)
    target, chat_format = load_chat_model(settings, checked, packed_model=True)
    if target_loaded is not None:
        target_loaded()
    load_model = model_loader(settings, packed_model=True)
    session = open_session(settings, target, chat_format, generation_settings(settings, checked, chat_format),
                           load_model, answer_store(settings, target, answers_by_default), keep_answers=True)
    log.debug(f"set up {settings.method} decoding (its draft, where it has one, loaded and sized)")
    return LiveChat(session, settings, profile, load_model)
