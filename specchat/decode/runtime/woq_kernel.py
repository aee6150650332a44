"""The weight-only quantized linear kernel (`kernels/woq_linear.cpp`): compiled once per machine and
cached, and the instruction-set path it runs (`specchat.decode.runtime.quantized` has the format and layers).

It has a path per instruction set, named as `SPECCHAT_CPU_ISA` takes them: `avx512`
(AVX512-VNNI: vpdpbusd on 512-bit registers; Intel Xeons since Cascade Lake, Ice/Tiger/Rocket Lake
cores, AMD Zen 4+), `avx-vnni` (AVX-VNNI: vpdpbusd on 256-bit registers; Intel Core 12th gen and later,
which have no AVX-512) and `avx2` (vpmaddubsw + vpmaddwd; Intel Haswell and later, AMD Zen 1-3), plus
`avx-vnni-evex` (avx-vnni's code, for testing it on AVX-512 CPUs, which lack AVX-VNNI). Without the
variable the best one the CPU has runs (`kernel_isa`); with it, that one runs or the kernel is
unavailable, naming the CPU flags it lacks (tests force each path this way). All paths compute
the same integer sums and the same float operations, so their outputs are bit-identical. Every
path takes bf16 or float32 activations and returns the same dtype (`kernel_info` says which dtype
a model should use here).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch
from filelock import FileLock

from specchat.decode.runtime import machine
from specchat.errors import first_line

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
# What is compiled: two translation units, in parallel. extension.cpp is the operators and classes
# torch sees, the only file that includes torch's headers (it says why); arithmetic.cpp is the
# arithmetic they call: the products, the layers' work around them (one call per forward) and the
# weights' quantization into the products' layout (SOURCES, which it includes).
UNITS = (KERNELS / "extension.cpp", KERNELS / "arithmetic.cpp")
SOURCES = (KERNELS / "woq_linear.cpp", KERNELS / "layers.cpp", KERNELS / "quantize.cpp")
HEADERS = (KERNELS / "woq_linear.h", KERNELS / "layers.h", KERNELS / "vectors.h")
FILES = (*UNITS, *SOURCES, *HEADERS)  # everything the build reads (what `source_hash` covers)
EXTENSION = "specchat_woq_isa"  # torch's build folder; the single-ISA kernel was "specchat_woq"
BUILT = "kernel.json"  # in the cache folder: the library the last build made, and what it was made from
ISA_VARIABLE = "SPECCHAT_CPU_ISA"
# The kernel's paths, best first, and the CPU flags (as /proc/cpuinfo spells them) each needs.
ISAS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx-vnni": ("avx_vnni", "avx2", "fma", "f16c"),
    # avx-vnni's code with AVX512-VNNI's encoding of the same instruction: how a CPU with AVX-512
    # (which has no AVX-VNNI) tests that path; never better than avx512 where it runs
    "avx-vnni-evex": ("avx512f", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}
# AVX2 for the whole file (the least any path needs); the AVX-512 and AVX-VNNI paths are compiled
# for their instructions by target pragmas in the source, so no AVX-512 instruction is reached on
# a CPU without it. No FMA contraction: every path runs exactly the float operations written.
COMPILE_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]


class KernelUnavailable(RuntimeError):
    """The quantized kernel cannot run here (no AVX2, a forced path the CPU lacks, or no compiler)."""


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """The path the kernel runs here and the activations it is fed.

    isa: the path, one of `ISAS` ("avx512", "avx-vnni", "avx2"; `kernel_isa`).
    dtypes: the activation dtypes every path takes and returns (x is quantized to int8 per group
        of 32 either way; its dtype only changes the conversions at the edges).
    activation_dtype: the dtype a model using the kernel should run in here: bfloat16 where the
        CPU computes bf16 natively (AVX512-BF16 or AMX, `machine.cpu_has_bf16`: the rest of the
        model, attention and norms, runs fast in it), float32 elsewhere (torch's bf16 arithmetic is
        emulated there; the kernel's cost is the same for either).
    """

    isa: str
    dtypes: tuple[torch.dtype, ...]
    activation_dtype: torch.dtype


def _missing(isa: str, flags: frozenset[str]) -> list[str]:
    return [feature for feature in ISAS[isa] if feature not in flags]


def _choose_isa(requested: str | None, flags: frozenset[str], compiled: tuple[str, ...]) -> str:
    """The path to run: `requested` if the CPU (and the build) has it, else the best one it has."""
    if requested:
        if requested not in ISAS:
            raise KernelUnavailable(f"{ISA_VARIABLE}={requested} is not one of {', '.join(ISAS)}")
        missing = _missing(requested, flags)
        if missing:
            raise KernelUnavailable(f"{ISA_VARIABLE}={requested}: this CPU lacks {', '.join(missing)}")
        if requested not in compiled:
            raise KernelUnavailable(f"{ISA_VARIABLE}={requested}: the compiler has no {requested} intrinsics "
                                    f"(GCC 11 or clang 12 has them)")
        return requested
    for isa in ISAS:
        if isa in compiled and not _missing(isa, flags):
            return isa
    raise KernelUnavailable(f"this CPU lacks {', '.join(_missing('avx2', flags))}")


def forced_isa() -> str | None:
    """The path $SPECCHAT_CPU_ISA forces, or None where the best one the CPU has runs."""
    return os.environ.get(ISA_VARIABLE) or None


def missing_cpu_features() -> list[str]:
    """The CPU flags the chosen path needs that this CPU lacks: the forced one's, or where none is
    forced the least demanding path's (empty if any path runs)."""
    flags, requested = machine.cpu_flags(), forced_isa()
    if requested in ISAS:
        return _missing(requested, flags)
    return [] if any(not _missing(isa, flags) for isa in ISAS) else _missing("avx2", flags)


_BUILD = threading.Lock()  # one build at a time: `start_build`'s thread, or whoever asks first


@functools.cache
def kernel():
    """The compiled extension's classes (built on first use into the cache, keyed by the sources'
    hash); its operators are torch.ops.specchat's."""
    with _BUILD:  # (cached outside the lock: every linear layer of every forward asks)
        return _built_kernel()


def loaded() -> bool:
    """Whether the extension is loaded in this process (its operators callable), without building it."""
    return _built_kernel.cache_info().currsize > 0


def start_build() -> bool:
    """Compile (or load) the kernel on another thread: the first time it takes about a minute,
    which then overlaps the model's conversion instead of following it. Whether it compiles (no
    build of these sources, flags, torch and Python noted): the caller then leaves the compiler a core."""
    compiles = _noted_build() is None
    threading.Thread(target=unavailable_reason, daemon=True, name="specchat-kernel-build").start()
    return compiles


@functools.cache
def _built_kernel():
    _choose_isa(forced_isa(), machine.cpu_flags(), tuple(ISAS))  # the CPU's verdict before compiling
    if not _load_built():
        _build()
    # Loading the library defined torch.ops.specchat.woq_linear; torch.compile traces it by its shape.
    torch.library.register_fake("specchat::woq_linear")(_woq_linear_shape)
    return torch.classes.specchat


def _noted_build() -> Path | None:
    """The library the last build made (`BUILT`), if nothing it was made from has changed since."""
    try:
        built = json.loads((machine.cache_dir() / BUILT).read_text())
        library = Path(built["library"])
        if built["from"] != _built_from() or library.stat().st_mtime_ns != built["mtime_ns"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):  # none yet, unreadable, or gone: built (or checked) again
        return None
    return library


def _load_built() -> bool:
    """Load the library the last build made if it is current (`_noted_build`): a start then skips
    torch's build machinery, whose import (with setuptools) costs ~0.1 s of every start, and its
    up-to-date check."""
    library = _noted_build()
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # gone or damaged since: built (or checked) again
        return False
    return True


def _built_from() -> list:
    """What a build depends on: the sources and headers, the flags, torch (its headers) and Python
    (torch keeps a build folder per Python version)."""
    return [source_hash(), COMPILE_FLAGS, torch.__version__, sys.version, os.environ.get("TORCH_EXTENSIONS_DIR")]


def _build() -> None:
    """Compile the kernel (or find torch's build of it up to date) and load it, and note it in `BUILT`."""
    # Imported here, not at the top: torch's build machinery (and setuptools with it) is needed only
    # when the kernel is built or its build checked, not at a start that loads the last build.
    from torch.utils import cpp_extension

    # torch keeps the build in its extensions folder and rebuilds it when the source or flags change.
    build = Path(cpp_extension._get_build_directory(EXTENSION, verbose=False))
    if not any(build.glob("*.so")):
        log.info("compiling the quantized-linear kernel once (about a minute)...")
    try:
        # torch's build lock is a plain file ("lock"): a process that dies holding it (killed, or a chat
        # quit while its model loads) leaves it, and every later load would wait on it forever. Builds
        # take this lock first, which the system releases when its holder dies: under it, one is stale.
        build.mkdir(parents=True, exist_ok=True)
        with FileLock(build / "specchat-build.lock"):
            (build / "lock").unlink(missing_ok=True)
            # Loaded as a library of torch operators and classes (torch.ops.specchat, torch.classes.specchat),
            # not a Python module: its sources then need no pybind11 (kernels/extension.cpp says why).
            # (ninja rebuilds what a changed source or header touches: torch's build asks the compiler for
            # each file's dependencies, and runs the compiles in parallel)
            library = cpp_extension.load(name=EXTENSION, sources=[str(path) for path in UNITS],
                                         extra_include_paths=[str(KERNELS)], extra_cflags=COMPILE_FLAGS,
                                         is_python_module=False, verbose=bool(os.environ.get("SPECCHAT_DEBUG_BUILD")))
    except (RuntimeError, OSError, ImportError) as error:  # no compiler, no headers, a failed build
        raise KernelUnavailable(f"cannot compile the kernel ({first_line(error)}; SPECCHAT_DEBUG_BUILD=1 shows the "
                                f"compiler's output)") from error
    _note_built(library)


def _note_built(library: str | os.PathLike) -> None:
    """Write `BUILT` for `library` (the path torch loaded), so that the next start loads it directly;
    a folder that cannot be written only costs the next start torch's check."""
    try:
        built = {"library": str(library), "mtime_ns": Path(library).stat().st_mtime_ns, "from": _built_from()}
        text = json.dumps(built, indent=1)
        machine.replace_atomically(machine.cache_dir() / BUILT, lambda partial: partial.write_text(text))
    except OSError as error:
        log.debug(f"the kernel's build is not noted ({first_line(error)})")


def _woq_linear_shape(x, low, high, scale, offset, bias, N, bits, isa):
    return x.new_empty((x.shape[0], N))


def traced_isa() -> str:
    """`kernel_isa()`, which a compiled graph takes as a constant (it reads the environment and
    /proc/cpuinfo, which tracing must not), once `prepare_compiling` has marked it so."""
    return kernel_isa()


def prepare_compiling() -> None:
    """Mark `traced_isa` as a constant result for torch.compile: called before a forward that runs
    the kernel is compiled. Not a decorator: torch.compiler's marker imports torch._dynamo (~2.5 s
    of a start on a Zen 3 core), which a process that compiles nothing has no use for. The marker
    marks the function itself (an attribute dynamo reads when it traces a call), so marking it
    late, and more than once, is the same as decorating it."""
    torch.compiler.assume_constant_result(traced_isa)


@functools.cache
def _compiled_isas() -> tuple[str, ...]:
    kernel()
    return tuple(torch.ops.specchat.isas())


@functools.cache
def kernel_isa() -> str:
    """The path the kernel runs: $SPECCHAT_CPU_ISA (avx512, avx-vnni or avx2) if set, else the best
    one this CPU has. Raises KernelUnavailable, naming the missing CPU flags, where that path cannot
    run. Decided at the first kernel call (every call asks); `kernel_isa.cache_clear()` makes the
    next one read the variable and the CPU's flags again (tests switch paths so)."""
    return _choose_isa(forced_isa(), machine.cpu_flags(), _compiled_isas())


def runnable_isas() -> list[str]:
    """Every path this CPU and this build of the kernel run, best first (empty where none does;
    compiles the kernel if need be). Tests run each; $SPECCHAT_CPU_ISA picks one."""
    try:
        compiled = _compiled_isas()
    except KernelUnavailable:
        return []
    return [isa for isa in ISAS if isa in compiled and not _missing(isa, machine.cpu_flags())]


def kernel_info() -> KernelInfo:
    """The chosen path and the activation dtype a model should use with it here (see `KernelInfo`)."""
    native_bf16 = machine.cpu_has_bf16()
    return KernelInfo(kernel_isa(), (torch.bfloat16, torch.float32), torch.bfloat16 if native_bf16 else torch.float32)


def kernel_version() -> str:
    """A short hash of the kernel's sources and the path it runs: what a forward costs changes with
    either."""
    return f"{source_hash()}-{kernel_isa()}"


@functools.cache
def source_hash() -> str:
    """A short hash of the kernel's sources and headers (what a packed model is checked against)."""
    digest = hashlib.sha1()
    for path in FILES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def unavailable_reason() -> str | None:
    """Why the quantized kernel cannot run here, or None if it can (compiling it if need be)."""
    try:
        kernel_isa()
    except KernelUnavailable as error:
        return str(error)
    return None
