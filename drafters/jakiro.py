"""Jakiro draft head (Huang et al. 2025, arXiv 2502.06282): EAGLE-2 with a mixture of experts.

The layer is EAGLE-1's (fc over cat(embedding, feature), attention without an input norm), but
the MLP is two SwiGLU experts that both always run. A bias-free router gives four logits:
- left output (every step): softmax(g0, g1)-weighted sum of the experts, the next feature;
- right output (the penultimate draft step only): beta * E_top - alpha * E_other, with
  (beta, alpha) = softmax(g2, g3) sorted so beta >= alpha and E_top the expert of the larger of
  g2, g3 — a contrastive feature that predicts the token *two* ahead, so the last tree level comes
  from the same forward as the one before it (one draft forward fewer than EAGLE-2).
Logits come from the target's LM head, with no final norm.

Checkpoint format (as published, e.g. Hhaiduo/Jakiro-Vicuna-7B-v1.3):
    fc.weight [H, 2H], fc.bias [H] (when "bias", default true)
    layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.post_attention_layernorm.weight
    layers.0.mlp_moe.gate.weight                          [4, H]
    layers.0.mlp_moe.experts.{0,1}.{gate,up,down}_proj.weight  [H, H]
    embed_tokens.weight [V, H] optional (else the target's embedding)
Config: Llama fields + num_local_experts (2), num_experts_per_tok (2), "bias".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafters import eagle
from drafters.base import TargetParts, read_layer_config
from drafters.checkpoint import HeadLoadError
from drafters.eagle import EagleHead
from drafters.layers import Attention, LayerConfig, RMSNorm, SwiGLU

KIND = "jakiro"
NAME = "Jakiro"
KEYS = "fc [H, 2H] + layers.0.* with mlp_moe.gate [4, H] and two experts"
KEY_MAP: dict[str, str] = {}  # the published names are the modules' own
LAYOUTS: dict[str, dict[str, str]] = {"eagle": {}}  # the reference layout (no serving engine reads Jakiro heads)
NUM_EXPERTS = 2  # the published Jakiro heads; the router has two logits per branch (left, right)


@dataclass(frozen=True)
class JakiroConfig(LayerConfig):
    bias: bool = True

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> JakiroConfig:
        experts = raw.get("num_local_experts", NUM_EXPERTS)
        if experts != NUM_EXPERTS or raw.get("num_experts_per_tok", NUM_EXPERTS) != NUM_EXPERTS:
            raise HeadLoadError(f"{where}: Jakiro heads with {experts} experts are not supported (only 2 of 2)")
        return cls(**read_layer_config(raw, where), bias=bool(raw.get("bias", True)))

    def to_dict(self) -> dict:
        return {**self.layer_dict(), "bias": self.bias, "num_local_experts": NUM_EXPERTS,
                "num_experts_per_tok": NUM_EXPERTS}


class MixtureOfExperts(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, 2 * NUM_EXPERTS, bias=False)
        # Experts are H -> H -> H, as in the published checkpoints (the config's intermediate_size is not used).
        self.experts = nn.ModuleList([SwiGLU(hidden, hidden) for _ in range(NUM_EXPERTS)])

    def forward(self, u: torch.Tensor, right: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        outputs = torch.stack([expert(u) for expert in self.experts])  # [2, ..., H]
        logits = self.gate(u)
        w = torch.softmax(logits[..., :NUM_EXPERTS].float(), dim=-1).to(u.dtype)
        left = w[..., 0:1] * outputs[0] + w[..., 1:2] * outputs[1]
        if not right:
            return left, None
        w_right = torch.softmax(logits[..., NUM_EXPERTS:].float(), dim=-1).to(u.dtype)
        first_on_top = logits[..., NUM_EXPERTS:NUM_EXPERTS + 1] >= logits[..., NUM_EXPERTS + 1:]
        beta, alpha = w_right.max(dim=-1, keepdim=True).values, w_right.min(dim=-1, keepdim=True).values
        top = torch.where(first_on_top, outputs[0], outputs[1])
        other = torch.where(first_on_top, outputs[1], outputs[0])
        return left, beta * top - alpha * other


class JakiroLayer(nn.Module):
    def __init__(self, config: LayerConfig):
        super().__init__()
        self.self_attn = Attention(config.hidden_size, config.hidden_size, config.num_attention_heads,
                                   config.num_key_value_heads, config.head_dim, config.qkv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_moe = MixtureOfExperts(config.hidden_size)

    def forward(self, x, cos, sin, mask, keys, right: bool = False):
        h = x + self.self_attn(x, cos, sin, mask, keys)
        left, contrast = self.mlp_moe(self.post_attention_layernorm(h), right)
        return h + left, (None if contrast is None else h + contrast)


class JakiroHead(EagleHead):
    """Jakiro: the EAGLE-1/2 interface plus `forward_both`, which also gives the two-ahead output."""

    kind = KIND
    predicts_two_ahead = True
    config_class = JakiroConfig
    layer_class = JakiroLayer

    def forward_both(self, hidden, tokens, positions, mask, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """The next feature (left) and the contrastive two-ahead feature (right), each [m, H]."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))[None]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        left, right = self.layers[0](x, cos, sin, mask, keys, right=True)
        return left[0], right[0]

    def forward(self, hidden, tokens, positions, mask, keys) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))[None]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return self.layers[0](x, cos, sin, mask, keys)[0][0]


CONFIG = JakiroConfig  # the config.json fields of this format
HEAD = JakiroHead  # the head this format loads into


def matches(keys: set[str]) -> bool:
    return any(".mlp_moe." in k for k in keys)


def load(folder: Path, raw_config: dict, state: dict, source: Path, target: TargetParts) -> JakiroHead:
    return eagle.load(folder, raw_config, state, source, target, head_class=JakiroHead)
