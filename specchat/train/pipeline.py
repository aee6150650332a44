"""`specchat train` from files to a head folder: read, (regenerate,) encode, extract, train, save.

Intermediate results live in a work folder (by default under the cache, keyed by the target and
the data), so a second head for the same data reuses the regenerated answers and the features.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specchat import __version__
from specchat.chat import ChatFormat
from drafters import save_head
from drafters.eagle3 import default_feature_layers
from specchat.errors import UsageError
from specchat.decode.machine import cache_dir, hardware
from specchat.train import trainer
from specchat.train import data as data_mod
from specchat.train.features import FeatureStore, extract
from specchat.train.regenerate import regenerate
from specchat.train.trainer import PAPER_DRAFT_VOCAB, TrainConfig, build_head, draft_vocabulary, train

DEFAULT_MAX_TOKENS = 2048  # EAGLE's max_len
DEFAULT_HELD_OUT = 0.02


@dataclass
class PrepareOptions:
    data: list[str]
    regenerate: bool = False
    regenerate_batch: int = 32
    regenerate_max_tokens: int = 512
    regenerate_temperature: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    limit: int | None = None
    held_out: float = DEFAULT_HELD_OUT
    seed: int = 0


class TrainError(UsageError, ValueError):
    """Training cannot start (no usable data, an incompatible work folder, ...)."""


def default_work_dir(target_name: str, options: PrepareOptions) -> Path:
    parts = [target_name, options.regenerate, options.regenerate_max_tokens, options.regenerate_temperature,
             options.max_tokens, options.limit, options.seed]
    for name in options.data:
        path = Path(name).resolve()
        stat = path.stat()
        parts.append([str(path), stat.st_size, int(stat.st_mtime)])
    digest = hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "train" / digest


def prepare(target, options: PrepareOptions, work: Path, need_aux: bool, log, progress) -> tuple[FeatureStore, dict]:
    """Conversations -> (regenerated) -> token ids -> stored features. Returns the store and a data summary."""
    conversations, report = data_mod.read_conversations(options.data)
    log(f"read {report.summary()}")
    for example in report.examples:
        log(f"  skipped {example}")
    rng = random.Random(options.seed)
    rng.shuffle(conversations)
    if options.limit:
        conversations = conversations[: options.limit]
    summary = {"files": options.data, "read": report.read, "skipped": dict(report.skipped),
               "truncated_files": report.truncated, "used": None, "regenerated": 0}
    started = time.perf_counter()
    if options.regenerate:
        stop_ids = ChatFormat(target.tokenizer).stop_ids
        conversations = regenerate(
            conversations, target, work / "regenerated.jsonl", batch_size=options.regenerate_batch,
            max_new_tokens=options.regenerate_max_tokens, temperature=options.regenerate_temperature,
            stop_ids=stop_ids, progress=progress("regenerating answers"))
        summary["regenerated"] = len(conversations)
    else:
        prompt_only = [c for c in conversations if not c.has_responses]
        if prompt_only:
            log(f"skipped {len(prompt_only)} prompt-only records: they need --regenerate")
        conversations = [c for c in conversations if c.has_responses]
    summary["regenerate_seconds"] = round(time.perf_counter() - started, 1)
    sequences = []
    for conversation in conversations:
        encoded = data_mod.encode(conversation.messages, target.tokenizer, options.max_tokens)
        if encoded is not None and len(encoded[0]) >= 4:
            sequences.append(encoded)
    if len(sequences) < 2:
        raise TrainError(f"only {len(sequences)} usable conversations; training needs at least 2")
    summary["used"] = len(sequences)
    summary["tokens"] = sum(len(ids) for ids, _ in sequences)
    summary["assistant_tokens"] = sum(sum(mask) for _, mask in sequences)
    log(f"{len(sequences)} conversations, {summary['tokens']:,} tokens ({summary['assistant_tokens']:,} to predict)")
    aux_layers = default_feature_layers(target.num_layers) if need_aux else None
    folder = work / "features"
    existing = _complete_store(folder)
    started = time.perf_counter()
    if existing is not None and (not need_aux or existing.feature_layers) and len(existing) == len(sequences):
        store = existing
    else:
        store = extract(folder, sequences, target, aux_layers, progress("extracting target features"))
    summary["extract_seconds"] = round(time.perf_counter() - started, 1)
    return store, summary


def _complete_store(folder: Path) -> FeatureStore | None:
    try:
        store = FeatureStore(folder)
    except (OSError, ValueError, KeyError):
        return None
    return store if store.index.get("complete") else None


def split(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    indices = list(range(count))
    random.Random(seed + 1).shuffle(indices)
    held = max(1, min(count - 1, round(count * fraction))) if fraction > 0 else 0
    return indices[held:], indices[:held]


def train_head(target, store: FeatureStore, config: TrainConfig, output: Path, data_summary: dict, resume: bool,
               log, progress, max_shard_bytes: int | None = None) -> dict:
    """Train one head on the store and write it (published format + training.json) to `output`."""
    train_ids, held_out = split(len(store), data_summary.get("held_out_fraction", DEFAULT_HELD_OUT), config.seed)
    size = config.draft_vocab or PAPER_DRAFT_VOCAB
    vocab, coverage = (None, 1.0) if size >= target.vocab_size else draft_vocabulary(store, size, target.vocab_size)
    if vocab is not None:
        log(f"draft vocabulary: {len(vocab):,} tokens covering {coverage:.1%} of the assistant tokens")
    head = build_head(config.kind, target, config, vocab)
    started = time.perf_counter()
    state = train(head, target, store, train_ids, held_out, config, output, resume=resume, progress=progress)
    output.mkdir(parents=True, exist_ok=True)
    save_head(head, output, dtype=torch.bfloat16, max_shard_bytes=max_shard_bytes)
    record = {
        "specchat_version": __version__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kind": config.kind,
        "target": {"name": target.name, "layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size, "dtype": str(target.dtype).removeprefix("torch.")},
        "data": {**data_summary, "train_conversations": len(train_ids), "held_out_conversations": len(held_out)},
        "draft_vocab": {"size": None if vocab is None else len(vocab), "assistant_token_coverage": round(coverage, 4)},
        "recipe": recipe_description(config),
        "hyperparameters": asdict(config),
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "held_out_top1": state.evaluations,
        "train_seconds": round(time.perf_counter() - started, 1),
        "hardware": hardware(),
    }
    (output / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def recipe_description(config: TrainConfig) -> dict:
    steps = config.steps_unrolled()
    if config.kind == "eagle3":
        return {"paper": "EAGLE-3 (arXiv 2503.01840)", "loss": f"sum_i {trainer.STEP_DECAY}^i * CE over the draft vocabulary",
                "ttt_steps": steps, "paper_ttt_steps": trainer.PAPER_TTT_STEPS}
    base = {"feature_weight": trainer.FEATURE_WEIGHT, "probability_weight": trainer.PROBABILITY_WEIGHT,
            "feature_noise_uniform": trainer.FEATURE_NOISE, "unrolled_steps": steps}
    if config.kind == "jakiro":
        return {"paper": "Jakiro (arXiv 2502.06282)", "loss": "left + 0.5 * right (SmoothL1 + 0.1 CE each)",
                "right_weight": trainer.RIGHT_WEIGHT, **base}
    return {"paper": "EAGLE (arXiv 2401.15077)", "loss": "SmoothL1(feature) + 0.1 CE", **base}
