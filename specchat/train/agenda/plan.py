"""What a block of device time has and what the agenda runs in it: the limits of a call, where
things go on the GPU machine, the wheels, heads and model it needs, the stages' commands."""

from __future__ import annotations

import sys
from pathlib import Path

from specchat.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

CALL_BYTES = 64 * 2**20  # what one call carries, the working tree included
SPARE_BYTES = 2**20
BACK_FILES, BACK_BYTES, BACK_PIECE = 8, 64 * 2**20, 15 * 2**20  # what one call brings back
WHEELS = ("gguf==0.19.0", "prompt_toolkit==3.0.53", "wcwidth==0.9.4")  # what the image lacks
# The heads a block needs: the bench's default (deagle) and training's --init read the EAGLE-3 head; the
# EAGLE and Jakiro heads (34 MB) benched in the first blocks only, and with them the staging took a tenth
# call once the kept answers and the tree had grown (561 MiB in pieces of 60.9, 2026-12-01).
HEADS = ("qwen2.5-coder-0.5b-eagle3",)
MODEL_PACKAGES = EMBEDDED_MODELS[DEFAULT_MODEL].packages  # the embedded 0.5B's GGUF chunks
PIECES = Path(".gpu/pieces")
# The answers each block brought back, kept compressed in its record folder (`collect --keep`), and
# those CPU sessions answered between blocks (`data regenerate --keep docs/answers/NAME`): `pack`
# sends them all, so every block trains on every answer so far. A returned shard holds at most
# SHARD_RECORDS answers (~3 KB each, ~40% of that compressed: a kept file stays under 25 MB).
KEPT_ANSWERS = ("docs/bench-gpu/*/answers", "docs/answers/*")
SHARD_RECORDS = 10_000
THERE = Path("/tmp/agenda")  # on the GPU machine: chunks, files, wheels, data, work, results
# What the issue judges on the GPU: plain decode tok/s and the default's speedup (and prompt lookup's,
# the baseline a user has without a head); eagle, eagle2 and jakiro ran in the first blocks.
BENCH_METHODS = "vanilla,deagle,pld"
# The runtime check on random weights of the real shapes (what follows the Python interpreter).
RUNTIME_CHECK = ("-m", "specchat", "runtime-check")
# EAGLE-3 training, target features live: planned at 55k tokens/s (~1.8 GFLOP a token at ~100 TFLOP/s,
# docs/gpu-agenda.md); an H200 trained at 43-48k on 2026-11-26 (the CUDA tests beside it at first).
PLANNED_TRAIN_RATE = 45_000
# What a training stage spends besides its minutes: loading the target, counting the draft
# vocabulary, the last evaluation, writing the head (95 s on that H200, 365 s for 4.5 minutes).
TRAIN_OVERHEAD_SECONDS = 110
# The regeneration steps the check times: 512 and 1,024 slots (256 ran in the fourth block), each slot reading
# the common span and its own positions (twice the steps of one attention).
SLOT_COUNTS = ("512", "1024")
# Slots answering at once (`data regenerate --batch`). The fourth block's check (H200, docs/bench-gpu/
# h200-block4/runtime-slots.json) timed a step of 1,024 slots at 1.2-1.4x the tokens a second of 512
# (spans 256 and 1,024), and its regeneration spent ~4-5 ms a step beyond the check's (14.6 ms at 512
# slots), which twice the slots split if it is the host's fixed part: 1,024 (19 GB of cache at 1,537
# positions).
REGENERATE_SLOTS = 1024
# The CUDA tests, beside answering and training (waited for after training): 11 took 75 s in the fourth
# block; the slot decoder's (flash attention, the one-pass draw, captured steps) run too since 2026-12-01.
CUDA_TESTS = ("timeout", "240", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
              "tests/test_layouts.py", "tests/test_compile.py", "tests/test_data.py",
              "tests/test_train.py::test_training_on_cuda")
CHAIN_STAGES = ("check", "bench", "answer", "train")  # what --wait can wait for, in the order they run
# The head's recipe (README, "Bundled heads"): 8192-token draft vocabulary, MLP 2048, 7 TTT steps.
# Started from the bundled head (26M tokens, then 9.9M more in the 2026-11-27 block and 13.1M in the
# 2026-11-30 one), at a third of the first run's learning rate:
# from scratch, 4.5 minutes on an H200 reached 2.06 (2026-11-26), and no checkpoint comes back
# from a block to go on from (its optimizer state is larger than a call returns).
TRAIN_BATCH_TOKENS = 16384
TRAIN_ARGS = ("--kind", "eagle3", "--init", "qwen2.5-coder-0.5b-eagle3", "--draft-vocab", "8192",
              "--intermediate-size", "2048", "--lr", "1e-4",
              "--batch-size", "16", "--batch-tokens", str(TRAIN_BATCH_TOKENS), "--eval-every", "100",
              "--checkpoint-every", "200",
              "--checkpoint-precision", "compact", "--max-shard-mb", "14", "--features", "live", "--resume")
