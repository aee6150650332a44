"""`specchat train` from files to a head folder: read, (regenerate,) encode, extract (or not: live
features), train, save.

`run` is the command's one entry point, once the target is loaded: it holds the policy (defaults
by device, the work folder, --prepare-only, the training recipe's config, the exports) and says
what it does through a `log` callback. Intermediate results live in a work folder (by default
under the cache, keyed by the target and the data), so a second head for the same data reuses the
regenerated answers and the features.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specchat import __version__
from specchat import exports as exporting
from specchat import sources
from specchat.chat import ChatFormat
from drafters import FORMATS, save_head
from drafters.eagle3 import default_feature_layers
from specchat.errors import UsageError
from specchat.inputs import write_atomically
from specchat.decode import cache_dir, hardware, unsupported_reason
from specchat.train import checkpoint as ckpt
from specchat.train import data as data_mod
from specchat.train.features import FeatureStore, LiveFeatures, extract, live_features_fit
from specchat.train.datafolder import MANIFEST, DataFolder
from specchat.train.losses import RIGHT_WEIGHT
from specchat.train.options import FEATURE_CHOICES, PAPER_DRAFT_VOCAB, TrainOptions
from specchat.train.prompts import prompt_record
from specchat.train.regenerate import RegenerateOptions, batch_size_for, regenerate
from specchat.train.trainer import (TrainConfig, assistant_token_counts, build_head, covered_share,
                                    draft_vocabulary, head_class, train)


@dataclass
class PrepareOptions:
    """What preparing the data takes (TrainOptions' part of it, with the device's defaults filled in)."""

    data: list[str]
    regenerate: bool
    regenerate_batch: int
    regenerate_max_tokens: int
    regenerate_temperature: float
    max_tokens: int
    limit: int | None
    seed: int
    extract_tokens: int | None  # padded positions per target forward; None: by device
    live_features: bool  # the target computes each batch's features on the device (no feature files)


class TrainError(UsageError, ValueError):
    """Training cannot start (no usable data, an incompatible work folder, ...)."""


def run(target, options: TrainOptions, log: Callable[[str], None], progress) -> None:
    """`specchat train` for a loaded `target`: prepare the data, train the head into `options.output`,
    then export it; each step is said through `log`.

    `progress()` opens the progress display (`specchat.ui.TrainingProgress`: a context manager with
    `stage(description)` and `training(state, total_steps, loss, accuracy)`), open while the data is
    prepared and the head trains, so that the closing lines come after it.
    """
    layouts = FORMATS[options.kind].LAYOUTS
    unwritable = [layout for layout in options.exports if layout not in layouts]
    if unwritable:  # said before the data is prepared and the head trained, not after
        raise TrainError(f"--export {unwritable[0]}: a {options.kind} head is written in {', '.join(layouts)} only")
    target.model.requires_grad_(False)
    prepared = prepare_options(options, target)
    work = Path(options.work_dir) if options.work_dir else default_work_dir(target.name, prepared)
    log(f"work folder {work}")
    with progress() as bars:
        store, summary = prepare(target, prepared, work, need_aux=head_class(options.kind).reads_fused_features,
                                 log=log, progress=bars.stage)
        if options.prepare_only:
            log(f"prepared {len(store)} sequences in {work}")
            return
        summary["held_out_fraction"] = options.held_out
        shard = int(options.max_shard_mb * 2**20) if options.max_shard_mb else None
        record = train_head(target, store, train_config(options), Path(options.output), summary, options.held_out,
                            options.resume, log, bars.training, shard, init=options.init)
    log(outcome(record, options.output))
    if options.exports and record["finished"]:
        for layout in options.exports:
            exporting.export_folder(Path(options.output), layout, Path(options.output) / layout, max_shard_bytes=shard)
            log(f"wrote {Path(options.output) / layout} ({layout} layout)")


def prepare_options(options: TrainOptions, target) -> PrepareOptions:
    return PrepareOptions(
        data=list(options.data_files), regenerate=options.regenerate,
        regenerate_batch=options.regenerate_batch or batch_size_for(target.device),
        regenerate_max_tokens=options.regenerate_max_tokens, regenerate_temperature=options.regenerate_temperature,
        max_tokens=options.max_tokens, limit=options.limit, seed=options.seed,
        extract_tokens=options.extract_tokens, live_features=live_features(options.features, target, options.batch_tokens))


def live_features(choice: str, target, batch_tokens: int) -> bool:
    """Whether `--features choice` has the target compute each batch's features on its device: auto
    where that fits beside the head on a GPU (`features.live_features_fit`); stored otherwise."""
    if choice not in FEATURE_CHOICES:
        raise TrainError(f"unknown --features {choice!r} (use {', '.join(FEATURE_CHOICES)})")
    if choice == "live" and target.own_forward is None:
        raise TrainError(f"--features live: {unsupported_reason(target.model)}; use --features stored")
    return choice == "live" or (choice == "auto" and live_features_fit(target, batch_tokens))


def train_config(options: TrainOptions) -> TrainConfig:
    return TrainConfig(kind=options.kind, learning_rate=options.lr, warmup_steps=options.warmup, epochs=options.epochs,
                       max_steps=options.max_steps, batch_tokens=options.batch_tokens, batch_size=options.batch_size,
                       ttt_steps=options.ttt_steps, draft_vocab=options.draft_vocab,
                       intermediate_size=options.intermediate_size, eval_every=options.eval_every,
                       checkpoint_every=options.checkpoint_every, checkpoint_precision=options.checkpoint_precision,
                       max_minutes=options.max_minutes, seed=options.seed, trace=options.trace)


def outcome(record: dict, output: str) -> str:
    """The closing line: what `output` holds, after how much training, and how good it is."""
    selected = record["selected"]
    summary = f"{record['steps']} steps, {record['tokens_seen']:,} tokens"
    if "tau" in selected:
        summary += (f"; the head of step {selected['step']:,}: held-out top-1 by step {selected['top1_by_step']}, "
                    f"simulated tau {selected['tau']:.3f}")
    if not record["finished"]:
        return f"unfinished: {output} holds the best head so far ({summary})"
    return f"wrote {output} ({summary})"


def default_work_dir(target_name: str, options: PrepareOptions) -> Path:
    parts = [target_name, options.regenerate, options.regenerate_max_tokens, options.regenerate_temperature,
             options.max_tokens, options.limit, options.seed]
    for name in options.data:
        path = Path(name).resolve()
        parts.append([str(path), *_contents(path)])
    digest = hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "train" / digest


def _contents(path: Path) -> list:
    """What says a data file or folder changed: its size and time, a folder's files' (its manifest
    left out: every scan rewrites it, whatever the shards hold)."""
    if not path.is_dir():
        stat = path.stat()
        return [stat.st_size, int(stat.st_mtime)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p != path / MANIFEST)
    return [[str(p.relative_to(path)), p.stat().st_size, int(p.stat().st_mtime)] for p in files]


def prepare(target, options: PrepareOptions, work: Path, need_aux: bool, log,
            progress) -> tuple[FeatureStore | LiveFeatures, dict]:
    """Conversations -> (regenerated) -> token ids -> stored features (or the target's, live).
    Returns the store and a data summary."""
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
    if options.regenerate:  # every user turn, answered in order into a data folder of the work folder
        prompts = {record.key: record for c in conversations if (record := prompt_record(c.messages, c.source))}
        folder = DataFolder(work / "regenerated")
        result = regenerate(list(prompts.values()), target, folder,
                            RegenerateOptions(temperatures=(options.regenerate_temperature,),
                                              batch_size=options.regenerate_batch,
                                              max_new_tokens=options.regenerate_max_tokens, seed=options.seed),
                            ChatFormat(target.tokenizer).stop_ids, progress("regenerating answers"))
        log(f"regeneration: {result.summary()}")
        if breakdown := result.breakdown():
            log(f"regeneration: {breakdown}")
        conversations = [data_mod.TrainingConversation(messages, where)
                         for messages, where in folder.conversations(result.scan)]
        summary["regenerated"] = len(conversations)
    else:
        prompt_only = [c for c in conversations if not c.has_responses]
        if prompt_only:
            log(f"skipped {len(prompt_only)} prompt-only records: they need --regenerate")
        conversations = [c for c in conversations if c.has_responses]
    summary["regenerate_seconds"] = round(time.perf_counter() - started, 1)
    encoded = data_mod.encode_all([c.messages for c in conversations], target.tokenizer, options.max_tokens)
    sequences = [pair for pair in encoded if pair is not None and len(pair[0]) >= 4]
    if len(sequences) < 2:
        raise TrainError(f"only {len(sequences)} usable conversations; training needs at least 2")
    summary["used"] = len(sequences)
    summary["tokens"] = sum(len(ids) for ids, _ in sequences)
    summary["assistant_tokens"] = sum(sum(mask) for _, mask in sequences)
    log(f"{len(sequences)} conversations, {summary['tokens']:,} tokens ({summary['assistant_tokens']:,} to predict)")
    aux_layers = default_feature_layers(target.num_layers) if need_aux else None
    if options.live_features:
        log("features: computed by the target on the device for every batch (no feature files)")
        return LiveFeatures(sequences, target, aux_layers), summary
    folder = work / "features"
    existing = _complete_store(folder)
    started = time.perf_counter()
    if existing is not None and (not need_aux or existing.feature_layers) and len(existing) == len(sequences):
        store = existing
    else:
        store = extract(folder, sequences, target, aux_layers, progress("extracting target features"),
                        batch_tokens=options.extract_tokens)
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


def initial_head(name: str, target, store: FeatureStore, config: TrainConfig, log):
    """The head `--init` names, to train on: its own weights in float32 (the target's embedding it
    shares stays as it is), its draft vocabulary (on the host; None: the whole vocabulary) and that
    vocabulary's share of the assistant tokens."""
    head, folder = sources.load_head(name, target, config.kind)
    vocab = head.draft_to_target
    sizes = {"--draft-vocab": (config.draft_vocab, target.vocab_size if vocab is None else len(vocab)),
             "--intermediate-size": (config.intermediate_size, head.config.intermediate_size)}
    for option, (asked, own) in sizes.items():
        if asked is not None and asked != own:
            raise UsageError(f"{option} {asked} differs from {folder}'s {own}: --init keeps the head's sizes")
    # Loaded in the target's dtype; trained in float32 as a new head is, but for what it shares with
    # the target (its embedding, and an EAGLE head's LM head), which stays the target's.
    shared = {id(t) for module in (target.embed_tokens, target.lm_head) for t in (*module.parameters(), *module.buffers())}
    for module in head.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(tensor) not in shared and tensor.is_floating_point():
                tensor.data = tensor.data.float()
    if vocab is None:
        log(f"starting from {folder}")
        return head.train(), None, 1.0
    vocab = vocab.cpu()
    coverage = covered_share(assistant_token_counts(store), vocab.tolist())
    log(f"starting from {folder}: its draft vocabulary of {len(vocab):,} tokens covers {coverage:.1%} of the "
        "assistant tokens")
    return head.train(), vocab, coverage


def train_head(target, store: FeatureStore, config: TrainConfig, output: Path, data_summary: dict, held_out_fraction: float,
               resume: bool, log, progress, max_shard_bytes: int | None = None, init: str | None = None) -> dict:
    """Train one head on the store and write it (published format + training.json) to `output`;
    `init` names a head to start from (`initial_head`), else a new one is made.

    The head trains on the target's device. When held-out sequences are evaluated, `output` holds
    the head with the best simulated tau so far (written when it appears); otherwise the last one.
    A run stopped by its time limit leaves its checkpoint for --resume and the best head so far.
    """
    device = target.device  # the one place the training device is decided: where the target is
    train_ids, held_out = split(len(store), held_out_fraction, config.seed)
    if init is not None:
        head, vocab, coverage = initial_head(init, target, store, config, log)
    else:
        size = config.draft_vocab or PAPER_DRAFT_VOCAB
        vocab, coverage = (None, 1.0) if size >= target.vocab_size else draft_vocabulary(store, size, target.vocab_size)
        if vocab is not None:
            log(f"draft vocabulary: {len(vocab):,} tokens covering {coverage:.1%} of the assistant tokens")
        head = build_head(config.kind, target, config, vocab)
    started = time.perf_counter()
    output.mkdir(parents=True, exist_ok=True)

    def record_of(state, selected: dict) -> dict:
        return {
            "specchat_version": __version__,
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "kind": config.kind,
            "target": {"name": target.name, "layers": target.num_layers, "hidden_size": target.hidden_size,
                       "vocab_size": target.vocab_size, "dtype": str(target.dtype).removeprefix("torch."),
                       # what an exported head says of its target (`drafters.Verifier`)
                       "architectures": list(target.config.architectures or []),
                       "max_position_embeddings": getattr(target.config.get_text_config(), "max_position_embeddings",
                                                          None)},
            "data": {**data_summary, "train_conversations": len(train_ids), "held_out_conversations": len(held_out)},
            "draft_vocab": {"size": None if vocab is None else len(vocab), "assistant_token_coverage": round(coverage, 4)},
            "recipe": recipe_description(config),
            "initialized_from": init,  # --init: the head training started from (None: a new one)
            "hyperparameters": asdict(config),
            "steps": state.step,
            "finished": state.stopped is None,
            "tokens_seen": state.tokens_seen,
            "held_out_top1": state.evaluations,
            "selected": selected,
            "best": state.best,
            "train_seconds": round(state.seconds, 1),
            "step_phases": state.phases,  # --trace: where a step's time went
            "hardware": hardware(),
        }

    def keep_record(record: dict) -> None:
        write_atomically(output / exporting.TRAINING_RECORD, json.dumps(record, indent=2) + "\n")

    def write(state, selected: dict) -> dict:
        save_head(head, output, dtype=torch.bfloat16, max_shard_bytes=max_shard_bytes)
        record = record_of(state, selected)
        keep_record(record)
        return record

    def on_best(state) -> None:
        best = state.best
        write(state, {"step": best["step"], "tau": best["tau"], "top1_by_step": best["top1_by_step"],
                      "by": "best simulated tau on the held-out conversations"})

    saved = output / ckpt.FOLDER / ckpt.INDEX
    if resume and saved.is_file():
        best = json.loads(saved.read_text()).get("state", {}).get("best")
        if best and _written_step(output) != best["step"]:
            log(f"the best head so far (step {best['step']:,}, simulated tau {best['tau']:.3f}) is not in {output}; "
                "unless a later evaluation beats it, the last head will be written")
    state = train(head, target, store, train_ids, held_out, config, output, resume=resume, progress=progress, log=log,
                  on_best=on_best, device=device, draft_vocab=vocab)
    if state.stopped:
        log(f"stopped at step {state.step:,} by the {state.stopped}; the checkpoint is in {output / ckpt.FOLDER} "
            "and the same command with --resume continues")
    if state.best is not None and _written_step(output) == state.best["step"]:
        best = state.best
        record = record_of(state, {"step": best["step"], "tau": best["tau"], "top1_by_step": best["top1_by_step"],
                                   "by": "best simulated tau on the held-out conversations"})
        keep_record(record)
    else:
        record = write(state, {"step": state.step, "by": "last step"})
    record["elapsed_seconds"] = round(time.perf_counter() - started, 1)
    return record


def _written_step(output: Path) -> int | None:
    """The training step of the head in `output` (as its training.json says), if there is one."""
    if not (output / "config.json").is_file():
        return None
    selected = exporting.training_record(output).get("selected")
    return selected.get("step") if isinstance(selected, dict) else None


def recipe_description(config: TrainConfig) -> dict:
    """The loss and its constants, as the head class declares them."""
    cls = head_class(config.kind)
    steps = config.steps_unrolled()
    terms = [f"{cls.probability_loss_weight:g} * CE over the draft vocabulary"]
    if cls.feature_loss_weight:
        terms.insert(0, f"{cls.feature_loss_weight:g} * SmoothL1(feature)")
    loss = " + ".join(terms)
    if cls.step_loss_decay != 1:
        loss = f"sum_i {cls.step_loss_decay:g}^i * ({loss})"
    recipe = {"format": FORMATS[config.kind].NAME, "loss": loss,
              "features": "fused low/mid/high target states" if cls.reads_fused_features else "final target state",
              "feature_weight": cls.feature_loss_weight, "probability_weight": cls.probability_loss_weight,
              "feature_noise_uniform": cls.feature_noise, "step_loss_decay": cls.step_loss_decay,
              "unrolled_steps": steps, "paper_unrolled_steps": cls.paper_unrolled_steps}
    if cls.predicts_two_ahead:
        recipe["right_weight"] = RIGHT_WEIGHT
        recipe["loss"] += f" on the left output, + {RIGHT_WEIGHT:g} * the same on the right (two-ahead) output"
    return recipe
