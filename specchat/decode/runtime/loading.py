"""Loading the target from a Hugging Face folder onto a device in a dtype: specchat's quantized
layers (or bitsandbytes'), one-query attention on a CPU, and the runtime it then runs on
(`specchat.decode.runtime.target`). Every choice that is not the fastest here is said in one line.

Where the folder comes from (an embedded model, a GGUF file converted once, the hub) is
`specchat.sources`'s business; this module takes the folder as given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import pickle
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging as transformers_logging

from drafters.attention import grouped
from specchat.decode.runtime import quantized, woq_kernel
from specchat.decode.runtime.forward import unsupported_reason
from specchat.decode.runtime.machine import cache_dir, cpu_has_bf16
from specchat.decode.options import AUTO, BITSANDBYTES, KERNEL_BITS, QUANTIZE
from specchat.decode.runtime.target import ModelSpec, Target, compiles, describe_runtime, dtype_name, fixed_steps
from specchat.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ATTENTION = "specchat_sdpa"  # transformers' SDPA, but grouped matrix products on a CPU (drafters.attention)


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


def quiet_transformers() -> None:
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


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
    if quantize in KERNEL_BITS:
        try:
            quantized.quantize_linears(model, KERNEL_BITS[quantize], quantized_cache(source, quantize))
        except (woq_kernel.KernelUnavailable, ValueError) as error:
            raise ModelLoadError(f"--quantize {quantize}: {error}") from error
    target = Target(model, tokenizer, name=spec.model, spec=dataclasses.replace(spec, quantize=quantize))
    if quantize in KERNEL_BITS and woq_kernel.forced_isa() not in (None, woq_kernel.runnable_isas()[0]):
        log.warning(f"{target.runtime}: {woq_kernel.ISA_VARIABLE} forces the path (this CPU's best: "
                    f"{woq_kernel.runnable_isas()[0]})")
    if spec.compile == "on" and not target.compiled:
        log.warning(f"--compile on, but {unsupported_reason(model)}: transformers' forward runs uncompiled")
    if fixed_steps(spec.cuda_graphs, device) and target.envelope is None:  # said, not silent: eager steps are slow
        log.warning(f"no CUDA graphs: {unsupported_reason(model)}; transformers' forward runs eagerly")
    elif spec.cuda_graphs == "on" and not target.captures:
        log.warning("--cuda-graphs on without a CUDA device: the fixed-shape steps run eagerly")
    if target.captures and (reason := target.capture_failure()) is not None:  # said at start-up, not silent
        target.captures = False
        target.runtime = target.runtime.replace("CUDA graphs", "fixed-shape steps (eager)")
        log.warning(f"no CUDA graphs for {describe_runtime(quantize, device, target.dtype)} ({reason}): the "
                    f"fixed-shape steps run eagerly")
    if target.compiled and target.envelope is None:
        target.warm_up()
    elif target.compiled:  # the envelope's steps: each shape (a bucket) compiles in its first, uncaptured run
        log.info("compiling the fixed-shape steps' forward as each step first runs (cached afterwards)")
    return target


KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the activations specchat's kernel takes


def kernel_candidate(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `spec` asks for specchat's kernel here, before knowing whether it compiles: named
    (int5/int4), or `auto` on a CPU with kernel activations, unless float32 was asked for (an
    explicit `--dtype float32` keeps its float32 weights: that is how exactness is checked)."""
    if spec.quantize in KERNEL_BITS:
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
        if choice in KERNEL_BITS and (device.type != "cpu" or dtype not in KERNEL_DTYPES):
            raise ModelLoadError(f"--quantize {choice} runs on a CPU with --dtype bfloat16 or float32 (got "
                                 f"{device.type}, {dtype_name(dtype)})")
        if device.type == "cpu" and choice not in KERNEL_BITS and not woq_kernel.missing_cpu_features():
            log.warning(f"--quantize {choice} as asked; --quantize auto (int5, specchat's kernel) decodes "
                        f"faster on this CPU")
        return choice
    if not kernel_candidate(spec, device, dtype):
        return "none"
    reason = woq_kernel.unavailable_reason()
    if reason is not None:  # said, not silent: plain weights decode several times slower
        log.warning(f"{dtype_name(dtype)} weights, not the 5-bit kernel ({reason}): decoding is several times "
                    f"slower")
        return "none"
    return "int5"


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

