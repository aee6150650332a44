"""A torch profiler trace and its summary table: what `runtime-check --trace` writes of a few
cycles or slot steps, and `train --trace` of a few optimizer steps, so that a GPU block's record
says where the time goes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.decode import synchronize

SUMMARY_ROWS = 40


class Profiler:
    """The profiler over some work on `device` (CUDA kernels too on CUDA), started and stopped
    around it (`start`/`stop`, or as a context), then written (`write`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.profile = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))

    def start(self) -> None:
        self.profile.start()

    def stop(self) -> None:
        synchronize(self.device)  # the queued kernels belong to the work
        self.profile.stop()

    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def write(self, folder: str | Path, summary_name: str, trace_name: str | None = None) -> None:
        """The summary table (the most expensive operators and kernels first) and, given its name, the
        chrome trace into `folder` (a few training steps make a trace of hundreds of MB: that one is left out)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        if trace_name is not None:
            self.profile.export_chrome_trace(str(Path(folder) / trace_name))
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        (Path(folder) / summary_name).write_text(self.profile.key_averages().table(sort_by=sort, row_limit=SUMMARY_ROWS))


def write_trace(folder: str | Path, trace_name: str, summary_name: str, device: torch.device,
                work: Callable[[], object]) -> None:
    """A trace of `work` and its summary table, into `folder`."""
    with Profiler(device) as profiler:
        work()
    profiler.write(folder, summary_name, trace_name)
