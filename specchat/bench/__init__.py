"""`specchat bench`: every method against plain decoding on the same prompts, as Spec-Bench measures them.

    run.py        the command: each method's settings and draft, the target loaded once, methods in
                  turn (or interleaved), progress, Ctrl-C, the terminal tables
    measure.py    the measurement: the protocol (warm-up, questions turn by turn), the Spec-Bench
                  statistics, identical answers and where they diverge, results.json/.csv and plots
    breakdown.py  where a decoding cycle's time goes per method (`--breakdown`)

Other tools' implementations run on the same target and prompts as peers (`specchat.peers`).
The command line imports `run_bench` from here when `bench` runs (torch and transformers load then).
"""

from __future__ import annotations

from specchat.bench.run import run_bench

__all__ = ["run_bench"]
