#!/bin/sh
# The 1.5B drafted by the 0.5B: sps (its default, staged since 1bb3466) against sps+staged=off, one run each, one job at a time.
S=/work/main/.venv/bin/specchat
P=/work/main/docs/prompts
M="--model qwen2.5-coder-1.5b-instruct --interleave --breakdown"
$S bench $P/general10.jsonl   $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 128 --temperature 0 -o general10
$S bench $P/humaneval20.jsonl $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 256 --temperature 0 -o humaneval20
$S bench $P/cpu10.jsonl       $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 128 --temperature 0 -o cpu10
$S bench $P/rewrite10.jsonl   $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 256 --temperature 0 -o rewrite10
SPECCHAT_CPU_ISA=avx2 $S bench $P/general10.jsonl $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 128 --temperature 0 -o avx2-path-general10
# cpu10 at T=1 (cpu10-t1/), run before the others, the same code:
# $S bench $P/cpu10.jsonl $M --methods 'vanilla,sps,sps+staged=on' --max-new-tokens 128 --temperature 1 --seed 1 --repeat 2 -o cpu10-t1   (sps then: staged off by default)
# general10 again at 58a99f7 (the head keeps its last pass's positions through a rewind), 2026-11-30:
# $S bench $P/general10.jsonl $M --methods 'vanilla,sps+staged=off,sps,pld' --max-new-tokens 128 --temperature 0 -o general10-rewind-keeps
