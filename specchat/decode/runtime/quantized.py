"""Weight-only quantized linear layers for the CPU target (`--quantize int5|int4`).

Weights are stored in 5 or 4 bits with an fp16 scale and offset per group of 32 (each group on
the better of a symmetric and a min-max grid: `quantize`), and multiplied by `kernels/woq_linear.cpp`,
which unpacks each block of weights once per forward and multiplies it with every token in 8-bit
integer products: verifying 8 tokens costs ~1.4x one, at a third of bf16's memory traffic. The
kernel is compiled once per machine (it needs a C++ compiler and an x86 CPU with AVX2, FMA and
F16C) and cached.

The kernel, its build and the instruction-set path it runs: `specchat.decode.runtime.woq_kernel`.

Plain decoding and verification both run through these layers, so speculative decoding stays
exact relative to plain decoding of the same quantized model; what quantization changes is the
model itself (how far from bf16: README, docs/cpu-runtime.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specchat.decode.options import KERNEL_BITS
from specchat.decode.runtime.machine import cache_dir, replace_atomically, write_safetensors
from specchat.decode.runtime.woq_kernel import kernel, kernel_isa, traced_isa
from specchat.errors import first_line

log = logging.getLogger(__name__)

LAYOUT = "woq2"  # the packed format below; a cached model in another layout is packed again
GROUP = 32  # weights per scale and offset, along the input dimension
BLOCK = 16  # output rows per kernel block (one AVX-512 register of fp32)
PACKED_PARTS = ("low", "high", "scale", "bias")  # a layer's buffers in that format (`pack`)


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (uint8), scales and offsets [N, K/GROUP] (fp16): w ≈ code * scale + offset.

    Each group gets whichever of two grids reconstructs it better: llama.cpp's symmetric one
    (Q4_0/Q5_0: the largest magnitude maps to code 0, so weights that came from such a GGUF are
    reproduced exactly) or the asymmetric min-max grid (better for skewed groups). In the kernel's
    extension (`kernels/quantize.cpp`, which says how): a model is quantized once, at its first start.
    """
    kernel()
    weight = weight.detach()
    return torch.ops.specchat.quantize(weight if weight.dtype in (torch.bfloat16, torch.float32) else weight.float(),
                                       bits)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The weights the kernel multiplies by, in float32 (for tests and error measurements)."""
    N, K = codes.shape
    w = codes.float().reshape(N, K // GROUP, GROUP) * scale.float()[..., None] + offset.float()[..., None]
    return w.reshape(N, K)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The kernel's layout (see the comment at the top of kernels/woq_linear.cpp; made by kernels/quantize.cpp)."""
    kernel()
    low, high, scales, offsets = torch.ops.specchat.pack(codes, scale, offset, bits)
    return {"low": low, "high": high, "scale": scales, "bias": offsets}


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
    def from_packed(cls, packed: dict[str, torch.Tensor], bias: torch.Tensor | None,
                    weight_dtype: torch.dtype) -> QuantizedLinear:
        """A layer from its `pack`ed buffers, its sizes and bits read off their shapes: `low` is
        [N / BLOCK, K / 8, 4 * BLOCK], `high` empty for 4 bits."""
        blocks, columns, _ = packed["low"].shape
        return cls(columns * 8, blocks * BLOCK, 5 if packed["high"].numel() else 4, packed, bias, weight_dtype)

    def packed(self) -> dict[str, torch.Tensor]:
        """Its buffers in the kernel's layout (`pack`), as `from_packed` takes them."""
        return {part: getattr(self, part) for part in PACKED_PARTS}

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
        isa = traced_isa() if torch.compiler.is_compiling() else kernel_isa()  # (loads the kernel: first)
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


def shared_projections(stacked: QuantizedLinear, sizes: list[int]) -> list[SharedProjection]:
    """The parts of `stacked`, side by side `sizes` columns wide, as layers that share its calls."""
    shared, starts = {}, [sum(sizes[:index]) for index in range(len(sizes))]
    return [SharedProjection(stacked, slice(start, start + size), shared, len(sizes))
            for start, size in zip(starts, sizes)]


def share_projections(model: nn.Module, names=("q_proj", "k_proj", "v_proj")) -> None:
    """Give each module's quantized q, k and v projections one kernel call per input."""
    for module in list(model.modules()):
        parts = [getattr(module, name, None) for name in names]
        if not all(isinstance(part, QuantizedLinear) for part in parts):
            continue
        shared = shared_projections(QuantizedLinear.stacked(parts), [part.out_features for part in parts])
        for name, projection in zip(names, shared):
            setattr(module, name, projection)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """Every linear layer: its parent module, its attribute name there, the layer, its dotted name."""
    return [(module, name, child, f"{prefix}.{name}" if prefix else name) for prefix, module in model.named_modules()
            for name, child in module.named_children() if isinstance(child, nn.Linear)]


def packable(layer: nn.Linear) -> bool:
    """Whether the kernel's tiling fits a linear layer: blocks of 16 outputs, groups of 32 inputs."""
    N, K = layer.weight.shape
    return N % BLOCK == 0 and K % GROUP == 0


def quantize_linears(model: nn.Module, bits: int, cache: Path | None = None, what: str = "the linear layers",
                     say_packing: bool = False) -> None:
    """Replace every linear layer of a model in place by a `bits`-bit one: a causal LM's LM head too
    (a quarter of a small model's weights; docs/cpu-runtime.md gives what that costs in fidelity),
    and draft heads on a quantized target (they run every cycle). A layer whose shape does not tile
    into 16 rows and groups of 32 stays as it is.

    Quantizing takes a second or two per billion weights, so the packed layers are kept in
    `cache` (a safetensors file) and read from there on later starts; packing is said in one line
    where they are kept, or where `say_packing` (a model packed once for its packed model's file).
    Gated MLPs then run gate and up as one layer (`fuse_gated_mlps`), attentions q, k and v
    (`share_projections`).
    """
    kernel_isa()  # fail before touching the model
    stored = _read_cache(cache, bits)
    if stored is None and (cache is not None or say_packing):
        log.info(f"packing {what} into {bits} bits once (a second or two per billion weights)...")
    fresh = {}
    for module, name, child, key in _linears(model):
        if not packable(child):  # the kernel's tiling does not fit (a draft head's odd vocabulary): as it is
            continue
        N, K = child.weight.shape
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


def weights_key(source: str | Path, *more: str) -> str:
    """A short key for a model or draft-head folder's weights, with `more`: their files by name, size
    and modification time, so that changed weights are packed again."""
    files = sorted(Path(source).glob("*.safetensors")) + sorted(Path(source).glob("*.bin"))
    key = json.dumps([str(source)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files] + list(more))
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def quantized_cache(source: str | Path, quantize: str, loaded_on=None) -> Path:
    """Where the packed layers of a model or draft-head folder are kept, keyed by its weight files;
    a draft head's also by the target it was loaded on (its LM-head rows may be the target's;
    `loaded_on`, a `Target`)."""
    more = [quantized_cache(loaded_on.model.name_or_path, quantize).name] if loaded_on else []
    return cache_dir() / "quantized" / f"{weights_key(source, *more)}-{quantize}.safetensors"


def save_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` as a safetensors file at `path`, put in place whole (`replace_atomically`)."""
    replace_atomically(path, lambda partial: write_safetensors(partial, tensors, metadata))


def stale_reason(cache: Path) -> str | None:
    """Why no start of this specchat would read the quantized layers' cache at `cache` (packed in
    another layout: the next load of its model packs them anew), or None."""
    try:
        with safe_open(cache, framework="pt") as handle:
            layout = (handle.metadata() or {}).get("layout", "")
    except (OSError, SafetensorError) as error:
        return f"unreadable ({first_line(error)})"
    current = {f"{LAYOUT}-{bits}" for bits in KERNEL_BITS.values()}
    return None if layout in current else f"its layout is {layout!r}, not {LAYOUT!r}'s"


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
    save_atomically(cache, tensors, {"layout": f"{LAYOUT}-{bits}"})
