"""Loading the target from a Hugging Face folder onto a device in a dtype: specchat's quantized
layers (or bitsandbytes'), one-query attention on a CPU, and the runtime it then runs on
(`specchat.decode.runtime.target`). Every choice that is not the fastest here is said in one line.

Where the folder comes from (an embedded model, a GGUF file converted once, the hub) is
`specchat.sources`'s business; this module takes the folder as given.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
from specchat.decode.options import BITSANDBYTES, KERNEL_BITS
from specchat.decode.runtime.quantized import quantized_cache
from specchat.decode.runtime.target import ModelSpec, Target, compiles, describe_runtime, fixed_steps, note_forced_isa
from specchat.errors import ModelLoadError, first_line

log = logging.getLogger(__name__)

ATTENTION = "specchat_sdpa"  # transformers' SDPA, but grouped matrix products on a CPU (drafters.attention)


def quiet_transformers() -> None:
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def load_folder(source: str, spec: ModelSpec, device: torch.device, dtype: torch.dtype, quantize: str,
                keep_quantized: bool = True) -> Target:
    """The model in the Hugging Face folder `source` and its tokenizer, on `device` in `dtype`, its
    weights as `quantize` (`spec.quantize` resolved: `target.resolve_quantize`) says; specchat's
    quantized layers kept beside the folder's weights for later loads where `keep_quantized`."""
    compiles(spec.compile, device)  # a bad choice is said before the model loads
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
        raise ModelLoadError(f"cannot load the model from {source}: {first_line(error)}") from error
    return load_model(model, tokenizer, spec, device, quantize, quantized_cache(source, quantize) if keep_quantized
                      else None)


def load_model(model, tokenizer, spec: ModelSpec, device: torch.device, quantize: str,
               cache: Path | None = None) -> Target:
    """transformers' `model` (loaded in the target's dtype) and `tokenizer` as the target, on `device`, its
    weights as `quantize` says (specchat's quantized layers kept in the file `cache` where one is given)."""
    if quantize not in BITSANDBYTES:
        model = model.to(device)
    if device.type == "cpu" and model.config._attn_implementation == "sdpa":
        # SDPA but for one query token, which it runs several times too slowly on a CPU; a model
        # whose attention does not go through transformers' interface keeps SDPA (it only warns).
        model.set_attn_implementation(ATTENTION)
    if quantize in KERNEL_BITS:
        try:
            quantized.quantize_linears(model, KERNEL_BITS[quantize], cache, say_packing=True)
        except (woq_kernel.KernelUnavailable, ValueError) as error:
            raise ModelLoadError(f"--quantize {quantize}: {error}") from error
    target = Target(model, tokenizer, name=spec.model, spec=dataclasses.replace(spec, quantize=quantize))
    note_forced_isa(target)
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
