"""The decoding core: token ids in, token ids out, lossless by construction.

It imports only itself, `drafters` and `specchat.errors`; nothing of the command line, the REPL,
profiles or settings. Its defaults are declared here (`options`) and the settings layer reads them.

    engine.py          Engine: prefill, plain steps, one speculative cycle (draft, verify, accept, compact)
    verify.py          which drafted tokens the target accepts (greedy and sampled, exact rules)
    sampling.py        temperature / top-p / top-k, the draw, greedy choices and margins
    tree.py            the draft tree and a cycle's record; EAGLE-1's static trees
    cache.py           the target's KV cache (transformers' Cache over `drafters.cache`'s storage)
    forward.py         specchat's own forward for Llama-family targets (eager or compiled) and its cache
    target.py          the target model at run time: loading from a folder, one forward
    quantized.py       specchat's weight-only int5/int4 CPU kernel (kernels/woq_linear.cpp)
    head_proposer.py   drafting trees with a draft head: EAGLE-1 static, EAGLE-2 dynamic, DEAGLE, Jakiro
    model_proposer.py  drafting chains with a small draft model (speculative sampling)
    lookup.py          prompt lookup: n-gram continuations of text already seen
    deagle.py          DEAGLE's dynamic depth
    calibrate.py       this machine's cost of verifying n tokens, which sizes CPU trees
    speedup.py         measuring a reply against plain decoding
    machine.py         the CPU, devices and the cache folder
    options.py         what the core can be asked for, and its defaults (torch-free)
"""
