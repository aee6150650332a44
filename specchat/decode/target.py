"""The target model at run time: loading it from a Hugging Face folder onto a device in a dtype
(with specchat's quantized layers and one-query attention on a CPU), and the one forward pass the
engine asks of it.

Where the folder comes from (an embedded model, a GGUF file converted once, the hub) is
`specchat.sources`'s business; this module takes the folder as given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging as transformers_logging

from drafters.attention import grouped
from specchat.decode import quantized
from specchat.decode.cache import KVCache, causal_mask
from specchat.decode.forward import DecoderForward, LayerKV, unsupported_reason
from specchat.decode.graphs import capture_failure
from specchat.decode.machine import cache_dir, cpu_has_bf16, synchronize
from specchat.decode.envelope import Envelope
from specchat.decode.options import AUTO, BITSANDBYTES, COMPILE, CUDA_GRAPHS, QUANTIZE
from specchat.errors import ModelLoadError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ATTENTION = "specchat_sdpa"  # transformers' SDPA, but grouped matrix products on a CPU (drafters.attention)


@dataclass(frozen=True)
class ModelSpec:
    """Where the target comes from and how to load it."""

    model: str  # embedded name, .gguf path, local folder or hub id
    gguf_file: str | None = None  # a GGUF file inside the folder / hub repo named by `model`
    dtype: str = AUTO  # auto | bfloat16 | float16 | float32
    device: str = AUTO  # auto | cpu | cuda | cuda:N
    quantize: str = AUTO  # auto | none | int5 | int4 (specchat's kernel) | 8bit | 4bit (bitsandbytes)
    compile: str = AUTO  # auto | on | off: torch.compile the target's forward (`compiles`)
    cuda_graphs: str = AUTO  # auto | on | off: decode on the fixed envelope, captured (`fixed_steps`)
    trust_remote_code: bool = False


def resolve_device(name: str) -> torch.device:
    if name == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ModelLoadError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name} was asked for but this torch build sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == AUTO:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def fixed_steps(choice: str, device: torch.device) -> bool:
    """Whether `--cuda-graphs choice` decodes on the fixed envelope (`specchat.decode.envelope`),
    whose steps are captured as CUDA graphs on `device`. auto: on CUDA, where a small model's eager
    step is launch-bound (the 0.5B: ~40 ms per token on an H100, docs/bench-gpu); on a CPU, `on`
    runs the same fixed-shape steps eagerly (for tests: a CPU has no graphs and pays for padding)."""
    if choice not in CUDA_GRAPHS:
        raise ModelLoadError(f"unknown --cuda-graphs {choice!r} (use {', '.join(CUDA_GRAPHS)})")
    return choice == "on" or (choice == AUTO and device.type == "cuda")


def compiles(choice: str, device: torch.device, fixed: bool = False) -> bool:
    """Whether `--compile choice` compiles the target's forward on `device`. auto: on CUDA without
    the fixed envelope (`fixed`: its captured graphs already save the launches), where they are
    most of a small model's step; not on a CPU, where the compiled forward measured slower (2-core
    Zen 4, AVX2 kernel, float32, Qwen2.5-0.5B int5: 22.6 ms per token against 19.5 eager and 20.2
    for transformers' forward), after ~2 minutes of compiling. `on` with the fixed envelope is
    refused: it compiles the variable-shape forward, which the envelope does not run."""
    if choice not in COMPILE:
        raise ModelLoadError(f"unknown --compile {choice!r} (use {', '.join(COMPILE)})")
    if choice == "on" and fixed:
        raise ModelLoadError("--compile on compiles the variable-shape forward; with --cuda-graphs (auto on CUDA) "
                             "the fixed-shape steps are captured instead: add --cuda-graphs off to compile")
    return choice == "on" or (choice == AUTO and device.type == "cuda" and not fixed)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quiet_transformers() -> None:
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [n, vocab] for the positions asked for
    features: torch.Tensor | None  # [n_tokens, feature_size] for every input position


class Target:
    """A causal LM that the engine decodes with and verifies drafts against.

    Wraps a transformers `*ForCausalLM`: the decoder stack and the LM head are called
    separately, so logits are computed only where they are needed. The decoder stack is
    specchat's own forward (`specchat.decode.forward`, compiled or not, with its `LayerKV` cache)
    for the families it computes, transformers' otherwise (with `KVCache`); `new_cache` gives
    the cache that goes with it.
    """

    def __init__(self, model, tokenizer, name: str, spec: ModelSpec | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.spec = spec or ModelSpec(model=name)  # how it was loaded
        self.config = model.config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()  # an nn.Linear, or a quantized one
        embedding = model.get_input_embeddings().weight
        self.device, self.dtype = embedding.device, embedding.dtype
        self.runtime = describe_runtime(self.spec.quantize, self.device, self.dtype)  # what runs it, said to the user
        text_config = self.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.hidden_size = text_config.hidden_size
        self.vocab_size = self.lm_head.out_features
        self.max_context = getattr(text_config, "max_position_embeddings", None) or 4096
        fixed = fixed_steps(self.spec.cuda_graphs, self.device) and not unsupported_reason(model)
        self.own_forward = None if unsupported_reason(model) else DecoderForward(
            model, compile=compiles(self.spec.compile, self.device, fixed))
        self.compiled = self.own_forward is not None and self.own_forward.compiled
        if self.compiled:
            self.runtime += ", compiled forward"
        # The fixed envelope (specchat.decode.fixed_engine), captured as CUDA graphs where there is CUDA.
        self.envelope = self._envelope() if fixed else None
        self.captures = fixed and self.device.type == "cuda"
        if self.envelope is not None:
            self.runtime += ", CUDA graphs" if self.captures else ", fixed-shape steps (eager)"
        self.compile_seconds = 0.0  # spent compiling at load (`warm_up`), reported apart from decoding
        self.capture_seconds = 0.0  # spent capturing steps as CUDA graphs (`specchat.decode.graphs`), likewise

    def _envelope(self) -> Envelope:
        """Room in the cache for the model's context, or for what a share of the GPU's free memory holds."""
        forward = self.own_forward
        per_position = 2 * len(forward.layers) * forward.kv_heads * forward.head_dim * self.dtype.itemsize
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        try:
            return Envelope.for_target(self.max_context, per_position, free)
        except ValueError as error:
            raise ModelLoadError(f"--cuda-graphs: {error} (free GPU memory: {free})") from error

    @torch.inference_mode()
    def capture_failure(self) -> str | None:
        """Why the target's forward cannot be captured as a CUDA graph (its layers read the host:
        bitsandbytes' 8-bit matmul checks its outliers there), or None: one token on a scratch cache."""
        cache = self.new_cache(capacity=1)
        at = torch.zeros(1, dtype=torch.long, device=self.device)
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        return capture_failure(lambda: self.forward_at(at[None], cache, positions=at[None], mask=mask, slots=at, span=1))

    def new_cache(self, capacity: int | None = None) -> LayerKV | KVCache:
        """An empty KV cache for `forward`; with `capacity`, allocated at that size once (`forward_at`)."""
        if capacity is not None:
            assert self.own_forward is not None, "a fixed-capacity cache needs specchat's own forward"
            return self.own_forward.new_cache(capacity)
        return self.own_forward.new_cache() if self.own_forward is not None else KVCache()

    @torch.inference_mode()
    def warm_up(self, tokens: int = 4) -> None:
        """Compile the forward for the shapes decoding takes (a prefill, one token, a verified tree)
        now rather than in the first reply, and keep the seconds in `compile_seconds`."""
        print("specchat: compiling the target's forward (once per shape; cached afterwards)...", file=sys.stderr)
        start = time.perf_counter()
        cache = self.new_cache()
        ids = list(range(1, tokens + 1))
        self.forward(torch.tensor([ids], device=self.device), cache, logits_for="last")  # a prefill from an empty cache
        self.forward(torch.tensor([ids[:1]], device=self.device), cache, logits_for="last")  # plain decoding
        cached = cache.length
        positions = torch.arange(cached, cached + tokens, device=self.device)[None]
        mask = causal_mask(cached, tokens, self.device)
        self.forward(torch.tensor([ids], device=self.device), cache, positions=positions, mask=mask,
                     logits_for="all")  # a tree's verification
        synchronize(self.device)
        self.compile_seconds += time.perf_counter() - start

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_for: str = "all",
        feature_layers: tuple[int, ...] | None = None,
    ) -> TargetOutput:
        """Run the target on `input_ids` ([1, n]) on top of `cache` (which it extends by n).

        Args:
            positions: [1, n] position ids; default: right after the cached ones.
            mask: [1, 1, n, cached + n] boolean attention mask (True = may attend); default causal.
            logits_for: "all" positions, the "last" one, or "none".
            feature_layers: hidden-state indices to return, concatenated, as the drafter's features
                (0 = embeddings, i = output of layer i-1, num_layers = the final normed state).
        """
        if self.own_forward is not None:
            final, parts = self.own_forward(input_ids, cache, positions, mask, tuple(feature_layers or ()))
        else:
            final, parts = self._transformers_forward(input_ids, cache, positions, mask, feature_layers)
        return self._output(final, parts, logits_for)

    @torch.inference_mode()
    def forward_at(self, input_ids: torch.Tensor, cache: LayerKV, *, positions: torch.Tensor, mask: torch.Tensor,
                   slots: torch.Tensor, span: int, logits_for: str | int = "all",
                   feature_layers: tuple[int, ...] | None = None) -> TargetOutput:
        """The fixed envelope's forward (`DecoderForward.at`): entries written to `slots`, attention over
        the first `span` positions of `cache` as `mask` allows; the cache's length is not changed.
        `logits_for` may also be a row index (the last real row of a padded prefill)."""
        final, parts = self.own_forward.at(input_ids, cache, positions, mask, slots, span, tuple(feature_layers or ()))
        return self._output(final, parts, logits_for)

    def _output(self, final: torch.Tensor, parts: list[torch.Tensor], logits_for: str | int) -> TargetOutput:
        features = None
        if parts:
            features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        logits = None
        if logits_for == "all":
            logits = self.lm_head(final)
        elif logits_for == "last":
            logits = self.lm_head(final[-1:])
        elif isinstance(logits_for, int):
            logits = self.lm_head(final[logits_for : logits_for + 1])
        return TargetOutput(logits=logits, features=features)

    def _transformers_forward(self, input_ids, cache: KVCache, positions, mask, feature_layers):
        select = [i for i in (feature_layers or ()) if i != self.num_layers]
        out = self.decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, output_hidden_states=select or False,
        )
        final = out.last_hidden_state[0]
        return final, [final if i == self.num_layers else out.hidden_states[i][0] for i in feature_layers or ()]


def load_folder(source: str, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Target:
    """The model in the Hugging Face folder `source` and its tokenizer, on `device` in `dtype`,
    quantized as `spec` says."""
    if spec.quantize not in QUANTIZE:
        raise ModelLoadError(f"unknown --quantize {spec.quantize!r} (use {', '.join(QUANTIZE)})")
    quantize = resolve_quantize(spec, device, dtype)
    compiles(spec.compile, device, fixed_steps(spec.cuda_graphs, device))  # a bad choice is said before the model loads
    quiet_transformers()
    kwargs = dict(dtype=dtype, trust_remote_code=spec.trust_remote_code)
    if quantize in BITSANDBYTES:
        kwargs["quantization_config"] = _bitsandbytes_config(quantize, dtype)
        kwargs["device_map"] = {"": device}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except pickle.UnpicklingError as error:  # torch's text is advice on turning the protection off: not ours
        raise ModelLoadError(f"cannot load the model from {source}: a pickled weights file holds more than tensors; "
                             f"specchat reads pickles only with weights_only=True") from error
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the model from {source}: {first_line}") from error
    if quantize not in BITSANDBYTES:
        model = model.to(device)
    if device.type == "cpu" and model.config._attn_implementation == "sdpa":
        # SDPA but for one query token, which it runs several times too slowly on a CPU; a model
        # whose attention does not go through transformers' interface keeps SDPA (it only warns).
        model.set_attn_implementation(ATTENTION)
    if quantize in quantized.KERNEL_BITS:
        try:
            quantized.quantize_linears(model, quantized.KERNEL_BITS[quantize], quantized_cache(source, quantize))
        except (quantized.KernelUnavailable, ValueError) as error:
            raise ModelLoadError(f"--quantize {quantize}: {error}") from error
    target = Target(model, tokenizer, name=spec.model, spec=dataclasses.replace(spec, quantize=quantize))
    if quantize in quantized.KERNEL_BITS and quantized.forced_isa():
        print(f"specchat: {target.runtime}: {quantized.ISA_VARIABLE} forces the path (this CPU's best: "
              f"{quantized.runnable_isas()[0]})", file=sys.stderr)
    if spec.compile == "on" and not target.compiled:
        print(f"specchat: --compile on, but {unsupported_reason(model)}: transformers' forward runs uncompiled",
              file=sys.stderr)
    if fixed_steps(spec.cuda_graphs, device) and target.envelope is None:  # said, not silent: eager steps are slow
        print(f"specchat: no CUDA graphs: {unsupported_reason(model)}; transformers' forward runs eagerly",
              file=sys.stderr)
    elif spec.cuda_graphs == "on" and not target.captures:
        print("specchat: --cuda-graphs on without a CUDA device: the fixed-shape steps run eagerly", file=sys.stderr)
    if target.captures and (reason := target.capture_failure()) is not None:  # said at start-up, not silent
        target.captures = False
        target.runtime = target.runtime.replace("CUDA graphs", "fixed-shape steps (eager)")
        print(f"specchat: no CUDA graphs for {describe_runtime(quantize, device, target.dtype)} ({reason}): the "
              f"fixed-shape steps run eagerly", file=sys.stderr)
    if target.compiled:
        target.warm_up()
    return target


KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the activations specchat's kernel takes


def kernel_candidate(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `spec` asks for specchat's kernel here, before knowing whether it compiles: named
    (int5/int4), or `auto` on a CPU with kernel activations, unless float32 was asked for (an
    explicit `--dtype float32` keeps its float32 weights: that is how exactness is checked)."""
    if spec.quantize in quantized.KERNEL_BITS:
        return True
    return spec.quantize == AUTO and device.type == "cpu" and dtype in KERNEL_DTYPES and spec.dtype != "float32"


def resolve_quantize(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: specchat's 5-bit kernel where `kernel_candidate` and the kernel runs, else the dtype's
    own weights; any choice that is not the fastest here is said in one line.

    Measured on 2 cores of an AMD EPYC (Zen 4; docs/cpu-runtime.md): on the AVX-512 path the 0.5B
    decodes in ~16 ms per token against ~51 in bf16, and verifying 8 tokens costs ~1.4x one; on
    the AVX2 path (float32 activations) plain decoding matches llama.cpp built for AVX2, where
    torch's own float32 layers cost 135 ms per token, but 8 rows of the kernel cost 3.2x one.
    """
    choice = spec.quantize
    if choice != AUTO:
        if choice in quantized.KERNEL_BITS and (device.type != "cpu" or dtype not in KERNEL_DTYPES):
            raise ModelLoadError(f"--quantize {choice} runs on a CPU with --dtype bfloat16 or float32 (got "
                                 f"{device.type}, {dtype_name(dtype)})")
        if device.type == "cpu" and choice not in quantized.KERNEL_BITS and not quantized.missing_cpu_features():
            print(f"specchat: --quantize {choice} as asked; --quantize auto (int5, specchat's kernel) decodes "
                  f"faster on this CPU", file=sys.stderr)
        return choice
    if not kernel_candidate(spec, device, dtype):
        return "none"
    reason = quantized.unavailable_reason()
    if reason is not None:  # said, not silent: plain weights decode several times slower
        print(f"specchat: {dtype_name(dtype)} weights, not the 5-bit kernel ({reason}): decoding is several times "
              f"slower", file=sys.stderr)
        return "none"
    return "int5"


def describe_runtime(quantize: str, device: torch.device, dtype: torch.dtype) -> str:
    """What runs the target, for start-up lines, /stats, run records and bench results."""
    if quantize in quantized.KERNEL_BITS:
        forced = " (forced)" if quantized.forced_isa() else ""
        return f"{quantize} weights, {quantized.kernel_isa()}{forced} kernel, {dtype_name(dtype)} activations"
    if quantize in BITSANDBYTES:
        return f"bitsandbytes {quantize} weights, {dtype_name(dtype)} compute, {device.type}"
    return f"{dtype_name(dtype)} weights, {device.type}"


def quantized_cache(source: str | Path, quantize: str, loaded_on: Target | None = None) -> Path:
    """Where the packed layers of a model or draft-head folder are kept, keyed by its weight files;
    a draft head's also by the target it was loaded on (its LM-head rows may be the target's)."""
    files = sorted(Path(source).glob("*.safetensors")) + sorted(Path(source).glob("*.bin"))
    key = json.dumps([str(source)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
                     + ([quantized_cache(loaded_on.model.name_or_path, quantize).name] if loaded_on else []))
    return cache_dir() / "quantized" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}-{quantize}.safetensors"


def _bitsandbytes_config(quantize: str, dtype: torch.dtype):
    if importlib.util.find_spec("bitsandbytes") is None:  # say so here rather than deep inside loading
        raise ModelLoadError(f"--quantize {quantize} needs bitsandbytes: pip install bitsandbytes")
    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """transformers' attention-function signature; SDPA's own function for what `grouped` does not cover."""
    plain = dropout == 0.0 and all(kwargs.get(name) is None for name in ("softcap", "s_aux", "sinks", "position_bias"))
    # no mask with several queries means causal (`grouped`'s rule) for a decoder's attention
    plain = plain and (attention_mask is not None or query.shape[2] == 1 or getattr(module, "is_causal", False))
    if query.device.type != "cpu" or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return grouped(query, key, value, attention_mask, scale).transpose(1, 2), None


AttentionInterface.register(ATTENTION, attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
