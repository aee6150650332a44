"""What one target forward costs on this machine, by number of tokens: the verify-cost curve.

A forward over a handful of tokens costs about what one costs while reading the weights
dominates; past that, cost grows with the tokens, how fast depending on the runtime (bf16 with
AMX stays nearly flat to 32 tokens, a 5-bit model on AVX-512 costs 1.4x at 8). A larger tree
gets more tokens accepted, with diminishing returns, so the verified size is the one that
maximizes expected tokens per second under this machine's curve. The curve is measured once per
(machine, model, dtype, quantization and kernel version, threads) and cached.
"""

from __future__ import annotations

import logging
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from specchat.decode import woq_kernel
from specchat.decode.cache import causal_mask
from specchat.decode.machine import cache_dir, device_name, synchronize
from specchat.decode.options import KERNEL_BITS

log = logging.getLogger(__name__)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48)  # the small ones: where each token costs much (AVX2)
CONTEXT = 256  # tokens already cached while timing (a typical chat turn)
REPEATS = 5
# Expected tokens per cycle with a verified tree of n tokens, tau(n) = 1 + TAU_PER_DOUBLING * log2(n),
# and drafting's cost per cycle as a share of one plain forward: both measured with the bundled
# EAGLE-3 head under deagle on a 2-core AVX-512 CPU (tau 1.58 / 1.70 / 1.85 at 4 / 8 / 16 tokens,
# drafting ~6.5 ms against ~20 ms per plain forward; docs/cpu-runtime.md).
TAU_PER_DOUBLING = 0.22
DRAFT_SHARE = 1 / 3


@dataclass
class Curve:
    milliseconds: dict[int, float]

    def expected_rate(self, n: int, trust: float = 1.0) -> float:
        """Modelled tokens per millisecond when n tokens are verified per cycle; `trust` scales the
        drafts' acceptance (below 1 where fewer survive than the model assumes, as under sampling)."""
        tau = 1 + trust * TAU_PER_DOUBLING * math.log2(n)
        return tau / (self.milliseconds[n] + DRAFT_SHARE * self.milliseconds[1])

    @property
    def largest(self) -> int:
        return max(self.milliseconds)

    def cost(self, n: int) -> float:
        """Milliseconds for a forward of n tokens: interpolated between measured sizes, extended
        linearly past the largest."""
        sizes = sorted(self.milliseconds)
        if n <= sizes[0]:
            return self.milliseconds[sizes[0]]
        for low, high in zip(sizes, sizes[1:]):
            if n <= high:
                share = (n - low) / (high - low)
                return self.milliseconds[low] + share * (self.milliseconds[high] - self.milliseconds[low])
        low, high = sizes[-2], sizes[-1]
        slope = (self.milliseconds[high] - self.milliseconds[low]) / (high - low)
        return self.milliseconds[high] + slope * (n - high)

    def best_total_tokens(self, trust: float = 1.0) -> int:
        return max(self.milliseconds, key=lambda n: (self.expected_rate(n, trust), -n))


def _key(target) -> str:
    runtime = target.spec.quantize
    if runtime in KERNEL_BITS:  # specchat's kernel: a changed kernel is timed again
        runtime += f"-{woq_kernel.kernel_version()}"
    runtime += "-compiled" if target.compiled else ""
    sizes = "-".join(map(str, SIZES))  # a curve measured at other sizes is measured again
    return f"{target.name}|{str(target.dtype)}|{runtime}|{device_name(target.device)}|{torch.get_num_threads()}|{sizes}"


@torch.inference_mode()
def measure(target, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS) -> Curve:
    """Each size timed `repeats` times, the sizes taken in turn each round and the fastest run kept:
    a small VM's speed drifts by 20-30% within seconds, and timing one size after another folded
    that drift into the curve's shape (6 tokens measured dearer than 8 in one run, cheaper in the next)."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, len(target.tokenizer))
    cache = target.new_cache()
    target.forward(torch.randint(0, vocab, (1, context), generator=generator).to(target.device), cache, logits_for="none")
    inputs = {n: (torch.randint(0, vocab, (1, n), generator=generator).to(target.device),
                  torch.arange(context, context + n, device=target.device)[None],
                  causal_mask(context, n, target.device)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first round warms kernels up and is not counted
        for n, (ids, positions, mask) in inputs.items():
            synchronize(target.device)
            start = time.perf_counter()
            target.forward(ids, cache, positions=positions, mask=mask, logits_for="all")
            synchronize(target.device)
            times[n].append(time.perf_counter() - start)
            cache.trim(context)
    return Curve({n: round(min(runs[1:]) * 1000, 2) for n, runs in times.items()})


def cached_curve(target) -> Curve:
    """The curve for this machine and target, measured on first use (a few seconds)."""
    path = cache_dir() / "verify-cost.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    key = _key(target)
    if key not in known:
        log.info("measuring what verifying n tokens costs on this machine once (seconds)...")
        known[key] = measure(target).milliseconds
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return Curve({int(n): ms for n, ms in known[key].items()})
