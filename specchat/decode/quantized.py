"""Weight-only quantized linear layers for the CPU target (`--quantize int5|int4`).

Weights are stored in 5 or 4 bits with an fp16 scale and offset per group of 32 (each group on
the better of a symmetric and a min-max grid: `quantize`), and multiplied by `kernels/woq_linear.cpp`,
which unpacks each block of weights once per forward and multiplies it with every token in 8-bit
integer products: verifying 8 tokens costs ~1.4x one, at a third of bf16's memory traffic. The
kernel is compiled once per machine (it needs a C++ compiler and an x86 CPU with AVX2, FMA and
F16C) and cached.

It has a path per instruction set, named as `SPECCHAT_CPU_ISA` takes them: `avx512`
(AVX512-VNNI: vpdpbusd on 512-bit registers; Intel Xeons since Cascade Lake, Ice/Tiger/Rocket Lake
cores, AMD Zen 4+), `avx-vnni` (AVX-VNNI: vpdpbusd on 256-bit registers; Intel Core 12th gen and later, which have no
AVX-512) and `avx2` (vpmaddubsw + vpmaddwd; Intel Haswell and later, AMD Zen 1-3), plus
`avx-vnni-evex` (avx-vnni's code, for testing it on AVX-512 CPUs, which lack AVX-VNNI). Without the
variable the best one the CPU has runs (`kernel_isa`); with it, that one runs or the kernel is
unavailable, naming the CPU flags it lacks (tests force each path this way). All paths compute
the same integer sums and the same float operations, so their outputs are bit-identical. Every
path takes bf16 or float32 activations and returns the same dtype (`kernel_info` says which dtype
a model should use here).

Plain decoding and verification both run through these layers, so speculative decoding stays
exact relative to plain decoding of the same quantized model; what quantization changes is the
model itself (how far from bf16: README, docs/cpu-runtime.md).
"""

from __future__ import annotations

import logging
import dataclasses
import functools
import hashlib
import os
import threading
from pathlib import Path

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils import cpp_extension

from specchat.decode import machine
from specchat.decode.options import KERNEL_BITS  # noqa: F401  (the --quantize choices this kernel runs)

log = logging.getLogger(__name__)

LAYOUT = "woq2"  # the packed format below; a cached model in another layout is packed again
GROUP = 32  # weights per scale and offset, along the input dimension
BLOCK = 16  # output rows per kernel block (one AVX-512 register of fp32)
PACKED_PARTS = ("low", "high", "scale", "bias")  # a layer's buffers in that format (`pack`)
SOURCE = Path(__file__).parent / "kernels" / "woq_linear.cpp"
EXTENSION = "specchat_woq_isa"  # torch's build folder; the single-ISA kernel was "specchat_woq"
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
    """The compiled extension (built on first use into the cache, keyed by the source's hash)."""
    with _BUILD:  # (cached outside the lock: every linear layer of every forward asks)
        return _built_kernel()


def start_build() -> None:
    """Compile (or load) the kernel on another thread: the first time it takes about a minute,
    which then overlaps the model's conversion instead of following it."""
    threading.Thread(target=unavailable_reason, daemon=True, name="specchat-kernel-build").start()


@functools.cache
def _built_kernel():
    _choose_isa(forced_isa(), machine.cpu_flags(), tuple(ISAS))  # the CPU's verdict before compiling
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
            module = cpp_extension.load(name=EXTENSION, sources=[str(SOURCE)], extra_cflags=COMPILE_FLAGS,
                                        verbose=bool(os.environ.get("SPECCHAT_DEBUG_BUILD")))
    except (RuntimeError, OSError, ImportError) as error:  # no compiler, no headers, a failed build
        first_line = next(iter(str(error).strip().splitlines()), type(error).__name__)
        raise KernelUnavailable(f"cannot compile {SOURCE.name} ({first_line}; SPECCHAT_DEBUG_BUILD=1 shows the "
                                f"compiler's output)") from error
    # Loading the module defined torch.ops.specchat.woq_linear; torch.compile traces it by its shape.
    torch.library.register_fake("specchat::woq_linear")(_woq_linear_shape)
    return module


def _woq_linear_shape(x, low, high, scale, offset, bias, N, bits, isa):
    return x.new_empty((x.shape[0], N))


@torch.compiler.assume_constant_result
def _traced_isa() -> str:
    """`kernel_isa()`, which a compiled graph takes as a constant (it reads the environment and
    /proc/cpuinfo, which tracing must not)."""
    return kernel_isa()


@functools.cache
def _compiled_isas() -> tuple[str, ...]:
    return tuple(kernel().isas())


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
    """A short hash of the kernel's source and the path it runs: what it costs per forward changes
    with either."""
    return f"{_source_hash()}-{kernel_isa()}"


@functools.cache
def _source_hash() -> str:
    return hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:8]


def unavailable_reason() -> str | None:
    """Why the quantized kernel cannot run here, or None if it can (compiling it if need be)."""
    try:
        kernel_isa()
    except KernelUnavailable as error:
        return str(error)
    return None


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (uint8), scales and offsets [N, K/GROUP] (fp16): w ≈ code * scale + offset.

    Each group gets whichever of two grids reconstructs it better: llama.cpp's symmetric one
    (Q4_0/Q5_0: the largest magnitude maps to code 0, so weights that came from such a GGUF are
    reproduced exactly) or the asymmetric min-max grid (better for skewed groups).
    """
    N, K = weight.shape
    groups = weight.float().reshape(N, K // GROUP, GROUP)
    top, half = 2**bits - 1, 2 ** (bits - 1)
    low, high = groups.amin(-1), groups.amax(-1)
    extreme = torch.where(high.abs() > low.abs(), high, low)  # signed value of the largest magnitude
    candidates = [((high - low) / top, low), (-extreme / half, extreme)]  # (scale, offset)
    best_codes, best_scale, best_offset, best_error = None, None, None, None
    for scale, offset in candidates:
        scale = torch.where(scale.abs() < 1e-7, 1e-7, scale).half()  # a constant group still needs a step
        offset = offset.half()
        codes = ((groups - offset.float()[..., None]) / scale.float()[..., None]).round().clamp(0, top)
        error = (codes * scale.float()[..., None] + offset.float()[..., None] - groups).square().sum(-1)
        if best_error is None:
            best_codes, best_scale, best_offset, best_error = codes, scale, offset, error
        else:
            better = error < best_error
            best_codes = torch.where(better[..., None], codes, best_codes)
            best_scale, best_offset = torch.where(better, scale, best_scale), torch.where(better, offset, best_offset)
            best_error = torch.minimum(error, best_error)
    return best_codes.to(torch.uint8).reshape(N, K), best_scale, best_offset


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The weights the kernel multiplies by, in float32 (for tests and error measurements)."""
    N, K = codes.shape
    w = codes.float().reshape(N, K // GROUP, GROUP) * scale.float()[..., None] + offset.float()[..., None]
    return w.reshape(N, K)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The kernel's layout (see the comment at the top of kernels/woq_linear.cpp)."""
    N, K = codes.shape
    # [N, K] -> [blocks, quads, 64]: byte 4r + b of quad j is row r, column 4j + b.
    quads = codes.reshape(N // BLOCK, BLOCK, K // 4, 4).permute(0, 2, 1, 3).reshape(N // BLOCK, K // 4, 4 * BLOCK)
    nibbles = (quads & 15).reshape(N // BLOCK, K // 8, 2, 4 * BLOCK)
    low = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).contiguous()
    high = torch.zeros(0, dtype=torch.uint8)
    if bits == 5:  # bit t of quad j's little-endian 64-bit word: byte t's fifth bit
        fifth = (quads >> 4).reshape(N // BLOCK, K // 4, 8, 8).to(torch.int32)
        high = (fifth << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).contiguous()
    per_group = lambda t: t.reshape(N // BLOCK, BLOCK, K // GROUP).transpose(1, 2).contiguous()  # noqa: E731
    return {"low": low, "high": high, "scale": per_group(scale), "bias": per_group(offset)}


class QuantizedLinear(nn.Module):
    """A drop-in for an `nn.Linear` (bf16 or float32 activations) with 4- or 5-bit weights."""

    def __init__(self, in_features: int, out_features: int, bits: int, packed: dict[str, torch.Tensor],
                 bias: torch.Tensor | None, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.weight_dtype = weight_dtype  # the replaced layer's, which `weight` returns
        for name, tensor in packed.items():
            self.register_buffer(name, tensor)
        # float32: the kernel adds it before rounding (as a bf16 nn.Linear's GEMM does)
        self.register_buffer("bias_term", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int) -> QuantizedLinear:
        N, K = linear.weight.shape
        if N % BLOCK or K % GROUP:
            raise ValueError(f"a {N}x{K} weight does not tile into {BLOCK} rows and groups of {GROUP}")
        return cls(K, N, bits, pack(*quantize(linear.weight.detach(), bits), bits), linear.bias, linear.weight.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weights [out, in] in `weight_dtype`, computed on each access (for a draft
        head that takes its rows once): the kernel applied to the identity."""
        identity = torch.eye(self.in_features, dtype=self.weight_dtype)
        return self._forward(identity, None).T.contiguous()

    def _multiply(self, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        isa = _traced_isa() if torch.compiler.is_compiling() else kernel_isa()  # (loads the kernel: first)
        return torch.ops.specchat.woq_linear(rows, self.low, self.high, self.scale, self.bias, bias,
                                             self.out_features, self.bits, isa)

    def _forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # bf16 and float32 go through as they are (and come back so); float16 and others as float32
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
        y = self._multiply(x.reshape(-1, self.in_features).to(dtype).contiguous(), bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.bias_term)

    @classmethod
    def stacked(cls, layers: list[QuantizedLinear]) -> QuantizedLinear:
        """One layer computing several of the same input size: their outputs side by side. Blocks of
        16 output rows are computed independently, so each part equals its own layer's output exactly."""
        first = layers[0]
        if any(layer.in_features != first.in_features or layer.bits != first.bits for layer in layers):
            raise ValueError("stacked layers need the same input size and bits")
        packed = {part: torch.cat([getattr(layer, part) for layer in layers]) for part in PACKED_PARTS}
        biases = [layer.bias_term for layer in layers]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(layer.out_features) if b is None else b for layer, b in zip(layers, biases)])
        return cls(first.in_features, sum(layer.out_features for layer in layers), first.bits, packed, bias,
                   first.weight_dtype)


class GatedMLP(nn.Module):
    """The gated MLP of Llama-style decoders, down(act(gate(x)) * up(x)), with gate and up as one
    kernel call: the same output, one pass over x and one dispatch fewer per layer."""

    def __init__(self, gate_up: QuantizedLinear, down_proj: nn.Module, act_fn: nn.Module):
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


# transformers' MLP classes that compute exactly down_proj(act_fn(gate_proj(x)) * up_proj(x))
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP")


def fuse_gated_mlps(model: nn.Module) -> None:
    """Replace each known gated MLP whose gate and up layers are quantized by a `GatedMLP`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            parts = [getattr(child, part, None) for part in ("gate_proj", "up_proj")]
            if type(child).__name__ in GATED_MLPS and all(isinstance(part, QuantizedLinear) for part in parts):
                setattr(parent, name, GatedMLP(QuantizedLinear.stacked(parts), child.down_proj, child.act_fn))


class SharedProjection(nn.Module):
    """One of several layers that read the same input (an attention's q, k and v), computed together:
    the first of them to see an input runs the stacked layer, the others take their columns of that
    output while their input is the very same tensor (and compute it again otherwise). The output is
    dropped once every part has taken its columns, so a long prompt's is not kept."""

    def __init__(self, stacked: QuantizedLinear, columns: slice, shared: dict, parts: int):
        super().__init__()
        self.stacked, self.columns, self.shared, self.parts = stacked, columns, shared, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared.get("input") is not x:
            self.shared.update(input=x, output=self.stacked(x), taken=0)
        columns = self.shared["output"][..., self.columns]
        self.shared["taken"] += 1
        if self.shared["taken"] == self.parts:
            self.shared.clear()
        return columns


def share_projections(model: nn.Module, names=("q_proj", "k_proj", "v_proj")) -> None:
    """Give each module's quantized q, k and v projections one kernel call per input."""
    for module in list(model.modules()):
        parts = [getattr(module, name, None) for name in names]
        if not all(isinstance(part, QuantizedLinear) for part in parts):
            continue
        stacked, shared, start = QuantizedLinear.stacked(parts), {}, 0
        for name, part in zip(names, parts):
            columns = slice(start, start + part.out_features)
            setattr(module, name, SharedProjection(stacked, columns, shared, len(parts)))
            start += part.out_features


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """Every linear layer: its parent module, its attribute name there, the layer, its dotted name."""
    return [(module, name, child, f"{prefix}.{name}" if prefix else name) for prefix, module in model.named_modules()
            for name, child in module.named_children() if isinstance(child, nn.Linear)]


def quantize_linears(model: nn.Module, bits: int, cache: Path | None = None, what: str = "the linear layers") -> None:
    """Replace every linear layer of a model in place by a `bits`-bit one: a causal LM's LM head too
    (a quarter of a small model's weights; docs/cpu-runtime.md gives what that costs in fidelity),
    and draft heads on a quantized target (they run every cycle). A layer whose shape does not tile
    into 16 rows and groups of 32 stays as it is.

    Quantizing takes seconds per hundred million weights, so the packed layers are kept in
    `cache` (a safetensors file) and read from there on later starts. Gated MLPs then run gate
    and up as one layer (`fuse_gated_mlps`), attentions q, k and v (`share_projections`).
    """
    kernel_isa()  # fail before touching the model
    stored = _read_cache(cache, bits)
    if stored is None and cache is not None:
        log.info(f"packing {what} into {bits} bits once (seconds per hundred million weights)...")
    fresh = {}
    for module, name, child, key in _linears(model):
        N, K = child.weight.shape
        if N % BLOCK or K % GROUP:  # the kernel's tiling does not fit (a draft head's odd vocabulary): bf16
            continue
        if stored is not None and f"{key}.low" in stored:
            packed = {part: stored[f"{key}.{part}"] for part in PACKED_PARTS}
            layer = QuantizedLinear(K, N, bits, packed, child.bias, child.weight.dtype)
        else:
            layer = QuantizedLinear.from_linear(child, bits)
            fresh.update({f"{key}.{part}": getattr(layer, part) for part in PACKED_PARTS})
        setattr(module, name, layer)
    if cache is not None and fresh and stored is None:
        _write_cache(cache, fresh, bits)
    fuse_gated_mlps(model)
    share_projections(model)


def _read_cache(cache: Path | None, bits: int) -> dict[str, torch.Tensor] | None:
    if cache is None or not cache.is_file():
        return None
    try:
        with safe_open(cache, framework="pt") as handle:
            if handle.metadata().get("layout") != f"{LAYOUT}-{bits}":
                return None
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, SafetensorError):
        return None  # a damaged cache is made again


def _write_cache(cache: Path, tensors: dict[str, torch.Tensor], bits: int) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(cache.name + f".{os.getpid()}.partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, partial, metadata={"layout": f"{LAYOUT}-{bits}"})
    os.replace(partial, cache)
