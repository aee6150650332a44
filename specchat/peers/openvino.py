"""OpenVINO GenAI as `specchat bench` peers.

- `openvino`: OpenVINO GenAI's plain decoding of the target, exported by optimum-intel with int4
  weights (its fastest plain decoding on these CPUs); `openvino-int8`: the same with int8 weights;
- `openvino-lookup`: its prompt lookup decoding (int4 weights);
- `openvino-eagle3`: its EAGLE-3 speculation (int4 weights) drafting with specchat's own head for
  the target, a chain of EAGLE3_CHAIN tokens, the head in OpenVINO's layout (`export-head --format
  openvino`: `specchat.exports.export_openvino`, whose docstring tells what the head's IR says).

Both packages pin versions of their own (transformers among them): they live in a virtual
environment of their own (`specchat.exports.OPENVINO_INSTALL`), whose Python
`SPECCHAT_OPENVINO_PYTHON` names, and run there: optimum-intel's `optimum-cli` exports into
specchat's cache once, and GenAI decodes in a worker (`specchat.peers.process`). OpenVINO runs
with its defaults as a user gets them (bf16 inference where the CPU has AVX512-BF16, f32
elsewhere; the worker reports which), 2 threads as every method. Its defaults are not lossless
against its own plain greedy output on a bf16 CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specchat import exports, methods
from specchat.chat import ChatFormat
from specchat.decode import GenerationSettings, Target, cache_dir
from specchat.peers import PeerUnavailable
from specchat.peers.process import Worker, WorkerRunner, exported_once, run_tool
from specchat.settings import Settings
from specchat.sources import locate, resolve_folder

RUNTIME = "OpenVINO GenAI"  # the worker's name for it (`specchat.peers.worker.RUNTIMES`)
LOOKUP_TOKENS, LOOKUP_NGRAM = 5, 3  # GenAI's prompt lookup: tokens proposed per step, longest n-gram matched (its samples')
EAGLE3_CHAIN = 3  # draft tokens per step for openvino-eagle3 (3-5 decoded fastest on these CPUs)


def export_target(python_path: str, folder: Path, weights: str) -> Path:
    """The target's IR with `weights` (int4 | int8) weights, exported once from its Hugging Face folder."""
    def make(output: Path) -> None:
        run_tool([*exports.optimum_cli(python_path), "--model", str(folder), "--task",
                  "text-generation-with-past", "--weight-format", weights, str(output)],
                 cache_dir() / "peers" / f"export-openvino-{weights}.log", f"optimum-cli's {weights} export",
                 env={"HF_HUB_OFFLINE": "1"})

    return exported_once(f"openvino-{folder.name}-{weights}", [folder], make)


def _runner(settings: Settings, target: Target, chat_format: ChatFormat, generation: GenerationSettings,
            weights: str, lookup: bool = False, head: str | None = None) -> tuple[WorkerRunner, None]:
    python_path = exports.openvino_python()
    folder = Path(locate(target.spec, torch.bfloat16))  # the weights all runtimes read (a GGUF's: dequantized)
    model = export_target(python_path, folder, weights)
    draft = None
    if head is not None:
        source = resolve_folder(head)
        draft = exported_once("openvino-head", [source, folder], lambda output: exports.export_openvino_head(
            source, output, exports.target_of(source), exports.feature_layers(source), folder, python_path))
    load = {"runtime": RUNTIME, "model": str(model), "draft": draft and str(draft),
            "lookup": LOOKUP_NGRAM if lookup else 0,
            "draft_tokens": EAGLE3_CHAIN if head else LOOKUP_TOKENS, "threads": torch.get_num_threads(),
            "max_context": target.max_context}
    worker = Worker(python_path, load, settings.method, {})
    return WorkerRunner(worker, chat_format, generation, settings.seed), None


def openvino(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int4")


def openvino_int8(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int8")


def openvino_lookup(settings, target, chat_format, generation, load_model):
    return _runner(settings, target, chat_format, generation, "int4", lookup=True)


def openvino_eagle3(settings, target, chat_format, generation, load_model):
    if not generation.sampling.greedy:
        raise PeerUnavailable(f"OpenVINO GenAI {exports.OPENVINO_VERSION}'s EAGLE-3 decoding fails when it samples "
                              f"(its check content_length <= prompt_ids.size() + m_generated_ids.size() in "
                              f"sequence_group.cpp): greedy only")
    return _runner(settings, target, chat_format, generation, "int4", head=settings.draft)


# What runs each of its methods (all peers': `specchat.bench.run.RUNNERS`).
RUNNERS = {methods.OPENVINO: openvino, methods.OPENVINO_INT8: openvino_int8, methods.OPENVINO_LOOKUP: openvino_lookup,
           methods.OPENVINO_EAGLE3: openvino_eagle3}
