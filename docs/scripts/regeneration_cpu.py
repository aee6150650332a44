"""Regeneration's throughput: the slot decoder (continuous batching, `specchat data regenerate`)
against transformers' `generate` (the path it replaced, `regenerate._generated`), in one process
on the same prompts, alternating (`--rounds` times over). A development script, not installed with
the package: run it from a checkout (it reads the prompts in docs/).

    A: 8 prompts, batch 8, 64 new tokens each, no stop token: both decode the same tokens (cost per token)
    B: 16 prompts, batch 8, up to 128 new tokens, ending at the chat's stop tokens (useful tokens/s)

    python docs/scripts/regeneration_cpu.py [--dtype auto|float32|bfloat16] [--rounds N]

Each line gives wall time, CPU time and the cores kept busy: a run another job paused shows few.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch

from specchat.app import training_target
from specchat.chat import ChatFormat
from specchat.train.batched import Request, SlotDecoder
from specchat.train.regenerate import _generated

PROMPTS = (Path("docs/prompts/cpu10.jsonl"), Path("docs/prompts/low-copy10.jsonl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    target = training_target(None, None, args.dtype, "cpu", None)
    print(target.name, target.dtype, "threads", torch.get_num_threads(), flush=True)
    texts = [json.loads(line)["prompt"] for name in PROMPTS for line in open(name)]
    prompts = [ids for ids in (list(target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False))
        for text in texts) if len(ids) < 200]

    def slots(chosen, batch, new_tokens, stops):
        decoder = SlotDecoder(target, slots=batch, max_prompt_tokens=max(map(len, chosen)),
                              max_new_tokens=new_tokens, stop_ids=stops)
        return {a.request.tag: a.tokens for a in decoder.run(deque(Request(p, 0.0, i) for i, p in enumerate(chosen)))}

    def generate(chosen, batch, new_tokens, stops):
        options = SimpleNamespace(batch_size=batch, max_new_tokens=new_tokens, seed=0)
        pending = deque(Request(p, 0.0, i) for i, p in enumerate(chosen))
        return {a.request.tag: a.tokens for a in _generated(target, pending, options, stops, lambda: True)}

    scenarios = {"A": (prompts[:8], 8, 64, frozenset()), "B": (prompts[:16], 8, 128, ChatFormat(target.tokenizer).stop_ids)}
    answers = {}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for scenario, setting in scenarios.items():
                for name, decode in (("generate", generate), ("slots", slots)):
                    wall, cpu = time.perf_counter(), time.process_time()
                    answers[scenario, name] = decode(*setting)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    tokens = sum(map(len, answers[scenario, name].values()))
                    print(f"round {round_} {scenario} {name}: {tokens} tokens, {tokens / wall:.1f} tok/s "
                          f"({wall:.1f} s; {cpu:.1f} CPU-s, {cpu / wall:.2f} cores)", flush=True)
    for scenario in scenarios:
        a, b = answers[scenario, "generate"], answers[scenario, "slots"]
        print(f"{scenario}: {sum(a[k] == b[k] for k in a)}/{len(a)} answers identical")


if __name__ == "__main__":
    main()
