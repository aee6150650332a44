"""The target model at run time: the one forward pass the engine asks of it, on the runtime its
loading chose (specchat's own forward, compiled or not, or on the fixed envelope; transformers'
forward otherwise), and how that choice is made and described: device, dtype, weights, compiled
or not, decided before anything loads.

Loading it is `specchat.decode.runtime.loading`'s (a Hugging Face folder, through transformers) or
`specchat.decode.runtime.packed`'s (specchat's packed file, without transformers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specchat.decode.runtime import woq_kernel
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.runtime.envelope import Envelope
from specchat.decode.runtime.forward import DecoderForward, LayerKV, unsupported_reason
from specchat.decode.runtime.graphs import capture_failure
from specchat.decode.runtime.machine import cpu_has_bf16, synchronize
from specchat.decode.options import AUTO, BITSANDBYTES, COMPILE, CUDA_GRAPHS, KERNEL_BITS, QUANTIZE
from specchat.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the activations specchat's kernel takes


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


def fixed_steps(choice: str, device: torch.device) -> bool:
    """Whether `--cuda-graphs choice` decodes on the fixed envelope (`specchat.decode.runtime.envelope`),
    whose steps are captured as CUDA graphs on `device`. auto: on CUDA, where a small model's eager
    step is launch-bound (the 0.5B: ~40 ms per token on an H100, docs/bench-gpu); on a CPU, `on`
    runs the same fixed-shape steps eagerly (for tests: a CPU has no graphs and pays for padding)."""
    if choice not in CUDA_GRAPHS:
        raise ModelLoadError(f"unknown --cuda-graphs {choice!r} (use {', '.join(CUDA_GRAPHS)})")
    return choice == "on" or (choice == AUTO and device.type == "cuda")


def compiles(choice: str, device: torch.device) -> bool:
    """Whether `--compile choice` compiles the target's forward on `device`. auto: on CUDA, on either
    layout, where launches are most of a small model's eager step; not on a CPU, where the compiled
    forward measured slower (2-core Zen 4, AVX2 kernel, float32, Qwen2.5-0.5B int5: 22.6 ms per
    token against 19.5 eager and 20.2 for transformers' forward), after ~2 minutes of compiling. On
    the fixed envelope it compiles the forward its steps run (and the draft head's layer:
    `heads.FixedHead`), which are then captured with inductor's fused kernels inside: on an H200 a
    plain step of the 0.5B's shape took 1.56 ms against 2.55 eager, a head cycle 3.84 against 6.15
    (docs/bench-gpu/h200-block4/), after under a minute of compiling, and greedy answers stayed
    those of the eager steps (the CUDA tests)."""
    if choice not in COMPILE:
        raise ModelLoadError(f"unknown --compile {choice!r} (use {', '.join(COMPILE)})")
    return choice == "on" or (choice == AUTO and device.type == "cuda")


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


def kernel_candidate(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `spec` asks for specchat's kernel here, before knowing whether it compiles: named
    (int5/int4), or `auto` on a CPU with kernel activations, unless float32 was asked for (an
    explicit `--dtype float32` keeps its float32 weights: that is how exactness is checked)."""
    if spec.quantize in KERNEL_BITS:
        return True
    return spec.quantize == AUTO and device.type == "cpu" and dtype in KERNEL_DTYPES and spec.dtype != "float32"


def kernel_quantize(spec: ModelSpec) -> str:
    """The kernel's quantization `spec` asks for where the kernel runs: the one named, else int5 (auto's)."""
    return spec.quantize if spec.quantize in KERNEL_BITS else "int5"


def resolve_quantize(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: specchat's 5-bit kernel where `kernel_candidate` and the kernel runs, else the dtype's
    own weights; any choice that is not the fastest here is said in one line.

    Measured on 2 cores of an AMD EPYC (Zen 4; docs/cpu-runtime.md): on the AVX-512 path the 0.5B
    decodes in ~16 ms per token against ~51 in bf16, and verifying 8 tokens costs ~1.4x one; on
    the AVX2 path (float32 activations) plain decoding matches llama.cpp built for AVX2, where
    torch's own float32 layers cost 135 ms per token, but 8 rows of the kernel cost 3.2x one.
    """
    choice = spec.quantize
    if choice not in QUANTIZE:
        raise ModelLoadError(f"unknown --quantize {choice!r} (use {', '.join(QUANTIZE)})")
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
    return kernel_quantize(spec)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_runtime(quantize: str, device: torch.device, dtype: torch.dtype) -> str:
    """What runs the target, for start-up lines, /stats, run records and bench results."""
    if quantize in KERNEL_BITS:
        forced = " (forced)" if woq_kernel.forced_isa() else ""
        return f"{quantize} weights, {woq_kernel.kernel_isa()}{forced} kernel, {dtype_name(dtype)} activations"
    if quantize in BITSANDBYTES:
        return f"bitsandbytes {quantize} weights, {dtype_name(dtype)} compute, {device.type}"
    return f"{dtype_name(dtype)} weights, {device.type}"


def note_forced_isa(target: Target) -> None:
    """Say in one line where $SPECCHAT_CPU_ISA makes the kernel run a path other than this CPU's best."""
    if target.spec.quantize in KERNEL_BITS and woq_kernel.forced_isa() not in (None, woq_kernel.runnable_isas()[0]):
        log.warning(f"{target.runtime}: {woq_kernel.ISA_VARIABLE} forces the path (this CPU's best: "
                    f"{woq_kernel.runnable_isas()[0]})")


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [n, vocab] for the positions asked for
    features: torch.Tensor | None  # [n_tokens, feature_size] for every input position
    # Where the forward's time went, when the target is `profiling` (products: the kernel's, the LM head's included)
    products_seconds: float = 0.0
    attention_seconds: float = 0.0


@dataclass(frozen=True)
class ForwardTimes:
    """A step's target forward: its wall time and, with the target `profiling`, its products' and
    attention's parts (`specchat bench --breakdown`)."""

    forward_seconds: float = 0.0
    products_seconds: float = 0.0
    attention_seconds: float = 0.0

    @staticmethod
    def of(out: TargetOutput, seconds: float) -> ForwardTimes:
        return ForwardTimes(seconds, out.products_seconds, out.attention_seconds)


class Target:
    """A causal LM that the engine decodes with and verifies drafts against.

    Wraps a transformers `*ForCausalLM`, or specchat's packed model, which has the parts specchat's
    forward calls under the same names (`specchat.decode.runtime.packed`): the decoder stack and
    the LM head are called separately, so logits are computed only where they are needed. The decoder stack is
    specchat's own forward (`specchat.decode.runtime.forward`, compiled or not, with its `LayerKV` cache)
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
            model, compile=compiles(self.spec.compile, self.device))
        self.compiled = self.own_forward is not None and self.own_forward.compiled
        if self.compiled:
            self.runtime += ", compiled forward"
        # The fixed layout (specchat.decode.engine.fixed), captured as CUDA graphs where there is CUDA.
        self.envelope = self._envelope() if fixed else None
        self.captures = fixed and self.device.type == "cuda"
        if self.envelope is not None:
            self.runtime += ", CUDA graphs" if self.captures else ", fixed-shape steps (eager)"
            self.max_context = self.envelope.max_context  # its cache holds no more (GPU memory may bound it)
        self.profiling = False  # time each forward's products and attention (`specchat bench --breakdown`)
        self.compile_seconds = 0.0  # spent compiling at load (`warm_up`), reported apart from decoding
        self.capture_seconds = 0.0  # spent capturing steps as CUDA graphs (`specchat.decode.runtime.graphs`), likewise

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

    def new_cache(self, capacity: int | None = None) -> LayerKV:
        """An empty KV cache for `forward` (a `transformers_cache.KVCache` for transformers' forward); with
        `capacity`, allocated at that size once (`forward_at`)."""
        if capacity is not None:
            assert self.own_forward is not None, "a fixed-capacity cache needs specchat's own forward"
            return self.own_forward.new_cache(capacity)
        if self.own_forward is not None:
            return self.own_forward.new_cache()
        # transformers' cache class, imported where transformers' forward runs: a target on specchat's
        # forward (a start from the packed model among them) imports no transformers
        from specchat.decode.runtime.transformers_cache import KVCache
        return KVCache()

    @torch.inference_mode()
    def warm_up(self, tokens: int = 4) -> None:
        """Compile the forward for the shapes decoding takes (a prefill, one token, a verified tree)
        now rather than in the first reply, and keep the seconds in `compile_seconds` (the growing
        layout's forward: the fixed envelope's steps compile in their own first runs)."""
        log.info("compiling the target's forward (once per shape; cached afterwards)...")
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
        fused = self.own_forward.fused if self.own_forward is not None else None
        if fused is not None:
            fused.set_profiling(self.profiling)
        if self.own_forward is not None:
            final, parts = self.own_forward(input_ids, cache, positions, mask, tuple(feature_layers or ()))
        else:
            final, parts = self._transformers_forward(input_ids, cache, positions, mask, feature_layers)
        if not self.profiling:
            return self._output(final, parts, logits_for)
        started = time.perf_counter()
        output = self._output(final, parts, logits_for)  # the LM head: products too
        output.products_seconds = time.perf_counter() - started
        if fused is not None:  # (other runtimes time the forward as a whole only)
            products, output.attention_seconds = fused.take_timings()
            output.products_seconds += products
        return output

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

    def _transformers_forward(self, input_ids, cache, positions, mask, feature_layers):
        from specchat.decode.runtime.transformers_cache import cache_argument  # (as in `new_cache`)

        select = [i for i in (feature_layers or ()) if i != self.num_layers]
        out = self.decoder(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, **{cache_argument(self.decoder): cache},
            use_cache=True, output_hidden_states=select or False,
        )
        final = out.last_hidden_state[0]
        return final, [final if i == self.num_layers else out.hidden_states[i][0] for i in feature_layers or ()]
