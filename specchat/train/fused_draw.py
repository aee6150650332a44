"""Regeneration's draw in one pass over the logits, on CUDA: a Triton kernel.

A row at temperature T > 0 draws argmax_i (l_i / T + G_i) with G_i = -log(-log U_i) independent
Gumbel noise, which is a draw from softmax(l / T) exactly (the Gumbel-max trick: P(argmax = i) =
p_i); a greedy row (T = 0) takes argmax_i l_i, the first at a tie, as `torch.argmax` does. Each row
is one program that reads its logits once. torch's draw (`batched.draw`) makes a float32 copy,
takes the argmax, divides, runs softmax and a cumulative sum, each a pass over [slots, vocabulary]:
17% of a 1,024-slot step of the fourth block's slot check (an H200, half the slots sampling,
`docs/bench-gpu/h200-block4/trace-slots-summary.txt`), more once attention reads each slot's own span.

The noise comes from Philox (`tl.rand`) keyed by a seed the step reads from the device, which the
captured step itself advances, so a CUDA graph's replays draw afresh; the stream is the kernel's,
not a torch.Generator's. Without Triton (CPU installs) `unavailable` says why, and torch's draw runs.
"""

from __future__ import annotations

import functools
import logging

import torch

from specchat.decode import kernel_failure

try:
    import triton
    import triton.language as tl
except ImportError:  # an optional dependency: torch's CUDA wheels bring it, CPU installs have no use for it
    triton = None

log = logging.getLogger(__name__)

BLOCK = 2048  # vocabulary entries a program reads at a time (151,936 in 75 blocks)

if triton is not None:
    @triton.jit
    def _draw_rows(logits_ptr, row_stride, temperatures_ptr, seed_ptr, out_ptr, vocab,
                   BLOCK_SIZE: tl.constexpr):
        row = tl.program_id(0)
        temperature = tl.load(temperatures_ptr + row)
        hot = temperature > 0
        inverse = 1.0 / tl.where(hot, temperature, 1.0)
        seed = tl.load(seed_ptr)
        best = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK_SIZE], tl.int32)
        for start in range(0, vocab, BLOCK_SIZE):
            index = start + tl.arange(0, BLOCK_SIZE)
            inside = index < vocab
            score = tl.load(logits_ptr + row * row_stride + index, mask=inside, other=float("-inf")).to(tl.float32)
            if hot:
                uniform = tl.rand(seed, row * vocab + index)
                score = score * inverse - tl.log(-tl.log(uniform))  # a lane past the end stays -inf
            better = score > best  # strictly: a lane keeps its first index at a tie
            best = tl.where(better, score, best)
            best_index = tl.where(better, index, best_index)
        top = tl.max(best, 0)
        tl.store(out_ptr + row, tl.min(tl.where(best == top, best_index, vocab), 0))


def draw(logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor, out: torch.Tensor) -> None:
    """Into `out` [R] (int64), the token each row of `logits` [R, V] draws at its temperature
    (`temperatures` [R], float32; 0: greedy), with noise keyed by `seed` [1] (int64, on the device)."""
    assert logits.stride(-1) == 1 and temperatures.dtype == torch.float32 and seed.dtype == torch.int64
    _draw_rows[(logits.shape[0],)](logits, logits.stride(0), temperatures, seed, out, logits.shape[1],
                                   BLOCK_SIZE=BLOCK)


@functools.cache
def unavailable(device: torch.device) -> str | None:
    """Why `draw` cannot run on `device`, or None: Triton's kernels run on CUDA GPUs (and on a CPU
    under Triton's interpreter, TRITON_INTERPRET=1, which the tests use), within a captured step
    too; a tiny call is tried, eagerly and captured, once a device."""
    if triton is None:
        return "no Triton"
    if device.type != "cuda":
        return "Triton's kernels run on CUDA GPUs"
    logits = torch.zeros(2, 8, device=device)
    temperatures, seed = torch.tensor([0.0, 1.0], device=device), torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.zeros(2, dtype=torch.int64, device=device)
    failure = kernel_failure(lambda: draw(logits, temperatures, seed, out))
    if failure is not None:
        log.warning("regeneration draws with torch's passes (%s)", failure)
    return failure
