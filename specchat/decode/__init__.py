"""The decoding core: token ids in, token ids out, lossless by construction.

It imports only itself, `drafters` and `specchat.errors`; nothing of the command line, the REPL,
profiles or settings. Its defaults are declared here (`options`) and the settings layer reads them.

One engine runs every method on one of two cache layouts; where the layouts need different code it
sits in the layout (or, for a drafter, in its layout's subclass or branch). Three rules have two
forms, one on the host over lists (the reference, and the CPU's: no tensor operations per cycle)
and one on the device (the fixed layout's, which may not read the host): which candidates are
verified (`drafting.selection`), the verify forward's inputs (`engine.growing.verify_inputs`,
`engine.fixed.verify_rows`) and sampled acceptance (`acceptance.verify`). Each package imports only
those below it (acceptance and drafting share the tree type):

    engine/            the decoding cycle
      engine.py        Engine: prefill, plain steps, one speculative cycle; the Proposer protocol
      growing.py       GrowingLayout: exact sizes, a growing cache (trim, compact), host reads (CPUs)
      fixed.py         FixedLayout: fixed capacity, bucketed sizes, captured steps, one read per cycle (CUDA)
    drafting/          what each method drafts
      tree.py          the draft tree (one type for both layouts), a cycle's record, EAGLE-1's static trees
      shapes.py        what a head drafts: EAGLE-1 static, EAGLE-2, DEAGLE, Jakiro; the tree budget
      growth.py        what a shape grows with: the head's steps (each layout's), the candidate table
      heads.py         drafting those shapes with a draft head (its cache on each layout)
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
      woq_kernel.py    their kernel (kernels/: woq_linear.cpp, decoder.cpp): its build, the CPU path it runs
      calibrate.py     this machine's cost of verifying n tokens, which sizes CPU trees (healed by live forwards)
      machine.py       the CPU, devices, the cache folder, other processes' load
    options.py         what the core can be asked for, and its defaults (torch-free)
"""
