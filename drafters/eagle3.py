"""EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840).

The target's low, mid and high hidden states (the inputs of layers 2, L//2 and L-3) are fused by
`fc`; one decoder layer attends over cat(norm(embedding), norm(feature)) (2H wide) and a final
norm plus the head's own LM head predict over a reduced draft vocabulary, mapped back to target
ids through `d2t` (target id = draft id + d2t[draft id]). Later draft steps feed the layer's own
output back in place of the fused feature.

Checkpoint format (as published, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
    fc.weight                                  [H, 3*H_target]
    midlayer.hidden_norm.weight, midlayer.input_layernorm.weight      [H]
    midlayer.self_attn.{q,k,v}_proj.weight     [*, 2H]
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.post_attention_layernorm.weight, norm.weight            [H]
    lm_head.weight                             [draft_vocab, H]
    d2t [draft_vocab] int64, t2d [vocab] bool  (absent when draft_vocab == vocab)
    embed_tokens.weight                        optional (else the target's embedding)
Community checkpoints that name the layer `layers.0.*` are read through KEY_MAP.
Config: Llama fields + draft_vocab_size, optional target_hidden_size; rope_theta defaults to 10000.

Two published layouts hold these weights, and both are read and written here:
- the EAGLE reference layout (`to_dict`; yuhuili/EAGLE3-*), which SGLang's LlamaForCausalLMEagle3
  reads as it is: `midlayer.*` keys, Llama fields at the top of config.json, and the captured
  target layers as `eagle_config.eagle_aux_hidden_state_layer_ids`, each naming a layer whose
  *output* is taken (SGLang captures at id + 1: the hidden-state index here is id + 1);
- vLLM's speculators layout (`to_speculators`; RedHatAI/*speculator.eagle3): `layers.0.*` keys,
  config.json with `speculators_model_type: eagle3`, the layer's Llama fields nested in
  `transformer_layer_config`, a `speculators_config` (proposal method, verifier), and the captured
  layers as a top-level `eagle_aux_hidden_state_layer_ids`, each naming a layer whose *input* is
  taken (vLLM captures before layer id runs: the hidden-state index here is the id itself), and
  `norm_before_residual` (the hidden norm before the residual is taken: vLLM's default when the
  field is absent; EAGLE's reference takes the residual first, as heads trained here do).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafters.base import DraftHead, TargetParts, check_target_fit, read_layer_config
from drafters.checkpoint import HeadLoadError, built_empty, load_strict
from drafters.layers import SPECULATIVE_TOKENS, DecoderLayer, LayerConfig, RMSNorm, Verifier

KIND = "eagle3"
NAME = "EAGLE-3"
KEYS = "fc [H, 3H] + midlayer.* + norm + lm_head (+ d2t/t2d)"
# Community EAGLE-3 checkpoints (e.g. some Qwen3 heads) call the decoder layer `layers.0`.
KEY_MAP = {"layers.0.": "midlayer."}
# The layouts a head of this kind is written in (`drafters.export_head`), each with its key renames.
LAYOUTS: dict[str, dict[str, str]] = {"eagle": {}, "sglang": {}, "speculators": {"midlayer.": "layers.0."}}


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high features: the inputs of layers 2, L//2 and L-3 (§3.1)."""
    L = num_target_layers
    return (2, L // 2, L - 3)


@dataclass(frozen=True)
class Eagle3Config(LayerConfig):
    draft_vocab_size: int = 0
    target_hidden_size: int | None = None  # width of each captured target state; default hidden_size
    feature_layer_ids: tuple[int, ...] | None = None  # hidden-state indices to fuse; default (2, L//2, L-3)
    norm_before_residual: bool = False  # the residual is the normed feature (speculators' option)
    max_position_embeddings: int | None = None  # the target's context (what serving engines size RoPE for)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> Eagle3Config:
        """Either layout (module docstring): the reference one, or speculators' (told by its model type)."""
        if "speculators_model_type" in raw:
            return cls._from_speculators(raw, where)
        layer_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            **read_layer_config(raw, where),
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size"),
            # That field counts "output of layer i"; the hidden-state index of that output is i + 1 (as SGLang reads it).
            feature_layer_ids=tuple(i + 1 for i in layer_ids) if layer_ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            max_position_embeddings=raw.get("max_position_embeddings"),
        )

    @classmethod
    def _from_speculators(cls, raw: dict, where: str) -> Eagle3Config:
        if raw["speculators_model_type"] != "eagle3":
            raise HeadLoadError(f"{where}: a speculators {raw['speculators_model_type']!r} model, not an EAGLE-3 head")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HeadLoadError(f"{where}: a speculators config without transformer_layer_config")
        layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            **read_layer_config({**layer, "qkv_bias": layer.get("attention_bias", False)}, where),
            draft_vocab_size=raw.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size"),
            feature_layer_ids=tuple(layer_ids) if layer_ids else None,  # inputs of those layers: our indices
            norm_before_residual=bool(raw.get("norm_before_residual", True)),  # vLLM's default when absent
            max_position_embeddings=layer.get("max_position_embeddings"),
        )

    def to_dict(self) -> dict:
        """The reference layout (SGLang's as well)."""
        out = {**self.layer_dict("LlamaForCausalLMEagle3"), "draft_vocab_size": self.draft_vocab_size,
               "tie_word_embeddings": False}  # (SGLang would make the LM head the embedding)
        if self.target_hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.feature_layer_ids:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.feature_layer_ids]}
        if self.norm_before_residual:  # not the reference's layer: said, though only specchat reads it
            out["norm_before_residual"] = True
        if self.max_position_embeddings:
            out["max_position_embeddings"] = self.max_position_embeddings
        return out

    def layout_dict(self, layout: str, verifier: Verifier | None = None, speculative_tokens: int = SPECULATIVE_TOKENS,
                    feature_layers: tuple[int, ...] | None = None) -> dict:
        if layout == "speculators":
            if verifier is None or not verifier.name:
                raise HeadLoadError("the speculators layout names the head's verifier: give the target's hub id")
            return self.to_speculators(verifier, speculative_tokens, feature_layers)
        if self.norm_before_residual:  # the reference layer takes the residual before the norm: it would compute another head
            raise HeadLoadError(f"this head normalizes the feature before its residual, which the {layout} layout "
                                f"cannot say: only the speculators layout holds it")
        return dataclasses.replace(self, feature_layer_ids=self.feature_layer_ids or feature_layers).to_dict()

    def to_speculators(self, verifier: Verifier, speculative_tokens: int,
                       feature_layers: tuple[int, ...] | None) -> dict:
        """vLLM's speculators layout. `verifier`: the target (its hub id and architectures);
        `feature_layers`: the hidden-state indices to capture, when the head does not say (the
        defaults for its target)."""
        layer = {key: value for key, value in self.layer_dict().items() if key not in ("architectures", "qkv_bias")}
        layer.update(attention_bias=self.qkv_bias, mlp_bias=False, tie_word_embeddings=False,
                     max_position_embeddings=self.max_position_embeddings)
        layer = {key: value for key, value in layer.items() if value is not None}
        out = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "verifier": {"name_or_path": verifier.name, "architectures": list(verifier.architectures)},
            },
        }
        ids = self.feature_layer_ids or feature_layers
        if ids:
            out["eagle_aux_hidden_state_layer_ids"] = list(ids)
        if self.target_hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        return out


class Eagle3Layer(DecoderLayer):
    """The decoder layer: attention reads cat(input_layernorm(embedding), hidden_norm(feature)); the
    residual is the feature (the reference) or, with `norm_before_residual`, its normed form."""

    def __init__(self, config: Eagle3Config):
        super().__init__(config, attention_in=2 * config.hidden_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embedded, hidden, cos, sin, mask, keys) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embedded), normed], dim=-1)
        return self.block(x, normed if self.norm_before_residual else hidden, cos, sin, mask, keys)


class Eagle3Head(DraftHead):
    """EAGLE-3 head: its own LM head over a draft vocabulary, read back to target ids through d2t."""

    kind = KIND
    config_class = Eagle3Config
    reads_fused_features = True
    paper_unrolled_steps = 7
    step_loss_decay = 0.8

    def __init__(self, config: Eagle3Config, target_embed: nn.Embedding, own_embedding: bool = False):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H) if own_embedding else target_embed
        self.owns_embedding = own_embedding
        self.fc = nn.Linear(3 * (config.target_hidden_size or H), H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rope = config.rope
        if config.draft_vocab_size != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # Made from d2t once it holds its values (`refresh_vocab_map`: `fresh`, `load` and a resumed
        # checkpoint call it), not here: a head built empty (`built_empty`) has none yet, and an
        # operation on its meta tensors would import torch's compiler (~1.2 s of a start).
        self.draft_to_target: torch.Tensor | None = None

    def after_load(self) -> None:
        self.refresh_vocab_map()

    def refresh_vocab_map(self) -> None:
        """Draft index i stands for target id i + d2t[i] (identity when the vocabularies are equal)."""
        if self.config.draft_vocab_size != self.config.vocab_size:
            self.draft_to_target = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        else:
            self.draft_to_target = None

    @classmethod
    def fresh(cls, fields: dict, target, draft_vocab: torch.Tensor | None) -> Eagle3Head:
        size = target.vocab_size if draft_vocab is None else len(draft_vocab)
        head = cls(cls.config_class(**fields, draft_vocab_size=size), target.embed_tokens).to(target.device)
        if size != target.vocab_size:
            ids = draft_vocab.to(target.device)
            with torch.no_grad():
                head.d2t.copy_(ids - torch.arange(size, device=ids.device))
                head.t2d.zero_()[ids] = True
                # The draft LM head starts from the target's rows of the same tokens.
                head.lm_head.weight.copy_(target.lm_head.weight[ids].to(head.lm_head.weight.dtype))
        head.refresh_vocab_map()  # draft_to_target is a plain attribute: it follows d2t's device only here
        return head

    def feature_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return self.config.feature_layer_ids or default_feature_layers(num_target_layers)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, keys) -> torch.Tensor:
        """One draft step. hidden: [m, 3*H_target] target features or [m, H] the head's own output."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        return self.midlayer(self.embed_tokens(tokens)[None], hidden[None], cos, sin, mask, keys)[0]

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lm_head(self.norm(out)).float(), dim=-1)


CONFIG = Eagle3Config  # the config.json fields of this format
HEAD = Eagle3Head  # the head this format loads into


def matches(keys: set[str]) -> bool:
    return any(k.startswith("midlayer.") for k in keys) or "layers.0.hidden_norm.weight" in keys


def load(folder: Path, raw_config: dict, state: dict, source: Path, target: TargetParts) -> Eagle3Head:
    config = Eagle3Config.from_dict(raw_config, str(folder / "config.json"))
    check_target_fit(config, target, source, feature_size=config.target_hidden_size or config.hidden_size)
    with built_empty():
        head = Eagle3Head(config, target.embed_tokens, own_embedding="embed_tokens.weight" in state)
    if config.draft_vocab_size == config.vocab_size:
        # Equal vocabularies need no map; some checkpoints still carry an all-zero one (EAGLE issue #222).
        for key in ("d2t", "t2d"):
            if key in state and key == "d2t" and state[key].any():
                raise HeadLoadError(f"{source}: d2t is not all zeros although draft and target vocabularies are equal")
            state.pop(key, None)
    optional = () if head.owns_embedding else ("embed_tokens.weight",)
    load_strict(head, state, source, optional=optional, assign=True)
    head = head.to(device=target.device, dtype=target.dtype)
    head.refresh_vocab_map()
    if head.draft_to_target is not None and int(head.draft_to_target.max()) >= config.vocab_size:
        raise HeadLoadError(f"{source}: d2t maps draft ids beyond the target vocabulary ({config.vocab_size})")
    return head.eval()

