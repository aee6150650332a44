"""The cache's converted models: a GGUF file (or an embedded model's chunks) dequantized once into a
Hugging Face folder in the chosen dtype, stamped when complete (STAMP: the source's sha256, the
files' sizes), checked for damage at each start and converted again if damaged, under a lock so
that concurrent first starts wait for one conversion. Where only a packed model is kept (a chat
on a CPU), a GGUF is converted in memory instead (`InMemory`) and its folder never written.
`specchat.sources` finds models and joins these folders to loading.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specchat import embedded
from specchat.decode.runtime.machine import cache_dir, lock_beside, write_safetensors
from specchat.decode.runtime.target import dtype_name
from specchat.errors import ModelLoadError, first_line
from specchat.inputs import file_sha256, write_atomically

log = logging.getLogger(__name__)

WORK = ".tmp-"  # a conversion's work folder beside its converted folder: `<folder>.tmp-<random>`
STAMP = "specchat-source.json"  # written last into a converted folder: its presence means "complete"


def gguf_sha256(path: Path) -> str:
    """sha256 of a GGUF file (checked to be one), remembered by (path, size, mtime) so big files are hashed once."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from error
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    index_path = cache_dir() / "sha256-index.json"
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        index[key] = file_sha256(path)
        index_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(index_path, json.dumps(index, indent=1))
    return index[key]


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
    for stale in folder.parent.glob(f"{folder.name}{WORK}*"):  # left by a process killed mid-conversion:
        shutil.rmtree(stale, ignore_errors=True)  # a living one would hold the lock we hold
    if not folder.exists():
        return None
    problem = damage(folder)
    if problem is None:
        return _read_stamp(folder)
    log.warning(f"the converted model in {folder} is damaged ({problem}): converting it again")
    shutil.rmtree(folder, ignore_errors=True)
    return None


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's metadata once for the tokenizer, once for the config and
    once for the weights (`load_gguf_checkpoint` builds a `gguf.GGUFReader` each time, importing the
    name when called); with a 150k-token vocabulary one parse takes ~6 s on a laptop core. While
    converting, one reader per file serves all three (transformers only reads from it), and the
    metadata the tokenizer and the config take is turned into Python values once.

    The shared reader reads its file through a plain array over gguf-py's map: gguf-py's `np.memmap` slices
    through Python-level methods, and reading the 455k metadata parts of Qwen2.5's vocabulary that way took 17 s
    on a Zen 3 core (of a first start's 90 s). transformers' own reader, which reads the vocabulary once more
    for the tokenizer and the file's keys for the config, maps it through a plain array too (its strings 0.61 ->
    0.25 s on a Xeon core). The shared reader makes an array's parts (a vocabulary's tokens, merges, types) in
    one loop, and transformers decodes each string at once (the two: 3.3 -> 0.8 s of the 0.5B's metadata on a
    Xeon core, the same fields, parts and values). And gguf-py's map of tensor names, which transformers builds
    again for every module of the model (~2.3 s of a 0.5B's conversion on a Xeon core), is built once per
    architecture and depth. transformers copies each dequantized tensor before wrapping it (`np.copy`, which the
    read-only views of the file need): a fresh array, which nothing else holds, is wrapped as it is (2.3 s of a
    0.5B's conversion on a Xeon core, of 20). The tensors are dequantized by `gguf_blocks` (gguf-py's floats,
    7.3 -> 2.1 s of a 0.5B's conversion on a Xeon core). Its bar is not drawn."""
    # the GGUF libraries load where a file is converted: a start from a converted folder needs none of them
    import gguf
    import numpy
    from transformers import modeling_gguf_pytorch_utils as gguf_loading  # (loaded already: converting)
    from transformers.integrations.gguf import reader as transformers_reader

    from specchat import gguf_blocks

    original, readers = gguf.GGUFReader, {}
    parse, parsed = gguf_loading.load_gguf_checkpoint, {}
    parse_value = gguf_loading._gguf_parse_value
    into = None  # the dtype the weights being loaded are dequantized into, where they can be
    name_map = gguf.get_tensor_name_map  # (transformers imports it from gguf at each call: patched there)

    class PlainReader(original):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(numpy.ndarray) if isinstance(value, numpy.memmap) else value

        def _get_field_parts(self, orig_offs, raw_type):
            """gguf-py's parts of a field, an array of strings or numbers (a vocabulary's tokens, merges,
            token types) made in one loop: the same views of the file, where gguf-py's call per item
            (five for a string) took ~2 s of the 0.5B's conversion on a Xeon core."""
            array = gguf.GGUFValueType.ARRAY
            if raw_type != array or self.byte_order == "S":  # (a file of the other byte order: gguf-py's)
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, numpy.uint32), self._get(orig_offs + 4, numpy.uint64)
            itype, count, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            types = [array, itype] if count else [array]
            if itype == gguf.GGUFValueType.STRING:  # each: its length (uint64), its bytes
                parts, view = [raw_itype, alen], memoryview(self.data)
                for _ in range(count):
                    (size,) = struct.unpack_from("<Q", view, offs)
                    parts += (self.data[offs:offs + 8].view(numpy.uint64), self.data[offs + 8:offs + 8 + size])
                    offs += 8 + size
                return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types
            if (scalar := self.gguf_scalar_to_np.get(itype)) is not None:
                values = self._get(offs, scalar, count)
                parts = [raw_itype, alen, *values.reshape(count, 1)]
                return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
            return super()._get_field_parts(orig_offs, raw_type)  # (arrays of arrays)

    def parsed_value(value, data_type):
        """transformers' `_gguf_parse_value`, a string's bytes decoded at once (it lists them as numpy
        integers first: ~1.5 s of a 150k-token vocabulary on a Xeon core); the same strings."""
        last = data_type[-1] if isinstance(data_type, list) else data_type
        if last == gguf.GGUFValueType.STRING and isinstance(value, numpy.ndarray) and value.dtype == numpy.uint8:
            return value.tobytes().decode()
        return parse_value(value, data_type)

    def shared_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    def metadata_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:  # the weights (read once anyway)
            architecture = shared_reader(path).fields["general.architecture"]
            plain = gguf_loading.TENSOR_PROCESSORS.get(architecture.contents(), gguf_loading.TensorProcessor)
            # Where transformers passes each tensor on as it is and rounds it to a dtype at once (no
            # processor of its own for the architecture), the tensor is dequantized into that dtype.
            nonlocal into
            into = kwargs.get("torch_dtype") if plain is gguf_loading.TensorProcessor else None
            try:
                return parse(path, return_tensors, **kwargs)
            finally:
                into = None
        if os.fspath(path) not in parsed:
            parsed[os.fspath(path)] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[os.fspath(path)])  # (its callers may change what they get)

    class FreshArraysUncopied:  # numpy, as transformers' GGUF loading calls it
        def __getattr__(self, name):
            return getattr(numpy, name)

        @staticmethod
        def copy(array, *args, **kwargs):
            if isinstance(array, torch.Tensor):
                return array  # dequantized into its dtype (`into`)
            if isinstance(array, numpy.ndarray) and array.flags.writeable and not args and not kwargs:
                return array  # dequantized into a fresh array (the file's map is read-only)
            return numpy.copy(array, *args, **kwargs)

    class TensorsAsTheyAre:  # torch, as transformers' GGUF loading calls it
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def from_numpy(array):
            return array if isinstance(array, torch.Tensor) else torch.from_numpy(array)

    mapped = transformers_reader._mapped
    with _replaced((gguf, "GGUFReader", shared_reader), (gguf_loading, "load_gguf_checkpoint", metadata_once),
                   (transformers_reader, "_mapped", lambda path: mapped(path).view(numpy.ndarray)),
                   (gguf_loading, "_gguf_parse_value", parsed_value),
                   (gguf, "get_tensor_name_map", functools.cache(name_map)),  # (transformers only reads the map)
                   (gguf, "dequantize", lambda data, qtype: gguf_blocks.dequantize(data, qtype, into)),
                   (gguf_loading, "np", FreshArraysUncopied()), (gguf_loading, "torch", TensorsAsTheyAre()),
                   # transformers' GGUF reader draws a bar of its own (plain tqdm, not its logging's): our line
                   # says it. Turned off where it is drawn, not by taking stderr from the whole process
                   # (another thread's line would go with it).
                   (gguf_loading, "tqdm", functools.partial(gguf_loading.tqdm, disable=True))):
        yield


@contextlib.contextmanager
def _replaced(*replacements: tuple[object, str, object]):
    """Each `(owner, name, value)`: `owner.name` is `value` inside the block, and what it was again after
    it (how a conversion reaches into transformers' and gguf-py's GGUF loading, which take no hooks)."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)


@contextlib.contextmanager
def _written_tensor_by_tensor():
    """transformers writes the converted model with safetensors' writer, which builds the whole file in
    memory first: `write_safetensors` writes each tensor as it lies (a 1 GB model 3.1 -> 0.3 s)."""
    from transformers import modeling_utils  # (loaded already: converting)

    def tensor_by_tensor(tensors, filename, metadata=None):
        write_safetensors(filename, tensors, metadata)

    with _replaced((modeling_utils, "safe_save_file", tensor_by_tensor)):
        yield


def gguf_model(gguf_path: Path, dtype: torch.dtype) -> tuple:
    """A GGUF file dequantized into transformers' model in `dtype`, and its tokenizer, in memory."""
    # transformers loads here, where a GGUF file is converted (once per file): later starts need none of it
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from specchat.decode.runtime.loading import quiet_transformers

    quiet_transformers()
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
    except (ValueError, OSError, KeyError, RuntimeError, IndexError, TypeError, EOFError, struct.error) as error:
        # what the GGUF parser raises on a damaged or truncated file
        raise ModelLoadError(f"cannot load GGUF file {gguf_path}: {first_line(error)}") from error
    # The weights are plain tensors now; a saved quantization config would make loaders re-quantize.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def save_folder(model, tokenizer, folder: Path) -> None:
    """transformers' `model` and `tokenizer` saved in `folder` as a Hugging Face model folder."""
    with _written_tensor_by_tensor():
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_hf_folder(gguf_path: Path, dtype: torch.dtype, folder: Path) -> None:
    """Dequantize a GGUF file into `dtype` and save it in `folder` as a Hugging Face model folder."""
    save_folder(*gguf_model(gguf_path, dtype), folder)


def _write_whole(destination: Path, source: dict, write: Callable[[Path], None]) -> Path:
    """`write(folder)` into a folder that appears at `destination` whole (atomically: its files and
    their sizes recorded in the stamp written last)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=destination.parent, prefix=destination.name + WORK))
    try:
        try:
            write(work)
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


def convert_gguf(gguf_path: Path, dtype: torch.dtype, destination: Path, source: dict,
                 in_memory: bool = False) -> Path | InMemory:
    """Dequantize a GGUF file into a Hugging Face folder at `destination`, which appears whole
    (`in_memory`: into memory instead, the folder to be written only if asked: `InMemory.keep`)."""
    log.info(f"converting {gguf_path.name} to {dtype_name(dtype)} once (about a minute)...")
    if in_memory:
        return InMemory(*gguf_model(gguf_path, dtype), destination, source)
    return _write_whole(destination, source, lambda work: write_hf_folder(gguf_path, dtype, work))


@dataclass
class InMemory:
    """A GGUF source converted in memory, where nothing needs its converted folder (a CPU start that
    keeps a packed model instead, `specchat.sources`): the folder's gigabytes are not written (the
    bf16 0.5B's 1.3 GB, the 1.5B's 3.6 GB; writing them took ~3 s a GB on a 2-vCPU Xeon). `keep`
    writes them after all, where the start turns out to need them."""

    model: object  # transformers' model, in the conversion's dtype
    tokenizer: object
    folder: Path  # where the source's converted folder is kept
    source: dict  # what its stamp says

    def loaded(self, dtype: torch.dtype) -> tuple:
        """transformers' model in `dtype` and its tokenizer, as loading the converted folder gives them:
        the weights as they are in memory (shared, not copied), the config and the tokenizer through
        their files, and the buffers that are not weights made anew. A GGUF's load differs from a
        folder's in both: its rotary frequencies are left in bf16 (a folder's model computes them in
        float32), and Qwen2's tokenizer made from a GGUF's metadata has no NFC normalizer (one loaded
        from its files gets it)."""
        from transformers import AutoConfig, AutoTokenizer  # (loaded already: converted)

        with tempfile.TemporaryDirectory() as files:
            self.model.config.save_pretrained(files)
            self.tokenizer.save_pretrained(files)
            config, tokenizer = AutoConfig.from_pretrained(files), AutoTokenizer.from_pretrained(files)
        model = type(self.model).from_pretrained(None, config=config, state_dict=self.model.state_dict(), dtype=dtype)
        return model, tokenizer

    def keep(self) -> Path:
        """The converted folder, written from the model in memory unless a whole one is there."""
        with lock_beside(self.folder):
            if _usable(self.folder) is None:
                _write_whole(self.folder, self.source, lambda work: save_folder(self.model, self.tokenizer, work))
        return self.folder


def gguf_folder(gguf_path: Path, dtype: torch.dtype, in_memory: bool = False) -> Path | InMemory:
    """The converted folder for a user's GGUF file, converting it the first time (`in_memory`: into
    memory, where there is no whole folder yet)."""
    sha = gguf_sha256(gguf_path)
    folder = cache_dir() / "models" / f"gguf-{sha[:16]}-{dtype_name(dtype)}"
    source = {"gguf": str(gguf_path), "sha256": sha, "dtype": dtype_name(dtype)}
    with lock_beside(folder):
        if _usable(folder) is not None:
            return folder
        return convert_gguf(gguf_path, dtype, folder, source, in_memory)


def embedded_folder(model: embedded.EmbeddedModel, dtype: torch.dtype, in_memory: bool = False) -> Path | InMemory:
    """The converted folder of an embedded model, assembling and converting it the first time
    (`in_memory`: into memory, where there is no whole folder yet)."""
    try:
        chunks = embedded.chunk_files(model)
    except embedded.EmbeddedModelError as error:
        raise ModelLoadError(str(error)) from error
    folder = cache_dir() / "models" / f"{model.name}-{dtype_name(dtype)}"
    with lock_beside(folder):
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
            write_atomically(folder / STAMP, json.dumps({**stamp, "chunks": installed}, indent=1))
            return folder
        gguf_dir = cache_dir() / "gguf"
        gguf_dir.mkdir(parents=True, exist_ok=True)
        gguf_path = gguf_dir / f"{model.name}.converting.gguf"  # (its name is the folder lock's)
        assemble(model, gguf_path)
        source = {"embedded": model.name, "sha256": model.sha256, "dtype": dtype_name(dtype), "chunks": installed}
        try:
            return convert_gguf(gguf_path, dtype, folder, source, in_memory)
        finally:
            gguf_path.unlink(missing_ok=True)  # the converted folder (or model) replaces it


def assemble(model: embedded.EmbeddedModel, path: Path) -> None:
    """An embedded model's chunks joined into one GGUF file at `path` (checked against its sha256)."""
    try:
        embedded.assemble(model, path)
    except embedded.EmbeddedModelError as error:
        raise ModelLoadError(str(error)) from error
