"""Steps of fixed shape captured as CUDA graphs and replayed: one launch for a whole step.

A step is a function of no arguments that reads and writes only tensors that outlive it (static
buffers: the caches, the inputs the host writes before a run, the record it reads after) and makes
no host read; `specchat.decode.runtime.envelope` shapes the steps that way. Each step has a key (its
rows, span and sampling). Its first run is eager, which also warms it up (cuBLAS handles,
workspaces, lazily allocated buffers); the second is captured (capture runs nothing) and
replayed; later runs replay. So capturing needs no scratch state and no dummy inputs.

On a CPU, or where a step cannot be captured (a kernel that reads the host: bitsandbytes' 8-bit
matmul checks its outliers there), every run is eager: the same step, the same results, only the
launches are not saved. The first failure is said once (`failure`), not hidden.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

import torch

from specchat.decode.runtime.machine import synchronize
from specchat.errors import first_line

log = logging.getLogger(__name__)
# A capture fails on unsafe CUDA calls of its own thread only: the REPL's other threads (loading,
# the prompt) may use CUDA meanwhile without spoiling it ("global" would refuse them).
CAPTURE_MODE = "thread_local"


def capture_failure(step: Callable[[], None]) -> str | None:
    """Why `step` cannot be captured as a CUDA graph, or None: it runs once eagerly (the warm-up),
    then a capture is tried and thrown away (capturing runs nothing)."""
    step()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode=CAPTURE_MODE):
            step()
    except RuntimeError as error:
        return first_line(error)
    return None


def kernel_failure(step: Callable[[], None]) -> str | None:
    """Why `step`, a call to a kernel that may not build or run on this device (flash attention's, a
    Triton one), cannot run eagerly and then in a captured step, or None: `capture_failure`, with the
    eager run's error said too rather than raised."""
    try:
        return capture_failure(step)
    except Exception as error:  # noqa: BLE001 - a kernel's own errors (Triton's CompilationError, ...) and torch's
        return first_line(error)


class StepGraphs:
    """The captured steps of one engine, sharing one memory pool."""

    def __init__(self, device: torch.device, capture: bool = True, ledger=None):
        """`ledger`: an object whose `capture_seconds` also counts this engine's capturing (the target,
        whose several engines capture their own steps: reported apart from tokens per second)."""
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.warmed: set[Hashable] = set()
        self.pool = None
        self.failure: str | None = None  # why steps run eagerly although asked to capture
        self.capture_seconds = 0.0  # spent capturing (and in the eager first runs: warm-up), not decoding
        self.ledger = ledger

    def run(self, key: Hashable, step: Callable[[], None], generator: torch.Generator | None = None) -> None:
        """Run `step`, replaying its graph once there is one. `generator` is the random stream the
        step draws from, if any: a graph advances it as the eager step would."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.capture or self.failure is not None:
            step()
            return
        started = time.perf_counter()
        if not self.warmed:
            log.info("capturing the decoding steps as CUDA graphs (each shape once: not counted in tokens per second)")
        if key not in self.warmed:
            self.warmed.add(key)
            step()
        else:
            self.graphs[key] = graph = self._captured(step, generator)
            if graph is None:
                step()
            else:
                graph.replay()
        synchronize(self.device)
        spent = time.perf_counter() - started
        self.capture_seconds += spent
        if self.ledger is not None:
            self.ledger.capture_seconds += spent

    def _captured(self, step: Callable[[], None], generator: torch.Generator | None) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
                step()
        except RuntimeError as error:  # an operation that cannot be captured (a host read, a host-side copy)
            self.failure = f"a decoding step could not be captured as a CUDA graph ({first_line(error)}): steps run eagerly"
            log.warning(self.failure)
            return None
        self.pool = graph.pool()
        return graph
