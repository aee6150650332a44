"""What one target forward costs on this machine, by number of tokens: the verify-cost curve.

A CPU computes a forward over a handful of tokens in about the time of one (the weights are read
once either way), then gets slower in steps as the matrix kernels change shape. The verified
tree should be as large as the flat part of that curve allows. The curve is measured once per
(machine, model, dtype, threads) and cached.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from specchat.cache import KVCache, causal_mask
from specchat.machine import cache_dir, device_name, synchronize

SIZES = (1, 4, 8, 12, 16, 20, 24, 32, 48)
CONTEXT = 256  # tokens already cached while timing (a typical chat turn)
REPEATS = 3
# Accept a verify forward costing up to this much more than a one-token forward: the extra
# accepted tokens of a larger tree are worth a little more time, not a lot.
TOLERANCE = 0.10


@dataclass
class Curve:
    milliseconds: dict[int, float]

    def best_total_tokens(self, tolerance: float = TOLERANCE) -> int:
        base = self.milliseconds[1]
        return max(n for n, ms in self.milliseconds.items() if ms <= base * (1 + tolerance))


def _key(target) -> str:
    return f"{target.name}|{str(target.dtype)}|{device_name(target.device)}|{torch.get_num_threads()}"


@torch.inference_mode()
def measure(target, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS) -> Curve:
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, len(target.tokenizer))
    cache = KVCache()
    target.forward(torch.randint(0, vocab, (1, context), generator=generator).to(target.device), cache, logits_for="none")
    result = {}
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), generator=generator).to(target.device)
        mask = causal_mask(context, n, target.device)
        positions = torch.arange(context, context + n, device=target.device)[None]
        times = []
        for _ in range(repeats + 1):  # the first run warms kernels up and is not counted
            synchronize(target.device)
            start = time.perf_counter()
            target.forward(ids, cache, positions=positions, mask=mask, logits_for="all")
            synchronize(target.device)
            times.append(time.perf_counter() - start)
            cache.trim(context)
        result[n] = round(sorted(times[1:])[len(times[1:]) // 2] * 1000, 2)
    return Curve(result)


def cached_curve(target) -> Curve:
    """The curve for this machine and target, measured on first use (a few seconds)."""
    path = cache_dir() / "verify-cost.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    key = _key(target)
    if key not in known:
        known[key] = measure(target).milliseconds
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return Curve({int(n): ms for n, ms in known[key].items()})
