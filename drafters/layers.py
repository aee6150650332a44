"""The layers draft heads are made of.

The published heads are single Llama-style decoder layers; their parameter names here are the
checkpoints' own (`self_attn.q_proj`, `mlp.gate_proj`, `post_attention_layernorm`, ...), so a
state dict maps onto the modules without renaming beyond each format's documented key map.

Attention asks its key store to attend (`drafters.cache.HeadCache.attend` at inference; the training-time test
of `specchat.train.unrolled` during training), so the layer itself knows nothing of either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafters.checkpoint import HeadLoadError

DEFAULT_ROPE_THETA = 10000.0  # Llama's default; EAGLE/EAGLE-3 head configs often omit rope_theta


SPECULATIVE_TOKENS = 5  # the speculators layout's proposal length unless told (vLLM's num_speculative_tokens then)


@dataclass(frozen=True)
class Verifier:
    """The target an exported head drafts for, as serving engines read it from the head's config
    (`drafters.export_head`, through `LayerConfig.layout_dict`). vLLM's speculators layout names it;
    every engine sizes the head's rotary positions by `max_position_embeddings`, and where the field
    is absent takes a default far below a long prompt (vLLM's Llama layer 8192, transformers'
    LlamaConfig 2048)."""

    name: str | None = None  # its hub id
    architectures: tuple[str, ...] = ()  # its config.json's, e.g. ("Qwen2ForCausalLM",)
    max_position_embeddings: int | None = None  # its context


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

    def layout_dict(self, layout: str, verifier: Verifier | None = None, speculative_tokens: int = SPECULATIVE_TOKENS,
                    feature_layers: tuple[int, ...] | None = None) -> dict:
        """config.json in a published layout (`drafters.export_head`); the reference layout here."""
        return self.to_dict()

    def layer_dict(self, architecture: str = "LlamaForCausalLM") -> dict:
        """The Llama-style config.json fields every head format writes."""
        return {
            "architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": 1, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "qkv_bias": self.qkv_bias,
        }


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions; the key store it is given does the attending."""

    def __init__(self, in_features: int, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, keys,
                layer_idx: int = 0) -> torch.Tensor:
        """x: [1, m, in_features]; mask: [1, 1, m, cached + m] (True = may attend); `keys` attends (see module doc)."""
        m = x.shape[1]
        q = self.q_proj(x).view(1, m, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, m, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, m, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = keys.attend(layer_idx, q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, m, self.heads * self.head_dim))



class DecoderLayer(nn.Module):
    """A Llama decoder layer without the input norm, as EAGLE's layer 0 is (fc's output goes straight in).

    Its `block` (attention from an input, the residual, the MLP of its norm) is what a runtime may
    compute faster: where `fast_block` is set (specchat sets it on a CPU for heads whose linear
    layers are its quantized ones, `specchat.decode.runtime.cpu_decoder`), `block` calls it instead, with
    the layer itself (it falls back to `torch_block` for key stores it does not handle).
    """

    def __init__(self, config: LayerConfig, attention_in: int | None = None):
        super().__init__()
        self.self_attn = Attention(attention_in or config.hidden_size, config.hidden_size, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim, config.qkv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.fast_block = None  # a runtime's block(layer, attention_input, residual, cos, sin, mask, keys); not a weight

    def forward(self, x, cos, sin, mask, keys) -> torch.Tensor:
        return self.block(x, x, cos, sin, mask, keys)

    def block(self, attention_input, residual, cos, sin, mask, keys) -> torch.Tensor:
        """residual + attention over `attention_input`, plus the MLP of that sum's norm."""
        if self.fast_block is not None:
            return self.fast_block(self, attention_input, residual, cos, sin, mask, keys)
        return self.torch_block(attention_input, residual, cos, sin, mask, keys)

    def torch_block(self, attention_input, residual, cos, sin, mask, keys) -> torch.Tensor:
        h = residual + self.self_attn(attention_input, cos, sin, mask, keys)
        return h + self.mlp(self.post_attention_layernorm(h))
