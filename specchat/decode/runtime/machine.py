"""What this machine is and where specchat keeps its files: CPU, devices, the cache folder.

Measurements that depend on the machine (the verify-cost curve, training records) and choices
that do (bf16 on a CPU) read it here, once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock


def cache_dir() -> Path:
    """$SPECCHAT_CACHE_DIR, else $XDG_CACHE_HOME/specchat (converted models, measured curves, training work)."""
    root = os.environ.get("SPECCHAT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specchat"
    return Path(root)


PARTIAL = ".partial"  # a file being written: `<name>.<the writer's pid>.partial`, beside the file it becomes


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` a file beside `path`, then put it in `path`'s place: a reader sees the old file or the
    whole new one, never a part (a process killed meanwhile leaves a `.partial` behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL}")
    write(partial)
    os.replace(partial, path)


def partial_writer(partial: Path) -> tuple[Path, int | None]:
    """The file a `.partial` file of `replace_atomically` was to become, and the pid of its writer
    (None where its name holds none)."""
    stem = partial.name.removesuffix(PARTIAL)
    name, _, pid = stem.rpartition(".")
    if name and pid.isdigit():
        return partial.with_name(name), int(pid)
    return partial.with_name(stem), None


# safetensors' own writer builds the whole file in memory first (each tensor's bytes, then one buffer):
# 3.1 s for a 1 GB model on 2 Xeon cores, where writing each tensor's bytes as they lie took 0.3 s,
# and a first start writes the converted model and the packed one. The format (safetensors' spec): the
# header's length in 8 little-endian bytes, the JSON header padded with spaces to a multiple of 8, then
# the tensors' bytes back to back in the order of their offsets.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(path: Path | str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """`tensors` as a safetensors file at `path` (any reader of the format reads it), written tensor by
    tensor: the widest elements first, so that each tensor starts at a multiple of its element size."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name in order:
            handle.write(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def lock_beside(path: Path) -> FileLock:
    """A lock file beside a cache entry (`path` + ".lock"), held while the entry is looked for and made:
    a second process started at the same time waits for the first one's instead of making it again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path.with_name(path.name + ".lock"))


@contextlib.contextmanager
def torch_threads(count: int | None):
    """torch's intra-op threads set to `count` (at least one) for the block, then as they were; None: as they are."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty where there is none)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo spells them ("avx2", "avx512_vnni", "avx_vnni", ...)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX); otherwise bf16 is slow there."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings mean what they say (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hardware() -> dict:
    """What a measurement ran on, for the records it writes."""
    return {"machine": platform.machine(), "processor": platform.processor(), "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


@dataclass
class OtherLoad:
    share: float = 0.0  # of the machine's CPU time, used by other processes (0 where /proc cannot tell)


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(all CPUs' busy ticks, all ticks, this process's ticks) from /proc, or None elsewhere."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait; steal counts as busy: another's
    return sum(fields[:8]) - idle, sum(fields[:8]), int(own[11]) + int(own[12])  # utime + stime


@contextlib.contextmanager
def other_processes_share():
    """How much of the machine's CPU other processes (or the hypervisor) took while the block ran:
    what makes a timing on a small machine mean nothing (two torch processes on two cores slow each
    other 5-10x)."""
    load, before = OtherLoad(), _cpu_ticks()
    yield load
    after = _cpu_ticks()
    if before is not None and after is not None and after[1] > before[1]:
        others = (after[0] - before[0]) - (after[2] - before[2])
        load.share = max(0.0, others / (after[1] - before[1]))
