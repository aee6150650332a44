"""The layers draft heads are made of, and the head's own KV cache.

The published heads are single Llama-style decoder layers; their parameter names here are the
checkpoints' own (`self_attn.q_proj`, `mlp.gate_proj`, `post_attention_layernorm`, ...), so a
state dict maps onto the modules without renaming beyond each format's documented key map.

Attention asks its key store to attend (`HeadCache.attend` at inference; the training-time test
of `specchat.train.unrolled` during training), so the layer itself knows nothing of either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specchat.attention import attention
from specchat.cache import KVCache
from specchat.drafters.checkpoint import HeadLoadError

DEFAULT_ROPE_THETA = 10000.0  # Llama's default; EAGLE/EAGLE-3 head configs often omit rope_theta


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


class HeadCache(KVCache):
    """A draft head's KV cache at inference: the engine's growable cache, plus attention over it."""

    def attend(self, layer_idx: int, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        k, v = self.update(k, v, layer_idx)
        return attention(q, k, v, mask)
