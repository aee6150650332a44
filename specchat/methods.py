"""Decoding methods by name: what each drafts with, what it needs, which draft it takes by default.

The one registry the rest reads: the choices of `--method` (settings), the command line's help,
`bench` (which methods exist and which are other tools' peers), `/method`, the draft a method
uses when none is given, and the rule that a method needing a draft has one (`checked_draft`). It
imports nothing heavy, so the command line uses it before torch loads. What builds each method is
a table next to the builders: `specchat.proposers.BUILDERS` for specchat's methods,
`specchat.bench.run.RUNNERS` for other tools' implementations (the peers of `specchat.peers`:
`hf`, `llamacpp`, `openvino`, `vllm`), which only `bench` runs.

eagle, eagle2 and deagle take any head format (EAGLE-1/2, EAGLE-3 or Jakiro); jakiro needs a
Jakiro head. Every specchat method is verified by the same exact rules (`specchat.decode.acceptance.verify`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specchat import embedded, heads
from specchat.embedded import DEFAULT_MODEL
from specchat.errors import UsageError

PLAIN = "vanilla"  # plain decoding: the baseline every speedup is measured against
HEAD_FORMATS = ("eagle", "eagle3", "jakiro")  # the draft head formats `drafters` reads
HEAD_LAYOUTS = ("eagle", "sglang", "speculators")  # the layouts `drafters.export_head` writes (drafters.LAYOUTS)
OPENVINO_LAYOUT = "openvino"  # OpenVINO GenAI's IR of the sglang layout, made by optimum-intel (`specchat.exports`)
LLAMACPP_LAYOUT = "llamacpp"  # a GGUF of the speculators layout, made by llama.cpp's converter (`specchat.peers.llamacpp`)
EXPORT_FORMATS = (*HEAD_LAYOUTS, OPENVINO_LAYOUT, LLAMACPP_LAYOUT)  # what `export-head --format` takes
HEAD = "a draft head (folder or hub id; EAGLE-1/2, EAGLE-3 or Jakiro format)"
MODEL = "a small draft model sharing the target's tokenizer (like --model)"
QWEN_05B, QWEN_15B = DEFAULT_MODEL, "qwen2.5-coder-1.5b-instruct"


@dataclass(eq=False)
class Method:
    name: str
    summary: str
    draft: str | None = None  # what --draft must name (HEAD or MODEL); None: the method takes no draft
    head_kind: str | None = None  # the head format it needs (None: any)
    bundled: dict[str, str] = field(default_factory=dict)  # target model -> its draft when none is given
    peer: bool = False  # another tool's implementation on the same target, run only by `bench`
    static_tree: bool = False  # it can draft a --static-tree
    plain: str = PLAIN  # whose answers `bench` compares this one's with: plain decoding (a peer's: its own runtime's)


VANILLA = Method(PLAIN, "plain decoding")
EAGLE = Method("eagle", "EAGLE-1 static tree from a draft head", draft=HEAD, static_tree=True,
               bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle"})
EAGLE2 = Method("eagle2", "EAGLE-2 dynamic tree from a draft head", draft=HEAD,
                bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle3"})
DEAGLE = Method("deagle", "EAGLE-2 tree with DEAGLE's dynamic depth", draft=HEAD,
                bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle3"})
JAKIRO = Method("jakiro", "EAGLE-2 tree from a Jakiro MoE head, last level in parallel", draft=HEAD,
                head_kind="jakiro", static_tree=True, bundled={QWEN_05B: "qwen2.5-coder-0.5b-jakiro"})
SPS = Method("sps", "speculative sampling with a small draft model", draft=MODEL, bundled={QWEN_15B: QWEN_05B})
PLD = Method("pld", "prompt lookup (n-gram matches, no draft model)")
HF_ASSISTED = Method("hf-assisted", "transformers' assisted generation with a small draft model", draft=MODEL,
                     bundled={QWEN_15B: QWEN_05B}, peer=True)
HF_PLD = Method("hf-pld", "transformers' prompt lookup decoding", peer=True)
LLAMACPP = Method("llamacpp", "llama.cpp decoding the target's GGUF file", peer=True)
LLAMACPP_LOOKUP = Method("llamacpp-lookup", "llama.cpp's prompt lookup decoding on the target's GGUF file", peer=True,
                         plain=LLAMACPP.name)
LLAMACPP_EAGLE3 = Method("llamacpp-eagle3", "llama.cpp's EAGLE-3 speculation (llama-server) with specchat's head",
                         draft=HEAD, head_kind="eagle3", bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle3"}, peer=True,
                         plain=LLAMACPP.name)
OPENVINO = Method("openvino", "OpenVINO GenAI decoding the target with int4 weights", peer=True)
OPENVINO_INT8 = Method("openvino-int8", "OpenVINO GenAI decoding the target with int8 weights", peer=True)
OPENVINO_LOOKUP = Method("openvino-lookup", "OpenVINO GenAI's prompt lookup decoding (int4 weights)", peer=True,
                         plain=OPENVINO.name)
OPENVINO_EAGLE3 = Method("openvino-eagle3", "OpenVINO GenAI's EAGLE-3 speculation with specchat's head (int4 weights)",
                         draft=HEAD, head_kind="eagle3", bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle3"}, peer=True,
                         plain=OPENVINO.name)
VLLM = Method("vllm", "vLLM's CPU build decoding the target", peer=True)
VLLM_EAGLE3 = Method("vllm-eagle3", "vLLM's EAGLE-3 speculation with specchat's head", draft=HEAD, head_kind="eagle3",
                     bundled={QWEN_05B: "qwen2.5-coder-0.5b-eagle3"}, peer=True, plain=VLLM.name)
METHODS = {entry.name: entry for entry in (VANILLA, EAGLE, EAGLE2, DEAGLE, JAKIRO, SPS, PLD, HF_ASSISTED, HF_PLD,
                                           LLAMACPP, LLAMACPP_LOOKUP, LLAMACPP_EAGLE3, OPENVINO, OPENVINO_INT8,
                                           OPENVINO_LOOKUP, OPENVINO_EAGLE3, VLLM, VLLM_EAGLE3)}
CHAT_METHODS = tuple(name for name, method in METHODS.items() if not method.peer)  # what --method takes


class MethodError(UsageError):
    """A method cannot run with the given settings (unknown, or it needs a draft it was not given)."""


class MissingDraft(MethodError):
    """A method that needs a draft has none: none given, none bundled for the model."""

    def __init__(self, entry: Method):
        super().__init__(f"--method {entry.name} needs --draft: {entry.draft}")
        self.method, self.draft = entry.name, entry.draft


def method(name: str) -> Method:
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r} (known: {', '.join(METHODS)})")
    return METHODS[name]


def needs_draft(name: str) -> str | None:
    """What `--draft` must name for a method, or None if it takes no draft (or is unknown)."""
    return METHODS[name].draft if name in METHODS else None


def default_draft(name: str, target_name: str) -> str | None:
    """The draft a method uses when none is given: a head bundled for this target, or (sps and
    hf-assisted on the 1.5B) the smaller embedded model that shares its tokenizer. The target named
    as an embedded model or as the published model it quantizes (by hub id, or its snapshot in the
    hub's cache: `embedded.embedded_name`) has the same drafts."""
    entry = METHODS[name]
    draft = entry.bundled.get(embedded.embedded_name(target_name) or target_name)
    if entry.draft == HEAD and draft not in heads.bundled_heads():
        return None
    return draft


def effective_draft(settings) -> str | None:
    """`--draft` if given, else the default draft of the method for this target (None for no draft)."""
    if not needs_draft(settings.method):
        return settings.draft
    return settings.draft or default_draft(settings.method, settings.model)


def plain_of(label: str) -> str:
    """The plain decoding a bench method's answers are compared with (`label`: a method, + options)."""
    method = METHODS.get(label.split("+")[0])
    return method.plain if method else PLAIN


def checked_draft(settings) -> str | None:
    """The draft `settings.method` runs with (`effective_draft`), refused (`MissingDraft`) where the
    method needs one and has none: the rule, checked where settings are (`specchat.app.check` before
    any model loads, a mid-chat change in `specchat.live`, each method of a bench)."""
    draft = effective_draft(settings)
    if needs_draft(settings.method) and not draft:
        raise MissingDraft(METHODS[settings.method])
    return draft


def bench_methods(settings) -> list[str]:
    """What `specchat bench` measures unless told: plain decoding (the baseline), the profile's method
    (what chat would run: the default profile's deagle with lookup and the pace) and prompt lookup
    alone (what needs no draft), each once."""
    return list(dict.fromkeys([PLAIN, settings.method, PLD.name]))


def drafted_for_model(settings, given: dict) -> tuple[object, str | None]:
    """A profile's method comes with a draft for the profile's model. With another --model that has
    none, and no --method or --draft given, chat and run draft with what that model has rather than
    fail on a flag the user never gave, and say so: the smaller embedded model that shares its
    tokenizer where it is installed (`sps`, chains as long as pay, with the profile's lookup and pace:
    on the embedded 1.5B, 1.46x its plain decoding on general10 where prompt lookup alone gave 1.17x,
    two AVX-512 cores of an Intel Xeon, README), else prompt lookup alone (`pld`: it needs no draft). Returns
    the settings and the note to show, if any."""
    if not (given.get("model") and not given.get("method") and not given.get("draft")
            and needs_draft(settings.method) and not effective_draft(settings)):
        return settings, None
    small = default_draft(SPS.name, settings.model)
    method, drafting = ((SPS.name, f"{small} drafts for it") if small is not None and embedded.installed(small)
                        else (PLD.name, "prompt lookup alone"))
    note = f"no {settings.method} draft for {settings.model}: {drafting} ({method}; --method and --draft choose another)"
    return dataclasses.replace(settings, method=method), note
