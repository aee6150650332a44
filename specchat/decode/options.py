"""What the decoding core can be asked for, and its defaults, declared here once.

Torch-free, so that the command line and the settings layer (`specchat.settings`) offer these
choices before torch loads; the core's modules read them from here too.
"""

from __future__ import annotations

AUTO = "auto"  # --dtype, --device, --quantize, --compile: chosen for the machine (specchat.decode.runtime.loading, .target)
DTYPES = ("bfloat16", "float16", "float32")
KERNEL_BITS = {"int5": 5, "int4": 4}  # specchat's weight-only CPU kernel (specchat.decode.runtime.quantized)
# A draft head on a kernel-quantized target packs into 4 bits whatever the target's are: its numbers only
# draft (every draft is verified), and its step reads its weights from memory every cycle. The bundled
# EAGLE-3 head, 10 general prompts on a Zen 3 (AVX2): τ 1.969 at int5, 1.974 at int4; a step 0.88 -> 0.77 ms.
HEAD_QUANTIZE = "int4"
BITSANDBYTES = ("8bit", "4bit")  # bitsandbytes' quantized weights
QUANTIZE = (AUTO, "none", *KERNEL_BITS, *BITSANDBYTES)
COMPILE = (AUTO, "on", "off")  # torch.compile the target's forward: auto = on CUDA without graphs (target.compiles)
CUDA_GRAPHS = (AUTO, "on", "off")  # the fixed envelope, captured as CUDA graphs: auto = on CUDA (target.fixed_steps)
ANSWER_INDEX = (AUTO, "on", "off")  # lookup in this user's earlier answers: auto = on for chat (specchat.app)
MAX_NEW_TOKENS = 512  # most tokens per reply
DRAFT_MODEL_TOKENS = 3  # sps: a small model's chain (the README's sps measurements on the 1.5B target)
# sps on a CPU, where each chain is as long as pays at the verify cost (`drafting.draft_model`): the longest.
# The 1.5B target drafted by the 0.5B, paced with lookup, 2-core AVX-512 Xeon: general10 (5 prompts) 1.46x
# plain at 6 against 1.34x at 3; rewrite10 (5) 2.78x at 6 against 2.67x at 8.
DRAFT_MODEL_LONGEST = 6
