"""The decoding core: token ids in, token ids out, lossless by construction.

It imports only itself, `drafters` and `specchat.errors`; nothing of the command line, the REPL,
profiles or settings. Its defaults are declared here (`options`) and the settings layer reads them.

One engine runs every method on one of two cache layouts; where the layouts need different code it
sits in the layout (or, for a drafter, in its layout's subclass, which its module's `for_target`
picks). Three rules have two forms, one on the host over lists (the reference, and the CPU's: no
tensor operations per cycle) and one on the device (the fixed layout's, which may not read the
host): which candidates are verified (`drafting.selection`), the verify forward's inputs
(`engine.growing.verify_inputs`, `engine.fixed.verify_rows`) and sampled acceptance
(`acceptance.verify`). Each package imports only those below it (acceptance and drafting share the
tree type):

    engine/            the decoding cycle
      engine.py        Engine: prefill, plain steps, one speculative cycle; the Proposer protocol
      growing.py       GrowingLayout: exact sizes, a growing cache (trim, compact), host reads (CPUs)
      fixed.py         FixedLayout: fixed capacity, bucketed sizes, captured steps, one read per cycle (CUDA)
      staged.py        sps whose draft model drafts its chains with an engine and head of its own
    drafting/          what each method drafts
      tree.py          the draft tree (one type for both layouts), a cycle's record, EAGLE-1's static trees
      shapes.py        what a head drafts: EAGLE-1 static, EAGLE-2, DEAGLE, Jakiro; the tree budget
      growth.py        what a shape grows with: the head's steps (each layout's), the candidate table
      heads/           drafting those shapes with a draft head: the layout picked (`for_target`)
        proposer.py    HeadProposer: the algorithm (context pass, growth, lookup chains, pace)
        growing.py     GrowingHead: its cache grows, selection on the host (CPUs)
        fixed.py       FixedHead: a fixed-capacity cache, selection on the device (CUDA)
      selection.py     which candidates are verified, lookup chains merged in
      trust.py         what hybrid drafting learns in a chat: lookup's and the head's acceptance (torch-free)
      pace.py          which draft source each cycle takes (plain, lookup alone, the head), as measured (torch-free)
      lookup.py        n-gram continuations of text already seen (torch-free)
      prompt_lookup.py pld: a lookup chain as the draft
      draft_model.py   sps: chains from a small draft model (its cache on each layout)
      deagle.py        DEAGLE's dynamic depth and its trace (torch-free)
    acceptance/        what the target accepts
      verify.py        which drafted tokens the target accepts (greedy and sampled, exact rules)
      sampling.py      temperature / top-p / top-k, the draw, greedy choices and margins
    runtime/           the target model at run time
      target.py        the target: device, dtype and weights chosen, its runtime, one forward (variable or fixed shape)
      loading.py       loading it from a folder through transformers: quantization, attention
      packed.py        loading it from its packed file, without transformers (CPU kernel targets)
      tokenizer.py     its tokenizer without transformers: a snapshot, templates rendered as transformers does
      forward.py       specchat's own forward for Llama-family targets (eager or compiled) and its cache
      cpu_decoder.py   that forward in one C++ call on a quantized CPU target; a draft head's layer likewise
      cache.py         the causal mask every target cache takes
      transformers_cache.py  the KV cache of transformers' forward (its Cache over `drafters.cache`'s storage)
      envelope.py      the fixed shapes: capacity, buckets, spans, windows, declared host inputs
      graphs.py        fixed-shape steps captured as CUDA graphs and replayed
      quantized.py     weight-only int5/int4 linear layers for the CPU: the packed format, the layers
      woq_kernel.py    their kernel (kernels/: extension.cpp, torch's face; arithmetic.cpp: woq_linear.cpp,
                       layers.cpp, quantize.cpp), its CPU path
      calibrate.py     this machine's cost of verifying n tokens, which sizes CPU trees (healed by live forwards)
      machine.py       the CPU, devices, the cache folder, other processes' load
    options.py         what the core can be asked for, and its defaults (torch-free)

Code outside the core imports it through this face (`from specchat.decode import Engine`): the
names in FACE, each loaded from the module below that defines it on first use, so that importing
the face costs nothing (the command line reads `options` before torch loads). Only the BUILDERS
reach below it: they assemble the core's parts (targets, proposers) or check them (and their cached
files) one by one.
"""

from __future__ import annotations

import importlib

# Module below -> the names of it that outside code uses.
EXPORTS = {
    # the decoding cycle, what it is asked for and what it answers; what a drafter is to it
    "engine.engine": ("Engine", "GenerationSettings", "StepResult", "Proposer"),
    # the target distribution
    "acceptance.sampling": ("SamplingParams", "make_generator", "sample_rows"),
    # the target and the machine
    "runtime.target": ("ModelSpec", "Target"),
    "runtime.machine": ("cache_dir", "hardware", "synchronize"),
    # what a cycle records (statistics and transcripts read it)
    "drafting.tree": ("Cycle", "Source"),
    "drafting.pace": ("Arm",),
    # this user's earlier answers, which lookup drafts from (`specchat.answers` keeps them), and a default
    "drafting.lookup": ("EarlierAnswers", "ANSWER_TOKENS", "prompt_key", "DEFAULT_LOOKUP_PATHS"),
    # the target's own forward and cache, which training runs in batches (`specchat.train`)
    "runtime.forward": ("DecoderForward", "rotate", "unsupported_reason"),
    "runtime.graphs": ("StepGraphs", "kernel_failure"),
    "runtime.envelope": ("powers_of_two",),
    "runtime.transformers_cache": ("KVCache", "cache_argument"),
}
# Modules outside code uses whole, by their own name: the core's options and the drafting defaults the
# settings declare (all torch-free).
MODULES = ("options", "drafting.deagle", "drafting.lookup")
# Name -> (module below, attribute; None: the module itself).
FACE = {**{name: (module, name) for module, names in EXPORTS.items() for name in names},
        **{module.rpartition(".")[2]: (module, None) for module in MODULES}}
# The modules outside the core that import below this face (`specchat.cache_folder` checks the core's
# cached files, each kind by the module that writes it).
BUILDERS = ("specchat.proposers", "specchat.sources", "specchat.converted", "specchat.runtime_check",
            "specchat.cache_folder")

__all__ = sorted(FACE)


def __getattr__(name: str):
    if name not in FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = FACE[name]
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if attribute is None else getattr(loaded, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(FACE))
