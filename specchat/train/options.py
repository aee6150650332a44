"""What `specchat train` can be asked for, each default written once, here.

Torch-free: the command line builds the train command's options from these fields (names and
defaults) before anything heavy loads; `specchat.train.pipeline.run` carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

# Regenerated answers (`specchat data regenerate`, `train --regenerate`): the longest answer, the
# longest prompt a conversation goes on to, and the temperatures `data regenerate` answers at.
DEFAULT_MAX_NEW_TOKENS = 512
DEFAULT_MAX_PROMPT_TOKENS = 1024
DATA_TEMPERATURES = (0.0, 1.0)
FEATURE_CHOICES = ("auto", "stored", "live")  # where training's target features come from (--features)

# What the device decides where no option does, by its type ("cpu" or "cuda").
REGENERATE_BATCH = {"cpu": 32, "cuda": 256}  # sequences decoded at once: a CPU does ~32 tokens per forward for
# the price of ~1.3, a GPU needs many rows per forward to be busy
EXTRACT_TOKENS = {"cpu": 4096, "cuda": 32768}  # padded positions per feature forward (a CPU gains little past
# a few thousand)
TRAIN_ROWS = {"cpu": 1, "cuda": 8}  # rows per training forward pass (--batch-size): a CPU gains nothing from
# padding rows together, a GPU needs them to be busy
PAPER_DRAFT_VOCAB = 32000  # EAGLE-3's draft vocabulary for Llama-3's 128k (--draft-vocab)
# Training checkpoints (`specchat.train.checkpoint`): auto is exact when that fits in CHECKPOINT_BUDGET_BYTES.
CHECKPOINT_PRECISIONS = ("auto", "exact", "compact")
CHECKPOINT_BUDGET_BYTES = 64 * 2**20


def on_device(defaults: dict[str, int], device) -> int:
    """The default `defaults` holds for `device` (a torch device): a GPU's on CUDA, else the CPU's."""
    return defaults["cuda" if device.type == "cuda" else "cpu"]


def by_device(defaults: dict[str, int]) -> str:
    """A per-device default as help text says it."""
    return f"{defaults['cpu']} on a CPU, {defaults['cuda']} on a GPU"


@dataclass(frozen=True)
class TrainOptions:
    """The options of `specchat train`, named as its parameters; None: decided by the device or the target."""

    kind: str  # head format: eagle | eagle3 | jakiro (drafters.FORMATS)
    data_files: tuple[str, ...]
    output: str  # the folder the head is written into
    # The target, loaded as the profile says unless these say otherwise.
    model: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    profile: str | None = None
    # The data: regenerated answers and target features, kept in the work folder.
    regenerate: bool = False
    regenerate_batch: int | None = None  # None: by device (specchat.train.regenerate.batch_size_for)
    regenerate_max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    regenerate_temperature: float = 0.0
    max_tokens: int = 2048  # EAGLE's max_len
    limit: int | None = None
    extract_tokens: int | None = None  # padded positions per target forward; None: by device
    features: str = "auto"  # stored (extracted once, files) | live (the target per batch, on the device) | auto
    held_out: float = 0.02
    work_dir: str | None = None  # None: under the cache, keyed by the target and the data
    prepare_only: bool = False
    # The head and its training (specchat.train.trainer.TrainConfig).
    init: str | None = None  # start from this head (bundled name, folder, hub id): its weights and vocabulary
    draft_vocab: int | None = None  # None: 32000 (EAGLE-3's size)
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int | None = None  # None: the paper's (7 for eagle3, 1 for eagle/jakiro)
    epochs: float = 2.0
    max_steps: int | None = None
    # The papers train 20-40 epochs over ~68k conversations with learning rates of 3e-5..9e-5 on
    # schedules of 800k steps; CPU runs take a few thousand steps, so the rate is higher.
    lr: float = 3e-4
    warmup: int = 100
    batch_tokens: int = 8192  # tokens per optimizer step (gradient accumulation over forward passes)
    batch_size: int | None = None  # rows per forward pass, each packed with sequences; None: 1 on a CPU, 8 on a GPU
    eval_every: int = 200
    checkpoint_every: int = 200
    checkpoint_precision: str = "auto"  # auto | exact | compact (see specchat.train.checkpoint)
    max_minutes: float | None = None  # stop (with a checkpoint) after this much training time
    resume: bool = False
    seed: int = 0
    trace: str | None = None  # a folder for a profiler trace of a few optimizer steps, timed by phase
    # The result.
    max_shard_mb: float | None = None
    exports: tuple[str, ...] = ()  # layouts to export the finished head in (specchat.exports)
