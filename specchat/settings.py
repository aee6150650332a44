"""Every user-facing setting, declared once, and how profiles, environment and flags combine.

Each field of `Settings` carries its profile location (section, key), its help text and its
choices. From that one declaration come the TOML profile schema, the command-line options
(`--name`), the environment variables (`SPECCHAT_NAME`) and the man-page coverage test.

Precedence, highest first: command line > environment > profile > the defaults below.

Mid-chat, `/set KEY VALUE` (text) and `/load` (JSON) change the settings in LIVE_KEYS; both go
through `parse_value`, which checks a value against the setting's declared type and choices.
Nothing here imports torch, so the chat's prompt uses it before torch has loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specchat.decode import DEFAULT_LOOKUP_PATHS, deagle, lookup, options  # (the `lookup` setting hides the module)
from specchat.embedded import DEFAULT_MODEL
from specchat.errors import SpecchatError, UsageError
from specchat.methods import CHAT_METHODS, HEAD_FORMATS, PLAIN

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_PROFILE = "default"
ENV_PREFIX = "SPECCHAT_"
# Below this a temperature divides logits into infinities; vLLM treats such values as greedy
# (its _SAMPLING_EPS is 1e-5), we refuse them rather than guess.
MIN_TEMPERATURE = 1e-5
MAX_TREE_TOKENS = 1024  # a verified tree past this costs more than it can return on any device
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def _within(low=None, high=None):
    """A check that a number lies in [low, high] (either end open when None) and is finite."""
    def check(value) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if low is not None and value < low:
            return f"must be >= {low}, got {value!r}"
        if high is not None and value > high:
            return f"must be <= {high}, got {value!r}"
        return None

    return check


def _temperature(value: float) -> str | None:
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if value < 0:
        return f"must be >= 0, got {value}"
    if 0 < value < MIN_TEMPERATURE:
        return f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value:g}"
    return None


def _probability_mass(value: float) -> str | None:
    return None if math.isfinite(value) and 0 < value <= 1 else f"must be in (0, 1], got {value}"


def _setting(default, section: str, key: str, help: str, choices: tuple[str, ...] | None = None, check=None):
    """A setting's declaration: profile location, help, choices, and `check(value)` -> what is wrong, or None."""
    return field(default=default, metadata={"section": section, "key": key, "help": help, "choices": choices,
                                            "check": check})


@dataclass
class Settings:
    """The resolved settings of one command."""

    # [model]
    model: str = _setting(DEFAULT_MODEL, "model", "path",
                          "Target model: an embedded model name, a .gguf file, a Hugging Face folder or a hub id.")
    gguf_file: str | None = _setting(None, "model", "gguf_file", "GGUF file inside the --model folder or hub repo.")
    dtype: str = _setting(options.AUTO, "model", "dtype",
                          "Weights and compute dtype (auto: bf16 on a CPU with bf16 support or on CUDA, else float32).",
                          (options.AUTO, *options.DTYPES))
    device: str = _setting(options.AUTO, "model", "device", "Device: auto, cpu, cuda or cuda:N.")
    quantize: str = _setting(options.AUTO, "model", "quantize",
                             "Target weights: int5/int4 (specchat's CPU kernel: verifying a draft tree costs about one "
                             "token), 8bit/4bit (bitsandbytes), none (the dtype's own). auto: int5 on an x86 CPU with "
                             "AVX2 and a C++ compiler (bf16 or automatic float32 activations), else none.",
                             options.QUANTIZE)
    compile: str = _setting(options.AUTO, "model", "compile",
                            "torch.compile the target's forward (Llama, Qwen2, Qwen3, Mistral), compiling once per "
                            "shape at start-up (with CUDA graphs: the captured steps' forward, as each step first runs); "
                            "auto: on CUDA (with CUDA graphs, inside the captured steps), not on a CPU (where it measured "
                            "slower).",
                            options.COMPILE)
    cuda_graphs: str = _setting(options.AUTO, "model", "cuda_graphs",
                                "Decode with fixed-shape steps captured as CUDA graphs (Llama, Qwen2, Qwen3, Mistral): "
                                "the KV cache allocated once, trees padded to a few sizes, drafting and acceptance on "
                                "the GPU, one host read per step. auto: on CUDA; on a CPU, on runs the same steps "
                                "eagerly (for testing).",
                                options.CUDA_GRAPHS)
    chat_template: str | None = _setting(None, "model", "chat_template",
                                         "Chat template for a tokenizer that has none: a built-in name (vicuna) "
                                         "or a Jinja file.")
    trust_remote_code: bool = _setting(False, "model", "trust_remote_code",
                                       "Allow model code from the model's repository to run (off unless asked).")
    # [draft]
    draft: str | None = _setting(None, "draft", "path",
                                 "Draft head folder or hub id (EAGLE, EAGLE-3, Jakiro), or a small draft model for sps.")
    draft_kind: str | None = _setting(None, "draft", "kind",
                                      "Expected draft format; loading fails if the head is another (default: detect).",
                                      HEAD_FORMATS)
    # [method]
    method: str = _setting(PLAIN, "method", "name", "Decoding method.", CHAT_METHODS)
    total_tokens: int | None = _setting(None, "method", "total_tokens",
                                        "Tokens verified per cycle, root included (EAGLE-2 paper: 60; CPU default: measured for the machine).",
                                        check=_within(2, MAX_TREE_TOKENS))
    depth: int | None = _setting(None, "method", "depth",
                                 "Most draft tokens on one tree path (EAGLE-2 paper: 6, EAGLE-3: 8; CPU default: 6).",
                                 check=_within(1, MAX_TREE_TOKENS))
    tree_top_k: int | None = _setting(None, "method", "top_k",
                                      "Children per expanded node in the dynamic tree (papers: 10; CPU default: 3).",
                                      check=_within(1, MAX_TREE_TOKENS))
    static_tree: str | None = _setting(None, "method", "static_tree",
                                       "Static tree for eagle (default: mc_sim_7b_63, its most accepted nodes within "
                                       "--total-tokens) or, if given, for jakiro: a name or a JSON list of rank paths "
                                       "(other methods refuse it).")
    draft_tokens: int | None = _setting(None, "method", "draft_tokens",
                                        f"Tokens per drafted chain for sps (default {options.DRAFT_MODEL_TOKENS}; on a CPU the "
                                        f"longest, each chain as long as pays: default {options.DRAFT_MODEL_LONGEST}) and pld (default "
                                        f"{lookup.DEFAULT_LOOKUP_TOKENS}).",
                                        check=_within(1, MAX_TREE_TOKENS))
    pld_max_ngram: int = _setting(lookup.DEFAULT_MAX_NGRAM, "method", "pld_max_ngram", "pld: longest n-gram looked up.",
                                  check=_within(1, 64))
    pld_min_ngram: int = _setting(lookup.DEFAULT_MIN_NGRAM, "method", "pld_min_ngram", "pld: shortest n-gram looked up.",
                                  check=_within(1, 64))
    deagle_tau_s: float = _setting(deagle.TAU_S, "method", "deagle_tau_s", "deagle: survival-mass threshold tau_S.",
                                   check=_within(0.0, 1.0))
    deagle_tau_rho: float = _setting(deagle.TAU_RHO, "method", "deagle_tau_rho",
                                     "deagle: momentum-decay threshold tau_rho.", check=_within(0.0, 1.0))
    deagle_min_depth: int = _setting(deagle.MIN_DEPTH, "method", "deagle_min_depth",
                                     "deagle: the earliest depth drafting may stop.", check=_within(1, MAX_TREE_TOKENS))
    deagle_mass_nodes: str = _setting(deagle.MASS_NODES[0], "method", "deagle_mass_nodes",
                                      "deagle: S_d sums the beam nodes of depth d or all its candidates.",
                                      deagle.MASS_NODES)
    deagle_expected_over: str = _setting(deagle.EXPECTED_OVER[0], "method", "deagle_expected_over",
                                         "deagle: E_d sums the nodes that would be verified, or the beam nodes.",
                                         deagle.EXPECTED_OVER)
    deagle_count_bonus: bool = _setting(deagle.DeagleParams.expected_plus_bonus, "method", "deagle_count_bonus",
                                        "deagle: E_d includes the bonus token.")
    deagle_consecutive: bool = _setting(deagle.DeagleParams.consecutive, "method", "deagle_consecutive",
                                        "deagle: the two momentum decays must be at consecutive depths.")
    lookup: bool = _setting(False, "method", "lookup",
                            "Head methods and sps also draft from text already seen (the conversation, earlier turns "
                            "and answers of the chat): lookup continuations join the head's tree (sps: its chain, "
                            "greedy) and compete for the verify budget (hybrid drafting).")
    lookup_paths: int = _setting(DEFAULT_LOOKUP_PATHS, "method", "lookup_paths",
                                 "With --lookup on a CPU: the paths of the lookup continuation tree a cycle weighs "
                                 "(the strongest matches' continuations, each path with its share of them, as in "
                                 "SuffixDecoding); 1: the strongest continuation alone.", check=_within(1, 16))
    answer_index: str = _setting(options.AUTO, "method", "answer_index",
                                 "Lookup (pld, --lookup) also drafts from this user's earlier answers on this "
                                 "machine, kept in the cache folder (one store per tokenizer, the oldest going "
                                 "first past 100,000 tokens), never from an answer to the prompt being answered. "
                                 "auto: on for chat, off for run and bench; on: run keeps its answers too, bench "
                                 "only reads them.", options.ANSWER_INDEX)
    plain_when_faster: bool = _setting(False, "method", "plain_when_faster",
                                       "Head methods and sps choose each cycle's draft source by what it has earned "
                                       "in the chat: plain steps, lookup continuations alone (with --lookup) or the "
                                       "head's tree (the draft model's chain), whichever has been measured fastest, "
                                       "trying the others again every few steps (CPUs).")
    staged: bool = _setting(True, "method", "staged",
                            "sps on a CPU: where the draft model has a head of its own (the embedded 0.5B drafting "
                            "for the 1.5B), it drafts its chains by speculating itself, its head and lookup "
                            "drafting and its forward verifying (staged speculative decoding): its greedy "
                            "continuation for fewer of its forwards.")
    jakiro_reference_attach: bool = _setting(False, "method", "jakiro_reference_attach",
                                             "jakiro: attach the parallel last level by row, as the reference code does "
                                             "(default: to each node's own parent).")
    # [generation]
    temperature: float = _setting(0.0, "generation", "temperature", "Sampling temperature; 0 is greedy.",
                                  check=_temperature)
    top_p: float = _setting(1.0, "generation", "top_p", "Nucleus sampling: keep the smallest set of tokens with this much mass.",
                            check=_probability_mass)
    top_k: int = _setting(0, "generation", "top_k", "Sample only among the k most likely tokens (0: no limit).",
                          check=_within(0))
    max_new_tokens: int = _setting(options.MAX_NEW_TOKENS, "generation", "max_new_tokens", "Most tokens per reply.", check=_within(1))
    seed: int | None = _setting(None, "generation", "seed",
                                "Seed the random stream once per run (successive prompts continue it).",
                                check=_within(0, MAX_SEED))
    system: str | None = _setting(None, "generation", "system", "System prompt.")
    # [chat]
    show_accept: bool = _setting(False, "chat", "show_accept",
                                 "Colour the answer: tokens the draft proposed and the target accepted in one colour, "
                                 "tokens the target produced itself in another (only on a terminal).")
    compare: bool = _setting(False, "chat", "compare",
                             "Also decode every answer plainly and report the exact speedup and whether the answers "
                             "are identical (doubles the work).")


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_BY_LOCATION = {(f.metadata["section"], f.metadata["key"]): f for f in FIELDS.values()}
SECTIONS = sorted({f.metadata["section"] for f in FIELDS.values()})
_TYPES = {"str": str, "str | None": str, "int": int, "int | None": int, "float": float, "bool": bool}


def field_type(name: str) -> type:
    return _TYPES[FIELDS[name].type]


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


class SettingsError(UsageError, ValueError):
    """A setting's value is out of range or does not fit another's; the message names the setting."""


class ProfileError(SettingsError):
    """A profile cannot be found or has a bad key or value; the message names file and key."""


def check_value(name: str, value) -> str | None:
    """What is wrong with `value` for the setting `name` (its type is already right), or None."""
    check = FIELDS[name].metadata["check"]
    return None if value is None or check is None else check(value)


def check_together(settings: Settings) -> None:
    """The checks that involve two settings."""
    if settings.pld_min_ngram > settings.pld_max_ngram:
        raise SettingsError(f"pld_min_ngram ({settings.pld_min_ngram}) is above pld_max_ngram ({settings.pld_max_ngram})")


def user_profile_dir() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "specchat" / "profiles"


def shipped_profiles() -> dict[str, object]:
    return {p.name[:-5]: p for p in resources.files("specchat.profiles").iterdir() if p.name.endswith(".toml")}


def user_profiles() -> dict[str, Path]:
    folder = user_profile_dir()
    return {p.stem: p for p in sorted(folder.glob("*.toml"))} if folder.is_dir() else {}


def find_profile(name: str):
    """A profile by path, else by name among the user's and then the shipped profiles."""
    path = Path(name).expanduser()
    if name.endswith(".toml") or os.sep in name:
        if path.is_dir():
            raise ProfileError(f"profile {name} is a folder, not a .toml file")
        if not path.is_file():
            raise ProfileError(f"profile file {name} does not exist")
        return path
    for found in (user_profiles(), shipped_profiles()):
        if name in found:
            return found[name]
    known = sorted(set(user_profiles()) | set(shipped_profiles()))
    raise ProfileError(f"no profile named {name!r} (known: {', '.join(known)}; or give a path to a .toml file)")


def read_profile(source) -> tuple[dict, dict]:
    """Parse and check a profile. Returns (values by setting name, other top-level keys)."""
    label = str(source)
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ProfileError(f"{label}: not valid TOML ({error})") from error
    except UnicodeDecodeError as error:
        raise ProfileError(f"{label}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    except OSError as error:
        raise ProfileError(f"{label}: cannot read ({error.strerror})") from error
    values, meta = {}, {}
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in ("description",):
                meta[section] = table
                continue
            raise ProfileError(f"{label}: unknown top-level key {section!r} (expected description or a section: {', '.join(SECTIONS)})")
        if section not in SECTIONS:
            raise ProfileError(f"{label}: unknown section [{section}] (expected one of {', '.join(SECTIONS)})")
        for key, value in table.items():
            setting = _BY_LOCATION.get((section, key))
            if setting is None:
                keys = sorted(k for s, k in _BY_LOCATION if s == section)
                raise ProfileError(f"{label}: unknown key {section}.{key} (known in [{section}]: {', '.join(keys)})")
            values[setting.name] = _check_value(label, f"{section}.{key}", setting, value)
    return values, meta


def _check_value(label: str, where: str, setting: dataclasses.Field, value):
    expected = _TYPES[setting.type]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ProfileError(f"{label}: {where} must be {expected.__name__}, got {type(value).__name__} {value!r}")
    choices = setting.metadata["choices"]
    if choices and value not in choices:
        raise ProfileError(f"{label}: {where} must be one of {', '.join(choices)}, got {value!r}")
    problem = check_value(setting.name, value)
    if problem:
        raise ProfileError(f"{label}: {where} {problem}")
    return value


def resolve(overrides: dict, profile: str | None = None) -> tuple[Settings, str]:
    """Settings from defaults, then the profile, then `overrides` (flags and environment, None = unset).

    Returns the settings and the name of the profile used.
    """
    name = profile or DEFAULT_PROFILE
    values, _ = read_profile(find_profile(name))
    values.update({key: value for key, value in overrides.items() if value is not None and key in FIELDS})
    settings = Settings(**values)
    check_together(settings)
    return settings, name


# ---------------------------------------------------------------------------------------------
# Changing settings mid-chat

# What `/set KEY VALUE` may change; every other setting needs a restart (or `/method`, `/system`).
LIVE_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "total_tokens", "depth", "tree_top_k",
             "draft_tokens", "lookup", "show_accept", "compare")
METHOD_SECTIONS = ("method", "draft")  # the settings a proposer is built from
TRUE_WORDS, FALSE_WORDS = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
UNSET_WORDS = ("none", "default")


class LiveChatError(SpecchatError, ValueError):
    """A change that cannot be made; the message is one line for the user, and nothing changed."""


def parse_value(key: str, value):
    """A setting's value from text (`/set`) or JSON (`/load`), checked against its type and choices."""
    choices = FIELDS[key].metadata["choices"]
    value = _typed_value(key, value)
    if choices and value is not None and value not in choices:
        raise LiveChatError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    problem = check_value(key, value)
    if problem:
        raise LiveChatError(f"{key} {problem}")
    return value


def _typed_value(key: str, value):
    kind = field_type(key)
    optional = FIELDS[key].type.endswith("| None")
    if isinstance(value, str):
        word = value.strip().lower()
        if optional and word in UNSET_WORDS:
            return None
        if kind is bool and word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        if kind in (int, float):
            try:
                return kind(word)
            except ValueError:
                pass
        if kind is str:
            return value
    elif value is None and optional:
        return None
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {bool: "on or off", int: "a whole number", float: "a number", str: "text"}[kind]
    unset = f" or {UNSET_WORDS[0]}" if optional else ""
    raise LiveChatError(f"{key} takes {expected}{unset}, got {value!r}")


def method_key(settings: Settings) -> tuple:
    """Everything a proposer is built from: equal keys give interchangeable proposers."""
    return tuple(getattr(settings, name) for name, f in FIELDS.items() if f.metadata["section"] in METHOD_SECTIONS)


def with_method_of(settings: Settings, other: Settings) -> Settings:
    """`settings` with the method and draft settings of `other`."""
    return dataclasses.replace(settings, **{name: getattr(other, name) for name, f in FIELDS.items()
                                            if f.metadata["section"] in METHOD_SECTIONS})


def show_value(value) -> str:
    """A setting's value as `/set` takes it back: on/off, none, or the value."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)
