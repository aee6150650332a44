"""The GPU agenda in one block of device time (docs/gpu-agenda.md): stage the model, the heads and
the prompts in as few calls as the limit on what a call carries allows, check the runtime and bench
the real 0.5B, answer the prompts at both temperatures, train the EAGLE-3 head and bring it back.

    python -m specchat.train.agenda pack DATA          here: what the GPU machine needs, one piece per call
    python3 -m specchat.train.agenda device [PIECE] …  there: take a piece in, then run the stages asked for
    python -m specchat.train.agenda collect FILES …    here: the returned files into place, the answers
                                                       also kept in the block's record (--keep), committed

The GPU machine has torch (CUDA), transformers and click, but no gguf, no prompt_toolkit and no
network; a call carries at most 64 MiB (the working tree included), runs at most 10 minutes and
brings back at most 8 files of 16 MiB; a session has 15 minutes of it, and a machine idle for 30 s
is given back with all it held. So a piece is chunks of whole files (wheels and prompts first, so
the first call can run the runtime check while the model is still on its way), each file checked
by its sha256 once all its chunks are there and kept in /tmp/agenda while the machine stays warm.
The stages run `python3 -m specchat ...`, with the carried wheels on the path. With `--detach`
they run as a chain in a process session of their own that outlives the call (the machine stays
while calls follow one another), so the GPU works while the next pieces come and between calls;
`--wait STAGE` brings a finished stage's results back.
"""

from __future__ import annotations

import click

from specchat.train.agenda import back, pieces, stages

cli = click.Group("agenda", commands=[pieces.pack, stages.device, back.collect],
                  help="The GPU agenda in one block of device time (docs/gpu-agenda.md).")
