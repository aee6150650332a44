"""EAGLE-1/2 draft head (Li et al. 2024, arXiv 2401.15077; EAGLE-2 reuses the same weights).

One step: `fc` fuses the embedding of token t+1 with the target's feature at t (the final-normed
last hidden state), one decoder layer without an input norm predicts the feature at t+1, and
the *target's* LM head turns it into next-token logits.

Checkpoint format (as published, e.g. yuhuili/EAGLE-Vicuna-7B-v1.3):
    embed_tokens.weight                      [V, H]   optional (else the target's embedding)
    fc.weight                                [H, 2H]  input is cat(embedding, feature)
    fc.bias                                  [H]      when the config's "bias" is true (default)
    layers.0.self_attn.{q,k,v}_proj.weight   (+ .bias when "qkv_bias")
    layers.0.self_attn.o_proj.weight
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight
No input_layernorm, final norm or lm_head. Config: Llama fields + "bias", "qkv_bias".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafters.base import DraftHead, TargetParts, check_target_fit, read_layer_config
from drafters.checkpoint import built_empty, load_strict
from drafters.layers import DecoderLayer, LayerConfig

KIND = "eagle"
NAME = "EAGLE-1/2"
KEYS = "fc [H, 2H] + layers.0.* without input_layernorm"
KEY_MAP: dict[str, str] = {}  # the published names are the modules' own
# The layouts a head of this kind is written in (`drafters.export_head`), each with its key renames:
# the reference layout, which SGLang's LlamaForCausalLMEagle reads as it is.
LAYOUTS: dict[str, dict[str, str]] = {"eagle": {}, "sglang": {}}


@dataclass(frozen=True)
class EagleConfig(LayerConfig):
    bias: bool = True  # bias of `fc`; EAGLE reads config["bias"] and assumes true when absent

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> EagleConfig:
        return cls(**read_layer_config(raw, where), bias=bool(raw.get("bias", True)))

    def to_dict(self) -> dict:
        return {**self.layer_dict(), "bias": self.bias}


class EagleHead(DraftHead):
    """EAGLE-1/2 head. Token ids in and out are target-vocabulary ids."""

    kind = KIND
    uses_target_lm_head = True
    config_class = EagleConfig
    layer_class = DecoderLayer
    feature_noise = 0.1
    feature_loss_weight = 1.0
    probability_loss_weight = 0.1

    def __init__(self, config: EagleConfig, target_embed: nn.Embedding, target_lm_head: nn.Linear,
                 own_embedding: bool = False):
        super().__init__()
        self.config = config
        H = config.hidden_size
        # The target's embedding is shared, not copied, unless the checkpoint brings its own.
        self.embed_tokens = nn.Embedding(config.vocab_size, H) if own_embedding else target_embed
        self.owns_embedding = own_embedding
        self.fc = nn.Linear(2 * H, H, bias=config.bias)
        self.layers = nn.ModuleList([self.layer_class(config)])
        self.rope = config.rope
        self._lm_head = [target_lm_head]  # a list: the target's head is used, never registered or saved
        self.draft_to_target: torch.Tensor | None = None  # None: drafts over the whole target vocabulary
        # The target LM head's rows of the draft vocabulary as a layer of their own: derived, never
        # saved or trained (a list, so that it is not registered); empty without a restriction.
        self._draft_lm_head: list[nn.Module] = []

    @classmethod
    def fresh(cls, fields: dict, target, draft_vocab: torch.Tensor | None) -> EagleHead:
        head = cls(cls.config_class(**fields), target.embed_tokens, target.lm_head).to(target.device)
        head.restrict_vocab(draft_vocab)
        return head

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return (num_target_layers,)  # the final normed hidden state

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft only over `token_ids` (e.g. the most frequent tokens): the LM head then costs a fraction.

        Lossless either way, because the target verifies every draft token.
        """
        if token_ids is None:
            self.draft_to_target, self._draft_lm_head = None, []
            return
        weight = self._lm_head[0].weight
        self.draft_to_target = token_ids.to(weight.device)
        rows = nn.utils.skip_init(nn.Linear, weight.shape[1], len(token_ids), bias=False, device=weight.device,
                                  dtype=weight.dtype)  # (its weights are the rows: no random ones first)
        rows.weight = nn.Parameter(weight[self.draft_to_target].detach().contiguous(), requires_grad=False)
        self._draft_lm_head = [rows]

    def draft_logits_layer(self) -> nn.Module | None:
        return self._draft_lm_head[0] if self._draft_lm_head else None

    def set_draft_logits_layer(self, layer: nn.Module) -> None:
        assert self._draft_lm_head, "only a restricted vocabulary has a layer of its own"
        self._draft_lm_head = [layer]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, keys) -> torch.Tensor:
        """One draft step for m positions. hidden: [m, H] features; tokens, positions: [m]. Returns [m, H]."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))[None]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return self.layers[0](x, cos, sin, mask, keys)[0]

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [m, draft vocab] of the token after each position."""
        if self._draft_lm_head:  # the target's rows of the draft vocabulary
            logits = self._draft_lm_head[0](out)
        else:
            logits = self._lm_head[0](out)  # the target's LM head itself, whatever its weights' format
        return torch.log_softmax(logits.float(), dim=-1)


CONFIG = EagleConfig  # the config.json fields of this format
HEAD = EagleHead  # the head this format loads into


def matches(keys: set[str]) -> bool:
    return "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys


def load(folder: Path, raw_config: dict, state: dict, source: Path, target: TargetParts,
         head_class=EagleHead) -> EagleHead:
    """A head of `head_class` (EAGLE-1/2, or Jakiro, which shares the layout) from its checkpoint."""
    config = head_class.config_class.from_dict(raw_config, str(folder / "config.json"))
    check_target_fit(config, target, source)
    with built_empty():
        head = head_class(config, target.embed_tokens, target.lm_head, own_embedding="embed_tokens.weight" in state)
    load_strict(head, state, source, optional=() if head.owns_embedding else ("embed_tokens.weight",), assign=True)
    return head.to(device=target.device, dtype=target.dtype).eval()

