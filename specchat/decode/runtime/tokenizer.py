"""The target's tokenizer without transformers, for a start from the packed model
(`specchat.decode.runtime.packed`): what specchat asks of transformers' fast tokenizer (a chat
through its template to token ids, ids back to text, the vocabulary, the end-of-sequence token),
answered from a snapshot of the tokenizer transformers built.

A snapshot, not the model folder's tokenizer.json: transformers' tokenizer classes rebuild parts of
the file (its Qwen2Tokenizer adds an NFC normalizer that Qwen2.5's tokenizer.json lacks), so the
backend it built is what is kept (`snapshot`). The chat template is rendered as transformers
renders it (`render_chat`: the same sandbox, filters, globals and message clean-up), which the tests
check against transformers' own `apply_chat_template`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# transformers passes a message's reasoning under these names, the first being what templates read
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def unsnapshotable_reason(tokenizer) -> str | None:
    """Why a snapshot of a transformers tokenizer would not answer as it does, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "it has no tokenizers backend (a slow tokenizer)"
    if isinstance(tokenizer.chat_template, dict):
        return "it has several named chat templates"
    # transformers cleans up spaces after the backend's decode where asked, except for BPE models
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if tokenizer.clean_up_tokenization_spaces and (not bpe or forced):
        return "its decoding cleans up spaces"
    return None


def snapshot(tokenizer) -> dict:
    """What `SnapshotTokenizer` needs of a transformers tokenizer (one without `unsnapshotable_reason`),
    as JSON-ready values."""
    return {"backend": quick_merges(tokenizer.backend_tokenizer.to_str()),
            "special_tokens": dict(tokenizer.special_tokens_map),
            "eos_token_id": tokenizer.eos_token_id, "chat_template": tokenizer.chat_template,
            "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))}


def quick_merges(backend: str) -> str:
    """A tokenizer's JSON with its BPE merges written as "a b" strings rather than [a, b] pairs, where no
    merged token holds a space (byte-level BPE writes a space as Ġ): the same merges, which tokenizers
    reads ~20% faster (Qwen2.5's 151k merges: 0.33 -> 0.27 s of every start from the packed model)."""
    saved = json.loads(backend)
    merges = saved.get("model", {}).get("merges")
    if not merges or not all(isinstance(merge, list) and " " not in "".join(merge) for merge in merges):
        return backend
    saved["model"]["merges"] = [" ".join(merge) for merge in merges]
    return json.dumps(saved, ensure_ascii=False)


class SnapshotTokenizer:
    """The subset of transformers' fast-tokenizer interface specchat uses (`specchat.chat`,
    `specchat.ui`, the drafters' vocabulary checks), over a `snapshot`."""

    def __init__(self, saved: dict):
        self.backend_tokenizer = Tokenizer.from_str(saved["backend"])
        # transformers encodes without truncation or padding and splits special tokens only if asked
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.encode_special_tokens = saved["split_special_tokens"]
        self.special_tokens_map = saved["special_tokens"]
        self.eos_token_id = saved["eos_token_id"]
        self.chat_template = saved["chat_template"]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids, with the special tokens the tokenizer adds around a whole input (a BOS) unless
        asked not to, as transformers' `encode` does."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False) -> list[int] | str:
        """transformers' `apply_chat_template` for one conversation, as specchat calls it: the ids
        (or with `tokenize=False` the text) of the rendered conversation."""
        if return_dict:
            raise ValueError("return_dict is transformers' BatchEncoding, which this tokenizer does not make")
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("the tokenizer has no chat template and none was given")
        text = render_chat(template, conversation, add_generation_prompt, self.special_tokens_map)
        return self.encode(text, add_special_tokens=False) if tokenize else text  # the template wrote its own


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool,
                special_tokens: Mapping[str, str]) -> str:
    """A conversation through a chat template, as transformers' `render_jinja_template` renders it:
    messages without their None values, as plain data, the reasoning under each of its names; the
    special tokens (`bos_token`, `eos_token`, ...) as variables; no tools, no documents."""
    chat = [_with_reasoning_aliases(_plain({key: value for key, value in message.items() if value is not None}))
            for message in messages]
    return _compiled(template).render(messages=chat, tools=None, documents=None,
                                      add_generation_prompt=add_generation_prompt, **_plain(dict(special_tokens)))


def _plain(value):
    """transformers' `_plain_template_data`: the template sees JSON types only (a subclass is cut back
    to its base type, anything else becomes a placeholder naming its type; the numpy scalars,
    dataclasses and pydantic models it also converts are not in specchat's messages)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    """transformers' `_alias_reasoning_fields`: a message's reasoning under each name templates read."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`, which marks an assistant's text for transformers'
    assistant-token masks: rendered as its body (specchat asks for no mask)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: JSON as json.dumps writes it (Jinja's own escapes HTML characters)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class TemplateDict:
    """transformers' `dict` for templates: building dicts, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """transformers' `namespace` for templates: no attribute whose name starts with an underscore."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]  # Jinja's own signature trick, so that namespace(self=...) works
        attributes = dict(*args, **kwargs)
        for name in attributes:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """A template compiled in transformers' environment (its `_cached_compile_jinja_template`): chat
    templates come from the hub, so the sandbox; whitespace control and loop controls as there."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                               namespace=TemplateNamespace)
    return environment.from_string(template)
