"""The decoding core: token ids in, token ids out, lossless by construction.

It imports only itself, `drafters` and `specchat.errors`; nothing of the command line, the REPL,
profiles or settings. Its defaults are declared here (`options`) and the settings layer reads them.

    engine.py          Engine: prefill, plain steps, one speculative cycle (draft, verify, accept, compact)
    fixed_engine.py    FixedEngine: the same on the fixed envelope, each step a fixed shape, one host read
    envelope.py        the fixed envelope: buckets, attention spans, the fixed-size device tree, its masks
    graphs.py          fixed-shape steps captured as CUDA graphs and replayed
    verify.py          which drafted tokens the target accepts (greedy and sampled, exact rules; host and device)
    sampling.py        temperature / top-p / top-k, the draw, greedy choices and margins
    tree.py            the draft tree and a cycle's record; EAGLE-1's static trees
    tree_shapes.py     what a head drafts: EAGLE-1 static, EAGLE-2 dynamic, DEAGLE, Jakiro (as tensors)
    head_proposer.py   drafting those shapes with a draft head on the host engine
    fixed_heads.py     ... and on the fixed envelope (selection and lookup merging on the device)
    hybrid.py          hybrid drafting's candidates and what it learns (lookup rates, trust in the head)
    fixed_drafters.py  prompt lookup, a draft model and an oracle on the fixed envelope
    model_proposer.py  drafting chains with a small draft model (speculative sampling)
    lookup.py          prompt lookup: n-gram continuations of text already seen
    deagle.py          DEAGLE's dynamic depth
    cache.py           the target's KV cache (transformers' Cache over `drafters.cache`'s storage)
    forward.py         specchat's own forward for Llama-family targets (eager or compiled) and its cache
    target.py          the target model at run time: its runtime (own forward, compiled, fixed envelope), one forward
    loading.py         loading it from a folder: device, dtype, quantization, attention
    quantized.py       weight-only int5/int4 linear layers for the CPU: the packed format, the layers
    woq_kernel.py      their kernel (kernels/woq_linear.cpp): its build and the CPU path it runs
    calibrate.py       this machine's cost of verifying n tokens, which sizes CPU trees
    speedup.py         measuring a reply against plain decoding
    machine.py         the CPU, devices and the cache folder
    options.py         what the core can be asked for, and its defaults (torch-free)
"""
