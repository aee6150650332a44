"""The target's runtime: loading, its forward (specchat's own, fused on a quantized CPU target, or
transformers'), its KV cache, quantized layers and their kernel, the verify-cost curve, the machine
(the core's map: `specchat.decode`). It knows nothing of drafting or of the engine's cycle; it reads
the fixed layout's shapes (`engine.envelope`, `engine.graphs`) where the target is loaded for it."""
