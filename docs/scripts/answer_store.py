"""Fill this machine's store of earlier answers (`--answer-index`, `specchat.answers`) for one
tokenizer with the newest answers of a regenerated-answers file that fit in `--tokens`, as a store
that a user's chats have filled to its bound would hold them. A development script, not installed
with the package: it measures what a full store does to lookup (`docs/bench-cpu-drafts/xeon-avx512/`,
"A full store of earlier answers").

    python docs/scripts/answer_store.py ANSWERS.jsonl [--model DIR] [--tokens N]

It replaces the store it fills (moved aside to `<store>.before`, which it says): move that back
afterwards. `bench` reads a store only with `--answer-index on` (or `METHOD+answer_index=on`).
"""

from __future__ import annotations

import argparse
import json
from array import array
from pathlib import Path

from transformers import AutoTokenizer

from specchat.answers import AnswerStore
from specchat.decode import ANSWER_TOKENS, cache_dir, prompt_key
from specchat.inputs import file_lines

MODEL = cache_dir() / "models" / "qwen2.5-coder-0.5b-instruct-bfloat16"  # the embedded default, converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", type=Path, help="JSON lines with `messages`: a user turn, then the answer")
    parser.add_argument("--model", type=Path, default=MODEL, help="the folder whose tokenizer the store is for")
    parser.add_argument("--tokens", type=int, default=ANSWER_TOKENS, help="the newest answers that fit in this many tokens")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    store = AnswerStore.for_tokenizer(tokenizer)
    answers = []  # (prompt key, answer ids), newest last
    for line in filter(str.strip, file_lines(args.answers.read_text())):
        user, answer = json.loads(line)["messages"][:2]
        answers.append((prompt_key(tokenizer.encode(user["content"], add_special_tokens=False)),
                        tokenizer.encode(answer["content"], add_special_tokens=False)))
    kept, total = [], 0
    for key, ids in reversed(answers):
        if total + len(ids) > args.tokens:
            break
        kept.append((key, ids))
        total += len(ids)
    if store.folder.exists():
        aside = store.folder.with_name(store.folder.name + ".before")
        store.folder.rename(aside)
        print(f"the store there before: {aside}")
    store.folder.mkdir(parents=True)
    ids, lines = array("I"), []
    for key, answer in reversed(kept):
        lines.append(json.dumps({"prompt": key, "start": len(ids), "length": len(answer), "time": 0}))
        ids.extend(answer)
    store.tokens_path.write_bytes(ids.tobytes())
    store.records_path.write_text("".join(f"{line}\n" for line in lines))
    print(f"{store.folder}: {len(kept)} answers, {len(ids)} tokens")


if __name__ == "__main__":
    main()
