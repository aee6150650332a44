"""The packed model: what specchat's fused CPU forward runs, kept in one file, so that a later
start loads it without building transformers' model or importing transformers.

A start through transformers (`specchat.decode.runtime.loading`) reads the bf16 folder (or takes a
GGUF converted in memory: `specchat.converted.InMemory`), converts it, replaces every linear layer
by a quantized one and stacks them; on 2 Zen 3 cores that and the imports it needs took most of a
10-13 s start. Once a target has loaded that way and runs the fused forward (`cpu_decoder`), `save`
writes what that forward reads: the packed layers (q, k and v stacked, gate and up stacked), the
norms, the embedding in the activation dtype, the LM head, the rotary embedding's inverse
frequencies as transformers computed them, and a snapshot of the tokenizer
(`specchat.decode.runtime.tokenizer`). `load` memory-maps it (safetensors maps the file: pages are
read as the forward first touches them) into modules with transformers' names, so `Target` and
`DecoderForward` take it as they take transformers' model: the same operations on the same values,
so the same logits (the tests compare them).

The file is keyed by the model's weights (`sources.source_key`: an embedded model's or a GGUF file's
sha256, a folder's weight files as the quantized layers' cache is), the quantization and the dtype;
inside, by its format, the kernel's layout and sources and the transformers that built it: any of
them changed, the next start goes through transformers again and writes it anew. It is written
atomically (`quantized.save_atomically`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from drafters.layers import RMSNorm
from specchat.decode.options import KERNEL_BITS
from specchat.decode.runtime import cpu_decoder, tokenizer, woq_kernel
from specchat.decode.runtime.machine import cache_dir
from specchat.decode.runtime.quantized import (LAYOUT, PACKED_PARTS, GatedMLP, QuantizedLinear, save_atomically,
                                               shared_projections)
from specchat.decode.runtime.target import ModelSpec, Target, compiles, dtype_name, fixed_steps, note_forced_isa
from specchat.errors import first_line

log = logging.getLogger(__name__)

FORMAT = "specchat-packed-1"  # what `save` writes; a file in another format is written again
# The layers' products, in the order the fused forward takes them (`cpu_decoder.build`).
PRODUCTS = ("qkv", "o_proj", "gate_up", "down_proj")
TOKENIZER = "tokenizer"  # the tokenizer's backend (its tokenizers JSON) as UTF-8 bytes; the rest of it in the metadata


def path(key: str, quantize: str, dtype: torch.dtype) -> Path:
    """Where the packed model of the weights `key` names (`sources.source_key`) is kept, for `quantize`
    and activations in `dtype`."""
    return cache_dir() / "packed" / f"{key}-{quantize}-{dtype_name(dtype)}.safetensors"


def applies(spec: ModelSpec, device: torch.device, quantize: str) -> bool:
    """Whether a target loaded as `spec` says may come from a packed model: specchat's kernel on a
    CPU, nothing compiled, no fixed-shape steps, and no model code from the model's repository
    (that may compute what the packed modules do not)."""
    return (quantize in KERNEL_BITS and device.type == "cpu" and not spec.trust_remote_code
            and not fixed_steps(spec.cuda_graphs, device) and not compiles(spec.compile, device))


def _check(expected: dict[str, str], found: dict[str, str]) -> str | None:
    for key, value in expected.items():
        if found.get(key) != value:
            return f"its {key} is {found.get(key)!r}, not {value!r}"
    return None


def _stamp(bits: int) -> dict[str, str]:
    """What a packed model's bytes depend on besides the model: checked on every load."""
    return {"format": FORMAT, "layout": f"{LAYOUT}-{bits}", "kernel": woq_kernel.source_hash(),
            "transformers": metadata.version("transformers")}


def stale_reason(path: Path) -> str | None:
    """Why no start of this specchat would load the packed model at `path` as it is (its format, layout,
    kernel sources or transformers changed: the next start of its model writes it anew), or None."""
    try:
        with safe_open(path, framework="pt") as handle:
            found = handle.metadata() or {}
    except (OSError, SafetensorError) as error:
        return f"unreadable ({first_line(error)})"
    bits = found.get("layout", "").rpartition("-")[2]
    return _check(_stamp(int(bits)), found) if bits in ("4", "5") else f"its layout is {found.get('layout')!r}"


# ---------------------------------------------------------------------------------------------
# Writing


def unpackable_reason(target: Target) -> str | None:
    """Why `target` cannot be saved as a packed model, or None."""
    forward = target.own_forward
    if forward is None or forward.fused is None:
        return "it does not run specchat's fused CPU forward"
    rope = getattr(forward.rotary_emb, "rope_type", None)
    if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":  # recomputed per length
        return f"its rotary embedding ({rope}) changes with the context's length"
    if not isinstance(target.lm_head, (QuantizedLinear, nn.Linear)):
        return "its LM head is neither a linear layer nor a quantized one"
    if (reason := tokenizer.unsnapshotable_reason(target.tokenizer)) is not None:
        return f"its tokenizer cannot be kept without transformers: {reason}"
    return None


def save(target: Target, destination: Path) -> None:
    """Write `target`, loaded through transformers and running the fused forward, as a packed model."""
    forward, bits = target.own_forward, KERNEL_BITS[target.spec.quantize]
    snapshot = tokenizer.snapshot(target.tokenizer)
    tensors = {"embed_tokens": forward.embed_tokens.weight, "norm": forward.norm.weight,
               "rotary.inv_freq": forward.rotary_emb.inv_freq,
               TOKENIZER: torch.frombuffer(bytearray(snapshot.pop("backend").encode()), dtype=torch.uint8)}
    for index, (layer, projections) in enumerate(zip(forward.layers, forward.projections)):
        attention, prefix = layer.self_attn, f"layers.{index}."
        products = (projections.stacked, attention.o_proj, layer.mlp.gate_up, layer.mlp.down_proj)
        for name, product in zip(PRODUCTS, products):
            tensors.update(_linear_tensors(prefix + name, product))
        norms = ["input_layernorm", "post_attention_layernorm"]
        tensors.update({prefix + norm: getattr(layer, norm).weight for norm in norms})
        if forward.normalizes_heads:
            tensors.update({prefix + norm: getattr(attention, norm).weight for norm in ("q_norm", "k_norm")})
    head = target.lm_head
    if isinstance(head, QuantizedLinear):
        tensors.update(_linear_tensors("lm_head", head))
    else:  # a copy: a head tied to the embedding shares its tensor, which safetensors does not write twice
        tensors.update({f"lm_head.{name}": value.clone() for name, value in (("weight", head.weight),
                                                                            ("bias", head.bias)) if value is not None})
    text = target.config.get_text_config()
    config = PackedConfig(
        model_type=text.model_type, hidden_size=target.hidden_size, num_hidden_layers=target.num_layers,
        num_attention_heads=forward.heads, num_key_value_heads=forward.kv_heads, head_dim=forward.head_dim,
        hidden_act=forward.activation, max_position_embeddings=getattr(text, "max_position_embeddings", None),
        rms_norm_eps=cpu_decoder.epsilon(forward.norm), scaling=forward.scaling,
        attention_scaling=float(forward.rotary_emb.attention_scaling), qkv_sizes=list(forward.projections[0].sizes),
        name_or_path=str(target.model.name_or_path))
    stamp = {**_stamp(bits), "config": json.dumps(dataclasses.asdict(config)), TOKENIZER: json.dumps(snapshot)}
    save_atomically(destination, {name: tensor.detach() for name, tensor in tensors.items()}, stamp)


def _linear_tensors(name: str, layer: QuantizedLinear) -> dict[str, torch.Tensor]:
    tensors = {f"{name}.{part}": value for part, value in layer.packed().items()}
    if layer.bias_term is not None:
        tensors[f"{name}.bias_term"] = layer.bias_term
    return tensors


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class PackedConfig:
    """The fields of a transformers config that specchat's forward and `Target` read (and what the
    packed modules are built with); `get_text_config` as transformers' configs have it."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int | None
    rms_norm_eps: float
    scaling: float  # attention's, the scores' factor
    attention_scaling: float  # the rotary embedding's, cos and sin's factor
    qkv_sizes: list[int]  # the stacked q, k and v projections' widths
    # where it came from (draft heads' caches are keyed by it): the folder transformers loaded it from,
    # or for a model converted in memory, the packed file itself
    name_or_path: str

    def get_text_config(self) -> PackedConfig:
        return self


class Rotary(nn.Module):
    """transformers' rotary embedding for the Llama family (`LlamaRotaryEmbedding.forward`, and
    Qwen2's, Qwen3's and Mistral's, which are the same): the same operations, on the inverse
    frequencies its own initialisation computed (saved with the packed model), give the same cos
    and sin."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    """An attention's parts under transformers' names: q, k and v sharing one stacked product
    (`quantized.SharedProjection`), o, the scores' scaling, and Qwen3's per-head norms."""

    def __init__(self, qkv: QuantizedLinear, o_proj: QuantizedLinear, sizes: list[int], scaling: float,
                 head_norms: tuple[RMSNorm, RMSNorm] | None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = shared_projections(qkv, sizes)
        self.o_proj, self.scaling = o_proj, scaling
        if head_norms is not None:  # only Qwen3's: `DecoderForward` asks whether the attention has them
            self.q_norm, self.k_norm = head_norms


class Layer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: GatedMLP, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm


class Decoder(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding, layers: list[Layer], norm: RMSNorm, rotary_emb: Rotary):
        super().__init__()
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = embed_tokens, nn.ModuleList(layers), norm, rotary_emb


class PackedModel(nn.Module):
    """A causal LM with the parts of transformers' Llama family that `Target` and `DecoderForward`
    read, under the same names."""

    def __init__(self, config: PackedConfig, decoder: Decoder, lm_head: nn.Module):
        super().__init__()
        self.config, self.model, self.lm_head = config, decoder, lm_head
        self.name_or_path = config.name_or_path

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def load(source: Path, spec: ModelSpec, dtype: torch.dtype, quantize: str) -> Target | None:
    """The target from the packed model at `source`, or None where there is none to use (absent,
    damaged, or made by another format, kernel or transformers: `save` then writes it again)."""
    try:
        with safe_open(source, framework="pt") as handle:  # memory-mapped: nothing is read yet
            stamp = handle.metadata() or {}
            problem = _check(_stamp(KERNEL_BITS[quantize]), stamp)
            tensors = {key: handle.get_tensor(key) for key in handle.keys()} if problem is None else {}
    except FileNotFoundError:
        return None
    except (OSError, SafetensorError) as error:
        log.info(f"the packed model {source.name} cannot be read ({error}): making it again")
        return None
    if problem is not None:
        log.info(f"the packed model {source.name} is out of date ({problem}): making it again")
        return None
    try:
        config = PackedConfig(**json.loads(stamp["config"]))
        model = _modules(config, tensors, dtype)
        snapshot = {**json.loads(stamp[TOKENIZER]), "backend": bytes(tensors.pop(TOKENIZER).numpy()).decode()}
    except (KeyError, TypeError, ValueError) as error:  # a file of ours that says something else: made again
        log.info(f"the packed model {source.name} does not hold what it should ({error}): making it again")
        return None
    if tensors:
        log.info(f"the packed model {source.name} holds tensors nothing reads ({', '.join(sorted(tensors)[:3])}): "
                 f"making it again")
        return None
    target = Target(model, tokenizer.SnapshotTokenizer(snapshot), name=spec.model,
                    spec=dataclasses.replace(spec, quantize=quantize))
    note_forced_isa(target)
    return target


def _modules(config: PackedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> PackedModel:
    """The packed model's modules over `tensors`, taking each tensor out as it is used (what is left
    was not read); a tensor missing raises KeyError, one of another dtype ValueError."""
    embedding = tensors.pop("embed_tokens")
    if embedding.dtype != dtype:
        raise ValueError(f"the embedding is {dtype_name(embedding.dtype)}, not {dtype_name(dtype)}")

    def norm(name: str, size: int = config.hidden_size) -> RMSNorm:
        module = RMSNorm(size, config.rms_norm_eps)
        module.weight = nn.Parameter(tensors.pop(name), requires_grad=False)
        return module

    def linear(name: str) -> QuantizedLinear:
        packed = {part: tensors.pop(f"{name}.{part}") for part in PACKED_PARTS}
        return QuantizedLinear.from_packed(packed, tensors.pop(f"{name}.bias_term", None), dtype)

    layers = []
    for index in range(config.num_hidden_layers):
        prefix = f"layers.{index}."
        qkv, o_proj, gate_up, down_proj = (linear(prefix + name) for name in PRODUCTS)
        heads_normed = f"{prefix}q_norm" in tensors
        head_norms = (norm(prefix + "q_norm", config.head_dim), norm(prefix + "k_norm", config.head_dim)) \
            if heads_normed else None
        attention = Attention(qkv, o_proj, config.qkv_sizes, config.scaling, head_norms)
        layers.append(Layer(attention, GatedMLP(gate_up, down_proj, nn.SiLU()), norm(prefix + "input_layernorm"),
                            norm(prefix + "post_attention_layernorm")))
    decoder = Decoder(nn.Embedding.from_pretrained(embedding, freeze=True), layers, norm("norm"),
                      Rotary(tensors.pop("rotary.inv_freq"), config.attention_scaling))
    if "lm_head.low" in tensors:
        lm_head = linear("lm_head")
    else:
        weight = tensors.pop("lm_head.weight")
        lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias="lm_head.bias" in tensors, dtype=weight.dtype,
                            device="meta")
        lm_head.weight = nn.Parameter(weight, requires_grad=False)
        if lm_head.bias is not None:
            lm_head.bias = nn.Parameter(tensors.pop("lm_head.bias"), requires_grad=False)
    return PackedModel(config, decoder, lm_head)
