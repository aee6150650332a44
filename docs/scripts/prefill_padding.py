"""How much regeneration prefills, and how much of it is padding: the slot decoder's admission
(`batched.SlotBook`) replayed, without a model, on the requests a GPU block answered
(`docs/bench-gpu/BLOCK/answers`: each conversation's turns, tokenized as `data regenerate` asks
them), in regenerate's order (conversations by key, a finished turn's follow-up first in the queue),
each answer as long as it was. A development script, not installed with the package: run it from a
checkout.

    python docs/scripts/prefill_padding.py docs/bench-gpu/h200-block4/answers [--slots 512 1024]

For each slot count it prints the prompt tokens prefilled and reused, the prefills' padding share,
forwards and positions: with the admitted prompts prefilled together, in groups of near lengths
(`batched.near_lengths`), and in such groups with each follow-up reusing what its slot holds of its
conversation (what `SlotDecoder` does; the follow-up taken to share its whole earlier prompt and
answer, which holds where the answer's text tokenizes back to its tokens); and a prefill time
modelled as LAUNCH_MS a forward plus POSITION_US a position (the fourth block's H200: 46 s for 596
forwards of 10.2k positions on average, no reuse).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import deque
from pathlib import Path

from specchat.app import training_target
from specchat.train.batched import (PREFILL_CHUNK, PREFILL_TOKENS, REFILL_SHARE, Request, Seat, SlotBook, admitted,
                                    near_lengths, prefill_chunks)
from specchat.train.regenerate import QUEUED_PER_SLOT

LAUNCH_MS, POSITION_US = 4.0, 7.5


def conversations(folder: Path, tokenizer) -> list[list[tuple[int, int]]]:
    """Per answered conversation (by key, then temperature): (request tokens, answer tokens) a turn."""
    records = [json.loads(line) for path in sorted(folder.glob("*.jsonl.gz")) for line in gzip.open(path, "rt")]
    records.sort(key=lambda record: (record["key"], record["temperature"]))
    turns = []
    for record in records:
        messages = record["messages"]
        turns.append([(len(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)),
                       len(tokenizer(message["content"])["input_ids"]) + 1)
                      for i, message in enumerate(messages) if message["role"] == "assistant"])
    return turns


def prefill(lengths: list[int], chunk: int) -> tuple[int, int, int]:
    """(positions, tokens, forwards) of one chunked prefill of prompts of these lengths (`SlotDecoder._prefill`'s)."""
    positions = tokens = forwards = 0
    for start, rows, width in prefill_chunks(lengths, chunk):
        positions += len(rows) * width
        tokens += sum(min(width, lengths[i] - start) for i in rows)
        forwards += 1
    return positions, tokens, forwards


def replay(turns: list[list[tuple[int, int]]], slots: int, how: str) -> dict:
    """SlotDecoder.run's admission over these conversations (CUDA's chunk, budget and refill share):
    `how` is "together", "grouped" or "reused" (grouped, follow-ups reusing their slots)."""
    chunk, budget = PREFILL_CHUNK["cuda"], PREFILL_TOKENS["cuda"]
    refill_at = max(1, round(REFILL_SHARE["cuda"] * slots))
    unasked, pending, done = iter(range(len(turns))), deque(), [0] * len(turns)
    book = SlotBook(slots)

    def ask(conversation: int, after: Request | None = None) -> None:
        if done[conversation] < len(turns[conversation]):
            n, _ = turns[conversation][done[conversation]]
            request = Request([0] * n, 0.0, conversation, after if how == "reused" else None)
            (pending.appendleft if after is not None else pending.append)(request)

    def top_up() -> None:
        while len(pending) < QUEUED_PER_SLOT * slots and (conversation := next(unasked, None)) is not None:
            ask(conversation)

    top_up()
    busy: dict[int, list] = {}  # slot -> [request, tokens still to come]
    positions = tokens = forwards = reused = 0
    while pending or busy:
        free = [slot for slot in range(slots) if slot not in busy]
        if pending and free and (not busy or len(free) >= refill_at):  # as SlotDecoder.run admits
            seats = book.admit(pending, free, chunk, budget) if how == "reused" else \
                [Seat(slot, request, 0) for slot, request in zip(free, admitted(pending, len(free), chunk, budget))]
            for group in near_lengths(seats) if how != "together" else [seats]:
                p, t, f = prefill([seat.length for seat in group], chunk)
                positions, tokens, forwards = positions + p, tokens + t, forwards + f
            for slot, request, shared in seats:
                busy[slot] = [request, turns[request.tag][done[request.tag]][1] - 1]
                reused += shared
            continue
        for slot, entry in list(busy.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                request = busy.pop(slot)[0]
                answer = turns[request.tag][done[request.tag]][1]  # its tokens, the stop token's included
                book.hold(slot, request, request.ids + [0] * (answer - 1))
                done[request.tag] += 1
                ask(request.tag, after=request)
                top_up()
    return {"prefilled": tokens, "reused": reused, "padding": round(1 - tokens / positions, 3), "forwards": forwards,
            "positions": positions, "prefill_s": round((forwards * LAUNCH_MS + positions * POSITION_US / 1000) / 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", type=Path, help="a block's kept answers (docs/bench-gpu/BLOCK/answers)")
    parser.add_argument("--slots", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--model", default=None, help="whose tokenizer (default: the profile's model)")
    args = parser.parse_args()
    tokenizer = training_target(args.model, None, "auto", "cpu", None).tokenizer  # (loads the model too: a few seconds)
    turns = conversations(args.answers, tokenizer)
    requests = [n for conversation in turns for n, _ in conversation]
    print(f"{len(turns):,} conversations, {len(requests):,} requests, "
          f"{sum(requests) / len(requests):.0f} tokens on average")
    for slots in args.slots:
        for how, said in (("together", "one prefill an admission"), ("grouped", "groups of near lengths"),
                          ("reused", "groups, follow-ups reusing their slots")):
            print(f"{slots} slots, {said}: {replay(turns, slots, how)}")


if __name__ == "__main__":
    main()
