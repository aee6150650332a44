"""Regeneration: the target writes the answers it will be trained to predict.

A draft head learns to predict the target; the target's own answers are therefore better training
data than a dataset's fixed responses (EAGLE-3, arXiv 2503.01840, §4; SpecForge calls this
self-distillation its largest lever). Each prompt's user turns are answered in order, each given
the target's own earlier answers (multi-turn where the source is), at every temperature asked for
(greedy, like the decoding heads mostly serve, and 1, which shows a head the target's other
likely continuations). Prompts are answered in batches, and every answer goes to a shard of the
data folder (`specchat.train.datafolder`) as its batch ends, so a run stopped by its time limit,
Ctrl-C or a crash resumes where it stopped, on this machine or another.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specchat.decode.runtime.cache import KVCache
from specchat.train.data import read_conversations
from specchat.train.datafolder import GREEDY, DataFolder, Scan, temperature_name
from specchat.train.options import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPT_TOKENS
from specchat.train.prompts import PromptRecord, normalized, prompt_record

DEFAULT_BATCH = 32  # sequences per generate call; a CPU does ~32 tokens per forward for the price of ~1.3
GPU_BATCH = 256  # a GPU needs many rows per forward to be busy
SORT_GROUP_BATCHES = 8
# A batch holds at most batch_size * (TYPICAL_PROMPT + max_new_tokens) cached positions: every
# decoding step reads all of them, so long prompts share a batch with fewer others.
TYPICAL_PROMPT = 128


@dataclass(frozen=True)
class RegenerateOptions:
    temperatures: tuple[float, ...] = (GREEDY,)
    batch_size: int = DEFAULT_BATCH
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS  # a conversation stops at the turn that would pass it
    max_turns: int | None = None  # user turns answered per prompt (None: all of them)
    part: tuple[int, int] = (0, 1)  # (i, n): answer only the prompts in part i of n (machines share the work)
    max_seconds: float | None = None  # no batch starts after this many seconds
    seed: int = 0


@dataclass
class RegenerateReport:
    answered: dict[str, int] = field(default_factory=dict)  # temperature name -> turns answered this run
    pending: dict[str, int] = field(default_factory=dict)  # ... turns still to answer in this part
    too_long: int = 0  # conversations stopped at a turn longer than max_prompt_tokens
    seconds: float = 0.0
    stopped: bool = False  # by the time limit
    scan: Scan | None = None  # the folder afterwards

    def summary(self) -> str:
        answered = ", ".join(f"{n:,} {name}" for name, n in self.answered.items()) or "nothing"
        pending = ", ".join(f"{n:,} {name}" for name, n in self.pending.items() if n)
        return (f"answered {answered} in {self.seconds:.0f} s" + (f"; still to answer: {pending}" if pending else "")
                + (f"; {self.too_long:,} conversations stopped at a turn past the prompt limit" if self.too_long else "")
                + ("; stopped by the time limit" if self.stopped else ""))


def batch_size_for(device: torch.device) -> int:
    """Prompts per generation batch unless one is asked for (--batch, --regenerate-batch)."""
    return GPU_BATCH if device.type == "cuda" else DEFAULT_BATCH


def in_part(key: str, part: tuple[int, int]) -> bool:
    index, count = part
    return zlib.crc32(key.encode()) % count == index


@torch.inference_mode()
def regenerate(prompts: list[PromptRecord], target, folder: DataFolder, options: RegenerateOptions,
               stop_ids: frozenset[int], progress: Callable[[int, int], None] | None = None) -> RegenerateReport:
    """Answer the prompts' user turns into `folder`, resuming from what its shards hold."""
    started, report = time.monotonic(), RegenerateReport()
    scan = folder.scan()
    mine = [p for p in prompts if in_part(p.key, options.part)]
    limit = {p.key: min(len(p.turns), options.max_turns or len(p.turns)) for p in mine}
    total = sum(limit.values()) * len(options.temperatures)
    finished = 0
    with folder.writer() as shard:
        for temperature in options.temperatures:
            name = temperature_name(temperature)
            history, done = {}, {}
            for prompt in mine:
                answered = scan.answers.get((prompt.key, temperature))
                done[prompt.key], history[prompt.key] = _agreeing(answered["messages"] if answered else [], prompt)
            report.answered[name], too_long = 0, set()
            finished += sum(min(done[key], limit[key]) for key in done)
            while not report.stopped:
                todo = _next_turns(mine, limit, done, history, too_long, target.tokenizer, options.max_prompt_tokens,
                                   options.batch_size)
                if not todo:
                    break
                for batch in _batches(todo, options.batch_size, options.max_new_tokens):
                    if options.max_seconds is not None and time.monotonic() - started > options.max_seconds:
                        report.stopped = True
                        break
                    for (_, prompt, _, messages), (reply, finish) in zip(batch, _answer(
                            batch, target, temperature, options, stop_ids)):
                        turn = done[prompt.key] + 1
                        history[prompt.key] = messages + [{"role": "assistant", "content": reply}]
                        done[prompt.key] = turn
                        shard.write({"key": prompt.key, "turn": turn, "temperature": temperature,
                                     "messages": history[prompt.key], "finish": finish, "source": prompt.source})
                    shard.flush()
                    report.answered[name] += len(batch)
                    finished += len(batch)
                    if progress:
                        progress(finished, total)
            report.too_long += len(too_long)
            report.pending[name] = sum(limit[k] - done[k] for k in limit if k not in too_long)
    report.scan = folder.scan()  # the manifest says what this run added
    report.seconds = time.monotonic() - started
    return report


def import_answers(folder: DataFolder, paths: list[str], temperature: float = GREEDY) -> int:
    """Conversations the target already answered (an earlier run's file: user turns and its own
    answers) as records of `folder`, each answered turn under its prompt's key; returns how many.
    The user vouches that the answers are the target's, at `temperature`."""
    conversations, _ = read_conversations(paths)
    count = 0
    with folder.writer() as shard:
        for conversation in conversations:
            record = prompt_record(conversation.messages, conversation.source)
            if record is None:
                continue
            turn = 0
            for index, message in enumerate(conversation.messages):
                turn += message["role"] == "user"
                if message["role"] == "assistant" and turn and message["content"].strip():
                    shard.write({"key": record.key, "turn": turn, "temperature": temperature,
                                 "messages": conversation.messages[: index + 1], "finish": "imported",
                                 "source": conversation.source})
                    count += 1
    folder.scan()
    return count


def _agreeing(messages: list[dict], prompt: PromptRecord) -> tuple[int, list[dict]]:
    """How many of the prompt's turns an answered conversation holds, and it cut there: the turns
    before an answer must be the prompt's (an imported answer may have gone on otherwise)."""
    users, answered, cut = 0, 0, 0
    for index, message in enumerate(messages):
        if message["role"] == "user":
            if users >= len(prompt.turns) or normalized(message["content"]) != normalized(prompt.turns[users]):
                break
            users += 1
        elif message["role"] == "assistant" and users:
            answered, cut = users, index + 1
    return answered, messages[:cut]


def _next_turns(prompts, limit, done, history, too_long, tokenizer, max_prompt_tokens, batch_size: int) -> list:
    """(length, prompt, ids, messages) of every prompt's next user turn, in groups of a few
    batches sorted by length: little padding, and a run stopped early has answered a random
    sample rather than only the shortest prompts."""
    todo = []
    for prompt in prompts:
        turn = done[prompt.key]
        if turn >= limit[prompt.key] or prompt.key in too_long:
            continue
        earlier = history.get(prompt.key) or ([{"role": "system", "content": prompt.system}] if prompt.system else [])
        messages = earlier + [{"role": "user", "content": prompt.turns[turn]}]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        if len(ids) > max_prompt_tokens:
            too_long.add(prompt.key)
            continue
        todo.append((len(ids), prompt, ids, messages))
    group = batch_size * SORT_GROUP_BATCHES
    return [item for start in range(0, len(todo), group)
            for item in sorted(todo[start : start + group], key=lambda x: x[0])]


def _answer(batch, target, temperature: float, options: RegenerateOptions, stop_ids) -> list[tuple[str, str]]:
    """The target's answers to one batch of prompts (left-padded), and why each ended."""
    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids or {0})
    width = max(length for length, *_ in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (length, _, ids, _) in enumerate(batch):
        input_ids[row, width - length :] = torch.tensor(ids)
        attention[row, width - length :] = 1
    if temperature > 0:  # a batch's draws follow from the seed and its first prompt: reruns repeat them
        torch.manual_seed(options.seed ^ zlib.crc32(batch[0][1].key.encode()))
    output = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
        past_key_values=KVCache(),  # grows in place; the default cache re-concatenates every step
        max_new_tokens=options.max_new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
        pad_token_id=pad, eos_token_id=sorted(stop_ids) or None,
    )
    answers = []
    for row in range(len(batch)):
        new = output[row, width:].tolist()
        ended = next((i for i, token in enumerate(new) if token in stop_ids), None)
        answers.append((tokenizer.decode(new[:ended], skip_special_tokens=True),
                        "stop" if ended is not None else "length"))
    return answers


def _batches(todo: list, rows: int, max_new_tokens: int):
    """Consecutive batches of at most `rows` prompts and rows * (TYPICAL_PROMPT + max_new_tokens)
    cached positions (padded)."""
    budget = rows * (TYPICAL_PROMPT + max_new_tokens)
    batch: list = []
    for item in todo:
        width = max([item[0]] + [length for length, *_ in batch])
        if batch and (len(batch) >= rows or (len(batch) + 1) * (width + max_new_tokens) > budget):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch
