"""A chat with the model: conversations as text on one side, token ids on the other.

The engine sees only token ids. This module turns a list of chat messages into the prompt ids
through the model's own chat template, names the tokens that end a turn, turns generated ids
back into text incrementally for streaming, and holds the session that does all three around
the engine, one reply at a time, counting what each reply took (`specchat.stats`). A reply may be
given a prediction (OpenAI's predicted outputs): text it will mostly repeat, which lookup drafts
from (`prediction_usage` says how much of it the reply used).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import jinja2
import torch

from specchat.answers import AnswerStore
from specchat.decode import Cycle, Engine, GenerationSettings, StepResult
from specchat.errors import ContextLengthError, SpecchatError, UsageError
from specchat.stats import Stats

# Special tokens that end an assistant turn in the common chat formats (ChatML, Llama 3, Phi,
# Gemma, plain EOS). Only those present in a tokenizer's vocabulary are used.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>",
)


# Templates for models whose tokenizer carries none, by name (`--chat-template NAME`).
# Vicuna v1.1+ (FastChat's "vicuna_v1.1" conversation format: system line, "USER:"/"ASSISTANT:", </s>).
BUILTIN_TEMPLATES = {
    "vicuna": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
        "{% set rest = messages[1:] %}{% else %}"
        "{{ 'A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user\\'s questions. ' }}{% set rest = messages %}{% endif %}"
        "{% for message in rest %}{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
        "{% else %}{{ 'ASSISTANT: ' + message['content'] + '</s>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    ),
}


# Normalization (NFC, NFKC) may shrink text before it is split into tokens: at most 4 times, a 4-byte
# character becoming a 1-byte one (NFC's worst, three Hangul jamo into one syllable, is 3 times).
NORMALIZATION_SHRINK = 4


def vocabulary_id(tokenizer, name: str) -> int | None:
    """`name`'s id in the tokenizer's vocabulary (added tokens included), None where it has none: a fast
    tokenizer's backend answers at once, where the vocabulary as a dict costs ~0.3 s for 151k entries."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' slow tokenizers have none
    return backend.token_to_id(name) if backend is not None else tokenizer.get_vocab().get(name)


class TemplateError(SpecchatError, ValueError):
    """The tokenizer cannot format a conversation."""


class TemplateFileError(UsageError, TemplateError):
    """The --chat-template file cannot be read or is not a Jinja template."""


def resolve_template(spec: str | None) -> str | None:
    """A template given by name (BUILTIN_TEMPLATES) or as a path to a Jinja file, checked for Jinja
    syntax; None keeps the tokenizer's."""
    if not spec:
        return None
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    try:
        with open(spec, encoding="utf-8") as handle:
            template = handle.read()
    except OSError as error:
        raise TemplateFileError(f"--chat-template {spec}: not a built-in template "
                                f"({', '.join(BUILTIN_TEMPLATES)}) and not a readable file ({error.strerror})") from error
    except UnicodeDecodeError as error:
        raise TemplateFileError(f"--chat-template {spec}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateFileError(f"{spec}:{error.lineno}: not a valid Jinja template ({error.message})") from error
    return template


@dataclass
class Conversation:
    """The messages of one chat, oldest first, as `{"role", "content"}` dicts."""

    system: str | None = None
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def opening(cls, source, default_system: str | None) -> Conversation:
        """Where a prompt record or a server request starts (`source.system`, `source.history`): its own
        system message, else `default_system`, and the turns it brings."""
        return cls(system=source.system if source.system is not None else default_system,
                   messages=list(source.history))

    def as_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def add_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def add_assistant(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class ChatFormat:
    """The chat template and end-of-turn tokens of one tokenizer."""

    def __init__(self, tokenizer, extra_stop_ids: tuple[int, ...] = (), template: str | None = None):
        self.template = template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise TemplateError(
                "the model's tokenizer has no chat template; specchat needs an instruct/chat model "
                f"(or give one: --chat-template {' | '.join(BUILTIN_TEMPLATES)} | FILE.jinja)"
            )
        self.tokenizer = tokenizer
        stop = {vocabulary_id(tokenizer, name) for name in END_OF_TURN_TOKENS} - {None}
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        self.stop_ids = frozenset(stop | set(extra_stop_ids))
        if not self.stop_ids:
            raise TemplateError("the tokenizer names no end-of-sequence token, so a reply could never end")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for: a vocabulary entry's UTF-8 length is at least
        what it decodes to (byte-level entries spend 1-2 bytes per byte, SentencePiece's '▁' 3 for a
        space). Read only for prompts longer than the context in bytes (`check_size`): the vocabulary
        as a dict costs a start ~0.4 s for Qwen's 151k entries."""
        return NORMALIZATION_SHRINK * max(
            (len(token.encode("utf-8", "surrogatepass")) for token in self.tokenizer.get_vocab()), default=1)

    def prompt_ids(self, conversation: Conversation) -> list[int]:
        """Token ids of the conversation followed by the start of an assistant reply.

        Raises TemplateError when the template refuses the conversation (`raise_exception`, e.g. for
        roles out of order) or fails on it.
        """
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    conversation.as_messages(), chat_template=self.template, add_generation_prompt=True,
                    tokenize=True, return_dict=False,
                )
            )
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template cannot format this conversation: {error}") from error

    def prediction_ids(self, text: str) -> list[int]:
        """A prediction's token ids: the text as the reply would spell it, so without the special
        tokens a tokenizer adds around a whole input (a BOS), which no reply repeats."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_size(self, messages: list[dict], context_tokens: int) -> None:
        """Refuse, before tokenizing them, messages whose size alone shows that they cannot fit in
        `context_tokens`: B bytes of text make at least B / max_token_bytes tokens. Tokenizing a huge
        text first costs minutes and gigabytes (a 50 MB line: 173 s and 12.5 GB) only to be refused."""
        size = sum(len(message["content"].encode("utf-8", "surrogatepass")) for message in messages)
        if size > context_tokens and size > context_tokens * self.max_token_bytes:  # (a token is a byte at least)
            raise ContextLengthError(f"the prompt is {size:,} bytes, more than the model's context of {context_tokens} "
                                     f"tokens can hold (a token stands for at most {self.max_token_bytes} bytes)")

    def completion_ids(self, prompt: str | Sequence[int], context_tokens: int) -> list[int]:
        """A completion's prompt as token ids, continued as it is (no template): text tokenized as a whole
        input (with the BOS a model's tokenizer adds; its size checked first, as `check_size` does), or
        token ids checked to be the vocabulary's."""
        if isinstance(prompt, str):
            self.check_size([{"content": prompt}], context_tokens)
            return list(self.tokenizer.encode(prompt))
        vocabulary = len(self.tokenizer)
        if outside := [token for token in prompt if not 0 <= token < vocabulary]:
            raise SpecchatError(f"token id {outside[0]} is not in the model's vocabulary of {vocabulary} tokens")
        return list(prompt)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer, self.stop_ids)


class IncrementalDecoder:
    """Turns a growing list of generated ids into text pieces, as they become printable.

    Byte-level tokenizers split multi-byte characters across tokens; a piece is held back while
    it ends in an incomplete character (decoded as U+FFFD) and released once it is whole.
    """

    # Re-decode at most this many tokens before the unreleased ones, so the cost per token stays flat
    # while still giving the tokenizer the left context it needs to place spaces correctly.
    CONTEXT_TOKENS = 6

    def __init__(self, tokenizer, skip_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.ids: list[int] = []
        self.released = 0  # ids[:released] have been turned into text already
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.skip_ids], skip_special_tokens=False)

    def push(self, token_ids: list[int]) -> str:
        """Add new ids; return the newly printable text (possibly empty)."""
        self.ids.extend(token_ids)
        start = max(0, self.released - self.CONTEXT_TOKENS)
        before = self._decode(self.ids[start : self.released])
        after = self._decode(self.ids[start:])
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""
        self.released = len(self.ids)
        piece = after[len(before) :]
        self.text += piece
        return piece

    def flush(self) -> str:
        """Release whatever is held back (even an incomplete character); `text` is then exact."""
        full = self._decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.released = len(self.ids)
        self.text = full
        return piece


# ---------------------------------------------------------------------------------------------
# The session


@dataclass
class Turn:
    """One reply, filled as it streams and complete when it ends: what the REPL, `run` and `bench`
    read of it, and what a plain replay of it needs (the prompt, the settings, the random state)."""

    prompt_ids: list[int] = field(default_factory=list)  # the conversation the reply answered, as token ids
    generation: GenerationSettings | None = None
    rng_state: torch.Tensor | None = None  # the random stream's state when it began
    prediction_ids: list[int] = field(default_factory=list)  # the text it was predicted to repeat (none: empty)
    text: str = ""  # the whole reply, once it ends (the events carry it piece by piece)
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # per token, the target's top-2 logit margin
    cycles: list[Cycle] = field(default_factory=list)  # its draft cycles (trees, what was accepted)
    stats: Stats = field(default_factory=Stats)
    finished: bool = False  # False: interrupted (Ctrl-C) or failed midway


@dataclass
class TurnEvent:
    """One streamed piece of a reply: the step, the text it made printable, and the turn so far;
    `pieces`: that text token by token, each with whether the token was a draft the target accepted
    (what `--show-accept` colours), the last step's held-back text with the target's own."""

    text: str
    step: StepResult
    turn: Turn
    pieces: list[tuple[str, bool]] = field(default_factory=list)


class ChatSession:
    """A conversation with the target: keeps the messages, streams replies, counts."""

    def __init__(self, engine: Engine, chat_format: ChatFormat, settings: GenerationSettings,
                 rng: torch.Generator | None = None, system: str | None = None, answers: AnswerStore | None = None,
                 keep_answers: bool = False):
        """`answers`: this user's earlier answers (lookup drafts from them: the drafters `LiveChat` builds
        later too), each finished reply added to them where `keep_answers`."""
        self.engine = engine
        self.answers, self.keep_answers = answers, keep_answers
        self.chat_format = chat_format
        self.settings = settings
        self.rng = rng
        self.conversation = Conversation(system=system)
        self.last_turn: Turn | None = None

    def clear(self) -> None:
        self.conversation = Conversation(system=self.conversation.system)

    def prompt_ids(self) -> list[int]:
        return self.chat_format.prompt_ids(self.conversation)

    def reply(self, user_text: str, on_end: Callable[[Turn], None] | None = None, *,
              generation: GenerationSettings | None = None, rng: torch.Generator | None = None,
              prediction: str | None = None) -> Iterator[TurnEvent]:
        """Add the user's message and stream the assistant's reply; `on_end(turn)` once it ends.

        `generation` and `rng` replace the session's own for this reply only (a request's settings);
        `prediction` is text the reply is expected to mostly repeat (OpenAI's predicted outputs),
        which lookup drafts from: it changes how fast the reply comes, never what it says.
        The reply joins the conversation when the stream ends; if the consumer stops early
        (Ctrl-C), the partial reply is kept and marked `"interrupted": True`. A message that cannot
        be answered (too long for the context, refused by the template) ends before any turn.
        """
        self.chat_format.check_size([*self.conversation.as_messages(), {"role": "user", "content": user_text}],
                                    self.engine.max_context)  # a huge one is refused before it is tokenized
        self.conversation.add_user(user_text)
        try:
            prompt = self.prompt_ids()
        except TemplateError:
            self.conversation.messages.pop()  # the message is not part of the conversation after all
            raise
        predicted = self.chat_format.prediction_ids(prediction) if prediction else []

        def joined(turn: Turn) -> None:
            if turn.stats.new_tokens == 0:
                self.conversation.messages.pop()  # nothing was answered (e.g. the prompt was too long)
            else:
                message = {"role": "assistant", "content": turn.text}
                if not turn.finished:
                    message["interrupted"] = True
                self.conversation.messages.append(message)
            if on_end is not None:
                on_end(turn)

        yield from self._stream(prompt, generation, rng, predicted, joined)

    def complete(self, prompt: list[int], on_end: Callable[[Turn], None] | None = None, *,
                 generation: GenerationSettings | None = None,
                 rng: torch.Generator | None = None) -> Iterator[TurnEvent]:
        """Stream the continuation of `prompt`, token ids taken as they are: no chat template, and the
        conversation is neither read nor changed (a server's raw completion); `on_end(turn)` once it ends."""
        yield from self._stream(list(prompt), generation, rng, [], on_end)

    def _stream(self, prompt: list[int], generation: GenerationSettings | None, rng: torch.Generator | None,
                predicted: list[int], on_end: Callable[[Turn], None] | None) -> Iterator[TurnEvent]:
        generation = generation or self.settings
        rng = rng if rng is not None else self.rng
        turn = self.last_turn = Turn(prompt, generation, rng.get_state() if rng is not None else None, predicted)
        decoder = self.chat_format.decoder()
        try:
            for step in self.engine.generate(prompt, generation, rng, prediction=predicted):
                turn.stats.add_step(step)
                turn.tokens += step.tokens
                turn.margins += step.margins
                if step.cycle is not None:
                    turn.cycles.append(step.cycle)
                # Each token's text is made once, token by token (mlx-lm's stream does so too), so that
                # the text and its colouring by source are one decoding.
                pieces = [(decoder.push([token]), drafted) for token, drafted in zip(step.tokens, step.drafted)]
                if step.finish_reason:  # the last step also releases what the decoder held back
                    pieces.append((decoder.flush(), False))
                yield TurnEvent(text="".join(piece for piece, _ in pieces), step=step, turn=turn, pieces=pieces)
            turn.finished = True
            if self.keep_answers and self.answers is not None:
                self.answers.add(prompt, turn.tokens)
        finally:
            decoder.flush()
            turn.text = decoder.text
            if on_end is not None:
                on_end(turn)


def prediction_usage(prediction_ids: list[int], completion_ids: list[int]) -> tuple[int, int]:
    """OpenAI's `(accepted_prediction_tokens, rejected_prediction_tokens)` of a reply given a prediction:
    the tokens of the prediction that appeared in the completion (in order: the matching blocks of
    the two sequences) and those that did not. It says how much of the prediction the answer
    repeated, whatever the drafts made of it (a token may be accepted here and drafted never)."""
    matcher = difflib.SequenceMatcher(None, prediction_ids, completion_ids, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction_ids) - accepted
