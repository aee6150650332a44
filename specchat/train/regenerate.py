"""Regeneration: the target writes the answers it will be trained to predict.

A draft head learns to predict the target; the target's own answers are therefore better training
data than a dataset's fixed responses (EAGLE-3, arXiv 2503.01840, §4; SpecForge calls this
self-distillation its largest lever). Each prompt's user turns are answered in order, each given
the target's own earlier answers (multi-turn where the source is), at every temperature asked for
(greedy, like the decoding heads mostly serve, and 1, which shows a head the target's other
likely continuations). The turns are answered many at a time by continuous batching
(`specchat.train.batched.SlotDecoder`; `KernelSlots` for a target of the CPU kernel's quantized
layers: a finished answer's slot takes the next prompt, a conversation's next turn is asked as soon
as its answer is in, and goes to the slot that still holds the conversation), and every answer goes
to a shard of the data folder (`specchat.train.datafolder`) as it ends, so a run stopped by its time
limit, Ctrl-C or a crash resumes where it stopped, on this machine or another.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specchat.decode import KVCache, cache_argument
from specchat.train.batched import Answer, Request, SlotTimes, slot_decoder
from specchat.train.data import read_conversations, render
from specchat.train.datafolder import GREEDY, DataFolder, Scan, ShardWriter, temperature_name
from specchat.train.options import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPT_TOKENS, REGENERATE_BATCH, on_device
from specchat.train.prompts import TrainingPrompt, normalized, prompt_record

QUEUED_PER_SLOT = 2  # prompts tokenized ahead of the slots that will take them


@dataclass(frozen=True)
class RegenerateOptions:
    temperatures: tuple[float, ...] = (GREEDY,)
    batch_size: int = REGENERATE_BATCH["cpu"]  # sequences decoded at once (the slots)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS  # a conversation stops at the turn that would pass it
    max_turns: int | None = None  # user turns answered per prompt (None: all of them)
    part: tuple[int, int] = (0, 1)  # (i, n): answer only the prompts in part i of n (machines share the work)
    max_seconds: float | None = None  # no answer starts after this many seconds (those under way finish)
    seed: int = 0


@dataclass
class RegenerateReport:
    answered: dict[str, int] = field(default_factory=dict)  # temperature name -> turns answered this run
    pending: dict[str, int] = field(default_factory=dict)  # ... turns still to answer in this part
    too_long: int = 0  # conversations stopped at a turn longer than max_prompt_tokens
    seconds: float = 0.0
    tokens: int = 0  # answer tokens drawn (those of stop tokens included)
    stopped: bool = False  # by the time limit
    scan: Scan | None = None  # the folder afterwards
    times: SlotTimes | None = None  # where the continuous batching's time went (None: transformers' generate)

    def summary(self) -> str:
        answered = ", ".join(f"{n:,} {name}" for name, n in self.answered.items()) or "nothing"
        pending = ", ".join(f"{n:,} {name}" for name, n in self.pending.items() if n)
        rate = f" ({self.tokens / self.seconds:,.0f} tokens/s)" if self.tokens and self.seconds else ""
        return (f"answered {answered} in {self.seconds:.0f} s{rate}" + (f"; still to answer: {pending}" if pending else "")
                + (f"; {self.too_long:,} conversations stopped at a turn past the prompt limit" if self.too_long else "")
                + ("; stopped by the time limit" if self.stopped else ""))

    def breakdown(self) -> str | None:
        """Where the time went, as one line (None for transformers' `generate`, which does not say)."""
        return self.times.summary(self.seconds) if self.times is not None else None


def batch_size_for(device: torch.device) -> int:
    """Sequences decoded at once unless asked for (--batch, --regenerate-batch)."""
    return on_device(REGENERATE_BATCH, device)


def in_part(key: str, part: tuple[int, int]) -> bool:
    index, count = part
    return zlib.crc32(key.encode()) % count == index


@dataclass
class Conversation:
    """One prompt answered at one temperature: the turns done and the conversation so far."""

    prompt: TrainingPrompt
    temperature: float
    done: int
    history: list[dict]
    limit: int  # turns to answer
    too_long: bool = False


@torch.inference_mode()
def regenerate(prompts: list[TrainingPrompt], target, folder: DataFolder, options: RegenerateOptions,
               stop_ids: frozenset[int], progress: Callable[[int, int], None] | None = None,
               closed: Callable[[Path], None] | None = None) -> RegenerateReport:
    """Answer the prompts' user turns into `folder`, resuming from what its shards hold. `closed` is
    called with this run's shard once it is closed, however the run ends (its time limit, Ctrl-C,
    SIGTERM, an error), if it holds an answer."""
    started, report = time.monotonic(), RegenerateReport()
    scan = folder.scan()
    conversations = []
    for prompt in (p for p in prompts if in_part(p.key, options.part)):  # both temperatures of a prompt together
        for temperature in options.temperatures:
            answered = scan.answers.get((prompt.key, temperature))
            done, history = _agreeing(answered["messages"] if answered else [], prompt)
            conversations.append(Conversation(prompt, temperature, done, history,
                                              min(len(prompt.turns), options.max_turns or len(prompt.turns))))
    report.answered = {temperature_name(t): 0 for t in options.temperatures}
    total, finished = sum(c.limit for c in conversations), sum(min(c.done, c.limit) for c in conversations)
    unasked, pending = iter(conversations), deque()
    queued = QUEUED_PER_SLOT * options.batch_size

    first_turn: dict[str, list[int]] = {}  # the last prompt's first turn, which every temperature asks

    def ask(conversation: Conversation, after: Request | None = None) -> None:
        """Queue the conversation's next turn; a follow-up (of the answer to `after`) goes first, so
        that conversations finish, and the slot that answered `after` still holds most of its prompt."""
        request = _next_turn(conversation, target.tokenizer, options.max_prompt_tokens, after, first_turn)
        if request is not None:
            (pending.appendleft if after is not None else pending.append)(request)

    def top_up() -> None:
        while len(pending) < queued and (conversation := next(unasked, None)) is not None:
            ask(conversation)

    def admit() -> bool:
        report.stopped = options.max_seconds is not None and time.monotonic() - started > options.max_seconds
        return not report.stopped

    decoder = slot_decoder(target)(target, options.batch_size, options.max_prompt_tokens, options.max_new_tokens,
                                   stop_ids, seed=options.seed ^ zlib.crc32(conversations[0].prompt.key.encode())) \
        if target.own_forward is not None and conversations else None
    answers = decoder.run(pending, admit) if decoder is not None else _generated(target, pending, options, stop_ids, admit)
    top_up()
    shard = folder.writer()
    try:
        with shard:
            for answer in answers:
                _written(answer, target.tokenizer, shard, report)
                ask(answer.request.tag[0], after=answer.request)
                top_up()
                finished += 1
                if progress:
                    progress(finished, total)
    finally:
        if closed is not None and shard.closed is not None:
            closed(shard.closed)
    report.stopped = report.stopped and any(c.done < c.limit and not c.too_long for c in conversations)
    report.too_long = sum(c.too_long for c in conversations)
    report.pending = {temperature_name(t): sum(max(0, c.limit - c.done) for c in conversations
                                               if c.temperature == t and not c.too_long)
                      for t in options.temperatures}
    report.scan = folder.scan()  # the manifest says what this run added
    report.seconds = time.monotonic() - started
    report.times = decoder.times if decoder is not None else None
    return report


def _written(answer: Answer, tokenizer, shard: ShardWriter, report: RegenerateReport) -> None:
    """An answer into its conversation's history and, as a record, into the shard (flushed: a run cut
    off keeps it)."""
    conversation, messages = answer.request.tag
    conversation.done += 1
    reply = tokenizer.decode(answer.tokens, skip_special_tokens=True)
    conversation.history = messages + [{"role": "assistant", "content": reply}]
    shard.write({"key": conversation.prompt.key, "turn": conversation.done, "temperature": conversation.temperature,
                 "messages": conversation.history, "finish": answer.finish, "source": conversation.prompt.source})
    shard.flush()
    report.answered[temperature_name(conversation.temperature)] += 1
    report.tokens += len(answer.tokens) + (answer.finish == "stop")


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


def _agreeing(messages: list[dict], prompt: TrainingPrompt) -> tuple[int, list[dict]]:
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


def _next_turn(conversation: Conversation, tokenizer, max_prompt_tokens: int, after: Request | None,
               first_turn: dict[str, list[int]]) -> Request | None:
    """The request of a conversation's next user turn (tagged with it and the messages asked; `after`:
    the request its last answer answered), or None: all its turns are answered, or this one is longer
    than `max_prompt_tokens` (which ends it). `first_turn` keeps the last prompt's first turn, rendered
    once for the temperatures that ask it one after the other (a render: 0.49 ms of a Zen 3 core)."""
    prompt, turn = conversation.prompt, conversation.done
    if turn >= conversation.limit or conversation.too_long:
        return None
    earlier = conversation.history or ([{"role": "system", "content": prompt.system}] if prompt.system else [])
    messages = earlier + [{"role": "user", "content": prompt.turns[turn]}]
    if conversation.history:
        ids = render(tokenizer, messages, True)
    else:
        if prompt.key not in first_turn:
            first_turn.clear()
            first_turn[prompt.key] = render(tokenizer, messages, True)
        ids = list(first_turn[prompt.key])
    if len(ids) > max_prompt_tokens:
        conversation.too_long = True
        return None
    return Request(ids, conversation.temperature, (conversation, messages), after)


def _generated(target, pending: deque, options: RegenerateOptions, stop_ids, admit) -> Iterator[Answer]:
    """Answers by transformers' `generate`, in batches of one temperature (left-padded): for a target
    whose layers specchat's forward does not run (`specchat.decode.runtime.forward.unsupported_reason`)."""
    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids or {0})
    while pending and admit():
        temperature = pending[0].temperature
        batch = [r for r in pending if r.temperature == temperature][: options.batch_size]
        for request in batch:
            pending.remove(request)
        width = max(len(r.ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.ids) :] = torch.tensor(request.ids)
            attention[row, width - len(request.ids) :] = 1
        if temperature > 0:  # a batch's draws follow from the seed and its first prompt: reruns repeat them
            torch.manual_seed(options.seed ^ zlib.crc32(batch[0].tag[0].prompt.key.encode()))
        output = target.model.generate(
            input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
            **{cache_argument(target.model): KVCache()},  # grows in place; the default cache re-concatenates every step
            max_new_tokens=options.max_new_tokens, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
            pad_token_id=pad, eos_token_id=sorted(stop_ids) or None,
        )
        for row, request in enumerate(batch):
            new = output[row, width:].tolist()
            ended = next((i for i, token in enumerate(new) if token in stop_ids), None)
            yield Answer(request, new[:ended], "stop" if ended is not None else "length")
