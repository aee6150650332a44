"""Building blocks shared by the draft heads, and strict checkpoint loading.

The published heads are single Llama-style decoder layers; their parameter names here are the
checkpoints' own (`self_attn.q_proj`, `mlp.gate_proj`, `post_attention_layernorm`, ...), so a
state dict maps onto the modules without renaming beyond each format's documented key map.
"""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ROPE_THETA = 10000.0  # Llama's default; EAGLE/EAGLE-3 head configs often omit rope_theta


class HeadLoadError(ValueError):
    """A draft head cannot be loaded; the message names the file, key or mismatch."""


# ---------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding with Llama's layout (rotate-half, cos/sin duplicated)."""

    head_dim: int
    theta: float = DEFAULT_ROPE_THETA
    scaling: dict | None = None  # None, {"type": "linear", "factor"}, or Llama 3's {"rope_type": "llama3", ...}

    def inv_freq(self, device) -> torch.Tensor:
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        kind = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type", "default"))
        if kind in ("default", "dynamic"):  # dynamic NTK only differs beyond the trained length
            return inv
        factor = float(self.scaling["factor"])
        if kind == "linear":
            return inv / factor
        if kind == "llama3":
            # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
            low, high = self.scaling["low_freq_factor"], self.scaling["high_freq_factor"]
            old_len = self.scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            smooth = ((old_len / wavelen) - low) / (high - low)
            blended = (1 - smooth) * inv / factor + smooth * inv
            return torch.where(wavelen > old_len / low, inv / factor, torch.where(wavelen < old_len / high, inv, blended))
        raise HeadLoadError(f"unsupported rope scaling {kind!r} (supported: default, linear, dynamic, llama3)")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention over a `KVCache`, with an explicit boolean mask."""

    def __init__(self, in_features: int, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache,
                layer_idx: int = 0) -> torch.Tensor:
        """x: [1, m, in_features]; mask: [1, 1, m, cached + m] (True = may attend)."""
        m = x.shape[1]
        q = self.q_proj(x).view(1, m, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, m, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, m, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        if isinstance(cache, UnrolledKeys):
            out = cache.attend(layer_idx, q, k, v, groups)
        else:
            k, v = cache.update(k, v, layer_idx)
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, m, self.heads * self.head_dim))


class UnrolledKeys:
    """Keys and values of earlier unrolled draft steps, for training-time test (EAGLE-3, §3.2).

    Step 0 runs over a whole sequence with causal attention. Step i >= 1 feeds each position the
    draft's own output of step i - 1 there and attends causally to step 0's keys plus, at the same
    position only, to the keys of steps 1..i: exactly what a depth-i tree node sees at inference
    (the committed context, its ancestors and itself). The same-position part is a dot product per
    position, so no [n, (i+1) n] mask is ever built.
    """

    def __init__(self):
        self.steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def attend(self, layer_idx: int, q, k, v, groups: int) -> torch.Tensor:
        earlier = self.steps.setdefault(layer_idx, [])
        earlier.append((k, v))
        expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)
        k0, v0 = (expand(t) for t in earlier[0])
        if len(earlier) == 1:
            return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        scale = q.shape[-1] ** -0.5
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [1, h, n, n]
        later = [(expand(kj), expand(vj)) for kj, vj in earlier[1:]]
        diagonal = torch.stack([(q * kj).sum(-1) * scale for kj, _ in later], dim=-1)  # [1, h, n, steps]
        weights = torch.softmax(torch.cat([scores0, diagonal], dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :n] @ v0
        for j, (_, vj) in enumerate(later):
            out = out + weights[..., n + j : n + j + 1] * vj
        return out


def causal_mask(cached: int, new: int, device) -> torch.Tensor:
    """[1, 1, new, cached + new]: everything cached plus the causal triangle of the new positions."""
    mask = torch.ones(new, cached + new, dtype=torch.bool, device=device)
    mask[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return mask[None, None]


# ---------------------------------------------------------------------------------------------
# Config and checkpoint files


@dataclass(frozen=True)
class LayerConfig:
    """The Llama-style fields every head config has (keys the head does not use are ignored)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope(self) -> Rope:
        return Rope(self.head_dim, self.rope_theta, self.rope_scaling)

    def layer_dict(self, architecture: str = "LlamaForCausalLM") -> dict:
        """The Llama-style config.json fields every head format writes."""
        return {
            "architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": 1, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "qkv_bias": self.qkv_bias,
        }


def read_layer_config(raw: dict, where: str) -> dict:
    """The shared fields of a head config.json, checked; returns kwargs for a LayerConfig subclass."""
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [key for key in required if key not in raw]
    if missing:
        raise HeadLoadError(f"{where}: config.json lacks {', '.join(missing)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise HeadLoadError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (heads use silu)")
    if raw["hidden_size"] % raw["num_attention_heads"]:
        raise HeadLoadError(f"{where}: hidden_size {raw['hidden_size']} is not a multiple of num_attention_heads")
    rope = raw.get("rope_parameters") or {}
    return dict(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta") or rope.get("rope_theta") or DEFAULT_ROPE_THETA,
        rope_scaling=raw.get("rope_scaling") or ({**rope} if rope.get("rope_type", "default") != "default" else None),
        qkv_bias=bool(raw.get("qkv_bias", False)),
    )


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise HeadLoadError(f"{folder}: no config.json (a draft head folder holds config.json and weights)") from error
    except ValueError as error:
        raise HeadLoadError(f"{path}: not valid JSON ({error})") from error


WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The head's state dict from model.safetensors, from shards listed in model.safetensors.index.json
    (the Hugging Face sharded layout), or from pytorch_model.bin loaded with weights_only."""
    safetensors_path, index_path, pickle_path = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX, folder / "pytorch_model.bin"
    if safetensors_path.is_file():
        return _read_safetensors(safetensors_path), safetensors_path
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise HeadLoadError(f"{index_path}: not a safetensors index ({error})") from error
        state = {}
        for shard in sorted(set(weight_map.values())):
            tensors = _read_safetensors(folder / shard)
            wrong = [key for key in tensors if weight_map.get(key) != shard]
            if wrong:
                raise HeadLoadError(f"{folder / shard}: holds {', '.join(wrong[:4])}, which the index places elsewhere")
            state.update(tensors)
        absent = [key for key in weight_map if key not in state]
        if absent:
            raise HeadLoadError(f"{index_path}: lists {', '.join(absent[:4])}, which no shard holds")
        return state, index_path
    if pickle_path.is_file():
        try:
            return torch.load(pickle_path, map_location="cpu", weights_only=True), pickle_path
        except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as error:
            raise HeadLoadError(f"{pickle_path}: cannot read with weights_only=True ({error})") from error
    raise HeadLoadError(f"{folder}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX} or pytorch_model.bin")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise HeadLoadError(f"{path}: cannot read ({error})") from error


def write_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None = None) -> list[Path]:
    """Write `state` as model.safetensors, or, past `max_shard_bytes`, as numbered shards with an
    index (the Hugging Face layout, which other engines read too). Returns the files written."""
    from safetensors.torch import save_file

    for stale in [folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, folder / WEIGHTS_FILE, metadata={"format": "pt"})
        return [folder / WEIGHTS_FILE]
    shards, size = [{}], 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    written, weight_map = [], {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written.append(folder / name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*written, folder / WEIGHTS_INDEX]


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: Path,
                optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `module`, requiring every key with its exact shape and no extras.

    Keys in `optional` may be absent (the module keeps what the caller set up for them).
    """
    expected = module.state_dict()
    missing = [key for key in expected if key not in state and key not in optional]
    unexpected = [key for key in state if key not in expected]
    if missing:
        raise HeadLoadError(f"{source}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing[:6])}"
                            + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        raise HeadLoadError(f"{source}: unexpected key{'s' if len(unexpected) > 1 else ''} "
                            f"{', '.join(unexpected[:6])}" + (" ..." if len(unexpected) > 6 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise HeadLoadError(f"{source}: {key} has shape {list(tensor.shape)}, expected {list(expected[key].shape)}")
    module.load_state_dict({k: v for k, v in state.items()}, strict=False)
