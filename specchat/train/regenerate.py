"""`--regenerate`: the target writes the responses it will be trained to predict.

A draft head learns to predict the target; the target's own answers are therefore better
training data than a dataset's fixed responses (EAGLE-3, arXiv 2503.01840, §4). Prompts are
answered in batches (greedy by default, like the decoding the heads mostly serve), and every
answer is appended to a cache file as soon as its batch is done, so an interrupted run resumes
where it stopped and later runs reuse the answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from specchat.decode.cache import KVCache
from specchat.inputs import file_lines
from specchat.train.data import TrainingConversation

DEFAULT_BATCH = 32  # sequences per generate call; a CPU does ~32 tokens per forward for the price of ~1.3
DEFAULT_MAX_NEW_TOKENS = 512
DEFAULT_MAX_PROMPT_TOKENS = 1024
SORT_GROUP_BATCHES = 8
# A batch holds at most batch_size * (TYPICAL_PROMPT + max_new_tokens) cached positions: every
# decoding step reads all of them, so long prompts share a batch with fewer others.
TYPICAL_PROMPT = 128


def prompt_key(messages: list[dict]) -> str:
    return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def load_cache(path: Path) -> dict[str, dict]:
    done = {}
    if path.is_file():
        for line in file_lines(path.read_text(encoding="utf-8")):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by an interrupted write; its prompt is simply redone
            done[entry["key"]] = entry
    return done


@torch.inference_mode()
def regenerate(conversations: list[TrainingConversation], target, cache_path: Path, *,
               batch_size: int = DEFAULT_BATCH, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, temperature: float = 0.0,
               stop_ids: frozenset[int] = frozenset(), progress: Callable[[int, int], None] | None = None,
               ) -> list[TrainingConversation]:
    """Answer the first user turn of every conversation with the target; return the new conversations."""
    tokenizer = target.tokenizer
    done = load_cache(cache_path)
    prompts = {}
    for conversation in conversations:
        messages = conversation.first_prompt()
        if messages:
            prompts.setdefault(prompt_key(messages), messages)
    todo = []
    for key, messages in prompts.items():
        if key in done:
            continue
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        if len(ids) <= max_prompt_tokens:
            todo.append((len(ids), key, ids, messages))
    # Sort by length only within groups of a few batches: little padding, and a run stopped early
    # has answered a random sample of the prompts rather than only the shortest ones.
    group = batch_size * SORT_GROUP_BATCHES
    todo = [item for start in range(0, len(todo), group) for item in sorted(todo[start : start + group], key=lambda x: x[0])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids or {0})
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    finished = 0
    with open(cache_path, "a", encoding="utf-8") as sink:
        for batch in _batches(todo, batch_size, batch_size * (TYPICAL_PROMPT + max_new_tokens), max_new_tokens):
            width = max(length for length, *_ in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (length, _, ids, _) in enumerate(batch):
                input_ids[row, width - length :] = torch.tensor(ids)
                attention[row, width - length :] = 1
            output = target.model.generate(
                input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
                past_key_values=KVCache(),  # grows in place; the default cache re-concatenates every step
                max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                pad_token_id=pad, eos_token_id=sorted(stop_ids) or None,
            )
            for row, (_, key, _, messages) in enumerate(batch):
                new = output[row, width:].tolist()
                ended = next((i for i, token in enumerate(new) if token in stop_ids), None)
                reply = tokenizer.decode(new[:ended], skip_special_tokens=True)
                entry = {"key": key, "messages": messages + [{"role": "assistant", "content": reply}],
                         "finish": "stop" if ended is not None else "length"}
                sink.write(json.dumps(entry, ensure_ascii=False) + "\n")
                done[key] = entry
            sink.flush()
            finished += len(batch)
            if progress:
                progress(finished, len(todo))
    return [TrainingConversation(done[key]["messages"], f"regenerated#{key[:8]}") for key in prompts
            if key in done and done[key]["messages"][-1]["content"].strip()]


def _batches(todo: list, rows: int, budget: int, max_new_tokens: int):
    """Consecutive batches of at most `rows` prompts and `budget` cached positions (padded)."""
    batch: list = []
    for item in todo:
        width = max([item[0]] + [length for length, *_ in batch])
        if batch and (len(batch) >= rows or (len(batch) + 1) * (width + max_new_tokens) > budget):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch
