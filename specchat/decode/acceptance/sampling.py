"""The target distribution p and how tokens are drawn from it.

Temperature, top-k and top-p act on the target's logits only, in that order (the order
transformers' `generate` applies them). Speculative methods verify against exactly the
distribution plain decoding samples from, which is what makes them lossless.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from specchat.decode.runtime import woq_kernel


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps the whole vocabulary

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution p over the last dimension, in float32.

    Greedy decoding is the point mass on the argmax, so acceptance rules written for
    sampling reduce exactly to argmax matching.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature if params.temperature != 1 else logits
    on_host = logits.device.type == "cpu"  # (a device's steps may not read the host: they sort)
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = _kth_largest_on_host(logits, params.top_k) if on_host else \
            torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1 and on_host:
        return _nucleus_on_host(logits.softmax(-1), params.top_p)
    if params.top_p < 1:
        logits = logits.masked_fill(_outside_nucleus(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p drops: those the likelier ones before them already hold `top_p` of the mass
    against (in descending order; the first token always stays), by sorting the whole vocabulary."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    return torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)


# Top-k and top-p on a CPU without sorting the vocabulary: sorting 152k logits took 10.8 ms a row and
# a top-k 0.9 ms (2 Xeon cores), next to a 15 ms forward, and a cycle samples at each row it visits.
# Both keep the likeliest tokens, which lie above any value that enough of them reach: one pass finds
# the tokens above a first guess (lowered until it holds them), and only those are sorted. The same
# tokens as the sort's, ties in the order of the vocabulary as a stable sort leaves them; the cumulative
# sums are over those tokens alone, so a token whose mass before it is within rounding of top_p may
# fall on the other side (plain decoding and verification draw from the same function either way).
NUCLEUS_GUESS = 1 / 1024  # the first guess: tokens at least this share of the likeliest one's probability
TOP_K_GUESS = 8.0  # the first guess: tokens within this many logits of the largest (widened 4x at a time)


def _kth_largest_on_host(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k-th largest logit [n, 1] (or [1] for one row), as `topk(k).values[..., -1:]`."""
    rows = logits.reshape(-1, logits.shape[-1])
    kth = torch.empty(len(rows), 1)
    for index, row in enumerate(rows):
        gap, largest = TOP_K_GUESS, float(row.max())
        while (above := row[row >= largest - gap]).numel() < k and gap < math.inf:
            gap *= 4
        kth[index] = (above if above.numel() >= k else row).topk(k).values[-1]  # (an infinite largest: all)
    return kth.reshape(*logits.shape[:-1], 1)


def _nucleus_on_host(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [..., V] within the nucleus, renormalized (`_outside_nucleus`'s tokens dropped), sorting
    only the likeliest tokens: those above a probability whose tokens hold `top_p` of the mass already
    hold the nucleus."""
    nucleus = torch.zeros_like(probs)
    for row, kept in zip(probs.view(-1, probs.shape[-1]), nucleus.view(-1, probs.shape[-1])):
        guess = float(row.max()) * NUCLEUS_GUESS
        while True:
            candidates = (row >= guess).nonzero()[:, 0]  # a prefix of the descending order
            chosen = row[candidates]
            if guess == 0 or float(chosen.sum()) >= top_p:
                break
            guess = guess / 32 if guess > 1e-30 else 0.0
        values, order = chosen.sort(descending=True, stable=True)
        inside = values.cumsum(0) - values < top_p
        kept[candidates[order[inside]]] = values[inside] / values[inside].sum()
    return nucleus


# Greedy choices over a large vocabulary on a CPU: torch's argmax and topk walk one long row
# serially (~0.1 ms and ~0.15 ms over 152k logits), while the maxima of contiguous blocks
# vectorize (~0.015 ms); the winning block is then searched alone. Same result, ties included.
BLOCK = 128


def _blocks(logits: torch.Tensor) -> torch.Tensor | None:
    """[n, V] float logits as [n, V / BLOCK, BLOCK], or None where the fast path does not apply."""
    n, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % BLOCK or vocab < 2 * BLOCK or not logits.is_contiguous():
        return None
    return logits.view(n, vocab // BLOCK, BLOCK)


def argmax(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum ([n, V]), exactly as `logits.float().argmax(-1)`."""
    logits = logits.float()  # (over bf16 the search is 5x slower than converting first)
    blocks = _blocks(logits)
    if blocks is None:
        return logits.argmax(-1).tolist()
    block = blocks.amax(-1).argmax(-1)  # the first block holding the maximum (NaN counts as maximal in both)
    inner = blocks[torch.arange(len(block)), block].argmax(-1)
    return (block * BLOCK + inner).tolist()


def margins(logits: torch.Tensor) -> list[float]:
    """Each row's top-1 minus top-2 logit ([n, V], in float32): 0 at an exact tie."""
    logits = logits.float()
    blocks = _blocks(logits)
    if blocks is None:
        return row_margins(logits).tolist()
    maxima = blocks.amax(-1)
    block = maxima.argmax(-1, keepdim=True)
    top = blocks[torch.arange(len(block)), block[:, 0]].topk(2, dim=-1).values  # best two in the best block
    elsewhere = maxima.scatter(1, block, float("-inf")).amax(-1)  # best outside it
    return (top[:, 0] - torch.maximum(top[:, 1], elsewhere)).tolist()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution, by inverting its cumulative sum at a uniform draw
    (exactly p; 18x faster than torch.multinomial over a 152k vocabulary on a CPU). On a CPU the sum is
    inverted in two steps, over blocks of BLOCK tokens and then within the block drawn: a cumulative
    sum over the whole vocabulary is one sequential pass (119 us of a sampled row, now 38 us)."""
    blocks = _blocks(probs[None])
    if blocks is None:
        cdf = probs.cumsum(-1)
        u = torch.rand((), generator=generator, device=probs.device) * cdf[-1]
        # right=True: the first token whose cumulative mass exceeds u (tokens of zero mass are never drawn)
        return int(torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1))
    blocks = blocks[0]
    cdf = blocks.sum(-1).cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    block = int(torch.searchsorted(cdf, u, right=True).clamp(max=len(cdf) - 1))  # a block with mass
    within = blocks[block]
    rest = (u - cdf[block - 1]).clamp(min=0) if block else u
    index = int(torch.searchsorted(within.cumsum(0), rest, right=True))
    if index == BLOCK or within[index] <= 0:  # rounding put the draw past the block's own sum: its last token
        index = int(within.nonzero()[-1])  # of mass
    return block * BLOCK + index


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of [n, V] (unnormalized) probabilities, as `sample` draws one: a device
    tensor, read by no one here (the fixed layout reads its whole cycle at once)."""
    cdf = probs.float().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def draw_rows(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The token plain decoding draws after each row of [n, V] logits, as a device tensor [n]: the
    argmax when greedy (the first one at a tie, as `argmax`), else a draw from p."""
    if sampling.greedy:
        return logits.float().argmax(-1)
    return sample_rows(target_probs(logits, sampling), generator)


def choices_and_margins(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """`argmax` and `margins` of [n, V] logits at once: in one pass over each row where the kernel's
    extension is loaded (`choose` in kernels/layers.cpp: a CPU with the quantized runtime), else
    by torch's calls."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and woq_kernel.loaded():
        choices, row_margins = torch.ops.specchat.choose(logits.contiguous())
        return choices.tolist(), row_margins.tolist()
    return argmax(logits), margins(logits)


def row_margins(logits: torch.Tensor) -> torch.Tensor:
    """`margins` as a device tensor [n]."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """One random stream for a whole run: successive prompts continue it instead of restarting it."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator
