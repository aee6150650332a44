"""The way back: there, the head and the answers not brought back yet in pieces within what a
call brings back (`back`); here, the returned pieces joined and unpacked into place (`collect`),
the answers also kept compressed in the block's record folder, which is committed: the development
machine's data folder does not outlive its session, and the next block trains on every answer kept."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import click

from specchat.inputs import file_lines
from specchat.train.agenda import plan
from specchat.train.datafolder import SHARDS, DataFolder, deeper, keep, slot_of

def back(out: Path) -> None:
    """The head (without its checkpoint), then the answers not brought back yet (each prompt's deepest
    new turn per temperature, as one checksummed shard), in pieces as far as the limits on what a call
    brings back leave room; what did not fit is said."""
    bundles = []
    if (plan.THERE / "head").is_dir():
        with tarfile.open(plan.THERE / "head.tgz", "w:gz") as tar:
            tar.add(plan.THERE / "head", arcname=".", filter=lambda info: None if "checkpoint" in info.name else info)
        bundles.append((plan.THERE / "head.tgz", []))
    new = [p for p in sorted((plan.THERE / "data" / SHARDS).glob("*.jsonl")) if p.name not in shards_here()]
    if new:
        deepest: dict[tuple, dict] = {}
        for shard in new:
            for line in filter(str.strip, file_lines(shard.read_text(encoding="utf-8"))):
                record = json.loads(line)
                slot = slot_of(record)
                if deeper(record, deepest.get(slot)):
                    deepest[slot] = record
        compact = plan.THERE / "answers"
        shutil.rmtree(compact, ignore_errors=True)
        records = list(deepest.values())
        for start in range(0, len(records), plan.SHARD_RECORDS):  # each kept shard well under a committed file's limit
            with DataFolder(compact).writer() as writer:
                for record in records[start : start + plan.SHARD_RECORDS]:
                    writer.write(record)
        with tarfile.open(plan.THERE / "answers.tgz", "w:gz") as tar:
            tar.add(compact / SHARDS, arcname=SHARDS)
        bundles.append((plan.THERE / "answers.tgz", [p.name for p in new]))
    files = [f for f in out.iterdir() if f.is_file()]
    for bundle, shards in bundles:
        size = bundle.stat().st_size
        pieces = -(-size // plan.BACK_PIECE)
        if len(files) + pieces > plan.BACK_FILES or sum(f.stat().st_size for f in files) + size > plan.BACK_BYTES:
            click.echo(f"[agenda] {bundle.name} ({size / 2**20:.1f} MiB) does not fit what this call brings back",
                       err=True)
            continue
        with open(bundle, "rb") as source:
            for index in range(pieces):
                files.append(out / f"{bundle.name}.{index:02d}")
                files[-1].write_bytes(source.read(plan.BACK_PIECE))
        shards_here(shards)


def shards_here(shards: list[str] = ()) -> set[str]:
    """The data folder's shards already here (brought in or back), after adding `shards`."""
    path = plan.THERE / "returned.json"
    returned = set(json.loads(path.read_text())) if path.is_file() else set()
    returned |= set(shards)
    path.write_text(json.dumps(sorted(returned)))
    return returned



@click.command()
@click.argument("returned", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--head", "head_folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Unpack the returned head into this folder.")
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Add the returned answers to this data folder's shards.")
@click.option("--keep", "kept", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also keep the returned answers' shards, gzip-compressed, in this folder (the block's record: "
                   "docs/bench-gpu/BLOCK/answers), for every later block to train on; needs --data.")
def collect(returned, head_folder, data, kept):
    """Join the pieces in RETURNED (a call's files) and unpack the head and the answers."""
    if kept is not None and data is None:
        raise click.UsageError("--keep keeps the answers --data unpacks: give both")
    for name, target in (("head.tgz", head_folder), ("answers.tgz", data)):
        pieces = sorted(returned.glob(f"{name}.*"))
        if not pieces or target is None:
            continue
        joined = returned.parent / f"{returned.name}-{name}"
        with open(joined, "wb") as sink:
            for piece in pieces:
                sink.write(piece.read_bytes())
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(joined) as tar:
            tar.extractall(target, filter="data")
            shards = [Path(member.name).name for member in tar.getmembers() if member.name.endswith(".jsonl")]
        joined.unlink()
        click.echo(f"{name}: {len(pieces)} pieces into {target}")
        if name == "answers.tgz" and kept is not None:
            for shard in shards:
                size = keep(target / SHARDS / shard, kept).stat().st_size
                click.echo(f"kept {shard} in {kept} ({size / 2**20:.1f} MiB): commit it")
    if data is not None:
        scan = DataFolder(data).scan()
        bad = [s["file"] for s in scan.shards if s["status"] != "ok"]
        click.echo(f"{data}: {len(scan.answers):,} answered prompts" + (f"; not ok: {', '.join(bad)}" if bad else ""))
