"""What every draft head is: the interface the drafter and the trainer use (`DraftHead`), so neither
needs to probe a head for what it can do; what a head needs of its target (`TargetParts`); and the checks of the config fields every head shares
(`LayerConfig`, in layers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from drafters.checkpoint import HeadLoadError
from drafters.layers import DEFAULT_ROPE_THETA, LayerConfig


class TargetParts(Protocol):
    """What a head reads of the model it drafts for: its sizes, where it runs, and the embedding
    and LM head it may share (EAGLE-1/2 and Jakiro draw logits from the target's own LM head)."""

    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    embed_tokens: nn.Embedding
    lm_head: nn.Module


def read_layer_config(raw: dict, where: str) -> dict:
    """The shared fields of a head config.json, checked; returns kwargs for a LayerConfig subclass."""
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [key for key in required if key not in raw]
    if missing:
        raise HeadLoadError(f"{where}: config.json lacks {', '.join(missing)}")
    for key in (*required, "num_key_value_heads"):
        value = raw.get(key)
        if key in raw and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HeadLoadError(f"{where}: {key} must be a positive whole number, got {value!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise HeadLoadError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (heads use silu)")
    if raw["hidden_size"] % raw["num_attention_heads"]:
        raise HeadLoadError(f"{where}: hidden_size {raw['hidden_size']} is not a multiple of num_attention_heads")
    if raw["num_attention_heads"] % (raw.get("num_key_value_heads") or raw["num_attention_heads"]):
        raise HeadLoadError(f"{where}: num_attention_heads is not a multiple of num_key_value_heads")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not isinstance(raw.get("rope_scaling") or {}, dict):
        raise HeadLoadError(f"{where}: rope_parameters and rope_scaling must be JSON objects")
    return dict(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta") or rope.get("rope_theta") or DEFAULT_ROPE_THETA,
        rope_scaling=raw.get("rope_scaling") or ({**rope} if rope.get("rope_type", "default") != "default" else None),
        qkv_bias=bool(raw.get("qkv_bias", False)),
    )


def check_target_fit(config: LayerConfig, target: TargetParts, source: Path, feature_size: int | None = None) -> None:
    """Hidden size and vocabulary must be the target's, or the head's numbers mean nothing."""
    if config.vocab_size != target.vocab_size:
        raise HeadLoadError(f"{source}: the head's vocab_size is {config.vocab_size} but the target's is {target.vocab_size}")
    expected = feature_size or config.hidden_size
    if expected != target.hidden_size:
        raise HeadLoadError(
            f"{source}: the head expects target hidden size {expected} but the target's is {target.hidden_size}")


class DraftHead(nn.Module):
    """The interface of a draft head; one subclass per published format (`drafters.eagle`, ...).

    One draft step reads, per position, a feature (the target's hidden state there, or the head's
    own output of the step before) and the next token, and returns the head's output [m, H];
    `log_probs` turns outputs into the next token's draft distribution. Token ids in and out are
    target-vocabulary ids; a head that drafts over fewer tokens maps its draft ids back through
    `draft_to_target`.
    """

    kind: ClassVar[str]  # the checkpoint format: eagle | eagle3 | jakiro
    #: Jakiro: `forward_both` also gives an output that predicts the token after next.
    predicts_two_ahead: ClassVar[bool] = False
    #: EAGLE-1/2 and Jakiro draw logits from the target's own LM head, so a head may draft over a
    #: subset of its rows (`restrict_vocab`, shipped as draft_vocab.safetensors).
    uses_target_lm_head: ClassVar[bool] = False
    #: Format-specific config dataclass (a LayerConfig subclass) that `fresh` builds.
    config_class: ClassVar[type[LayerConfig]]

    # The training recipe of the format's paper (read by `specchat.train`, which has no per-kind code).
    #: Trains on the target's fused low/mid/high features (EAGLE-3), else on its final hidden state.
    reads_fused_features: ClassVar[bool] = False
    #: Unrolled draft steps per position in the paper's recipe (EAGLE-3's training-time test: 7).
    paper_unrolled_steps: ClassVar[int] = 1
    #: Half-width of the uniform noise added to the target features in training (EAGLE-1: 0.1).
    feature_noise: ClassVar[float] = 0.0
    #: Weight of SmoothL1 between the output and the target's next feature (EAGLE-1: 1; EAGLE-3 has none).
    feature_loss_weight: ClassVar[float] = 0.0
    #: Weight of the cross-entropy against the target's next-token distribution (EAGLE-1: 0.1).
    probability_loss_weight: ClassVar[float] = 1.0
    #: Unrolled step i's loss is weighted step_loss_decay ** i (EAGLE-3: 0.8).
    step_loss_decay: ClassVar[float] = 1.0

    config: LayerConfig
    owns_embedding: bool  # the checkpoint brings its own embedding (else the target's is shared)
    draft_to_target: torch.Tensor | None  # draft id -> target id; None: the target's vocabulary

    @classmethod
    def fresh(cls, fields: dict, target, draft_vocab: torch.Tensor | None) -> DraftHead:
        """A newly initialised head on the target's device: `fields` are the LayerConfig fields,
        `draft_vocab` the ascending target ids it drafts over (None: the whole vocabulary)."""
        raise NotImplementedError

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target hidden-state indices the head reads (see `Target.forward`)."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, keys) -> torch.Tensor:
        """One draft step for m positions: hidden [m, F], tokens and positions [m] -> [m, H]."""
        raise NotImplementedError

    def forward_both(self, hidden, tokens, positions, mask, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the output that predicts two tokens ahead (only if `predicts_two_ahead`)."""
        raise NotImplementedError(f"a {self.kind} head does not predict two tokens ahead")

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [m, draft vocab] of the token after each output."""
        raise NotImplementedError

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft only over `token_ids` (only if `uses_target_lm_head`)."""
        raise NotImplementedError(f"a {self.kind} head has its own draft vocabulary")

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint of this head holds (a shared target embedding is left out)."""
        return {k: v for k, v in self.state_dict().items() if self.owns_embedding or not k.startswith("embed_tokens.")}

    def after_load(self) -> None:
        """Called once `load_state_dict` has put the weights and buffers back: rebuild what is derived
        from them (nothing by default)."""
