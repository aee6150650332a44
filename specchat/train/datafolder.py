"""A folder of regenerated answers that fills across runs, sessions and machines.

    DATA/prompts.jsonl             the prompts (`specchat.train.prompts`)
    DATA/shards/NAME.jsonl         answers, one JSON record per line; NAME = host, process, start time, random
    DATA/shards/NAME.jsonl.sha256  written when a shard is closed: its sha256 and record count
    DATA/shards/NAME.jsonl.gz      a closed shard kept compressed (`keep`: a GPU block's answers,
                                   committed beside its record); its checksum is the plain text's
    DATA/shards/NAME.partial       a shard being written (its writer holds a lock on it), or cut off
                                   (no one does: a scan keeps its whole lines and closes it)
    DATA/manifest.json             rebuilt from the shards at every scan: which answers are done

A record is one answered user turn: {"key", "turn", "temperature", "messages", "finish", "source"},
`messages` the whole conversation up to and including that answer (the turns before it answered
by the target too), so the deepest turn of a prompt is its training conversation.

Several machines fill one folder by each writing its own shards (`--part i/n` splits the prompts
between them) and copying them together; a scan then checks every closed shard against its
checksum (a shard that fails is reported and left out, so its answers are done again), keeps the
whole lines of a cut-off one (and closes it), and counts an answer given twice once.

A GPU block's answers outlive the machine that collects them only in the repository: `keep` writes
closed shards gzip-compressed (about 40% of their size; gzip, not xz: every Python has zlib, and the
GPU machine reads them) with their checksums, into the block's record folder, and the agenda's `pack`
puts every kept shard into the data the next block trains on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import gzip
import os
import socket
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from specchat.inputs import atomic_output, file_lines

MANIFEST, PROMPTS, SHARDS = "manifest.json", "prompts.jsonl", "shards"
KEPT = ".gz"  # the suffix of a shard kept compressed
GREEDY = 0.0


def temperature_name(temperature: float) -> str:
    return "greedy" if temperature == GREEDY else f"t{temperature:g}"


@dataclass
class Scan:
    """What the shards hold, checked."""

    answers: dict[tuple[str, float], dict] = field(default_factory=dict)  # (key, temperature) -> deepest record
    shards: list[dict] = field(default_factory=list)  # {"file", "sha256", "records", "status"}
    duplicates: int = 0

    def by_temperature(self) -> dict[str, dict]:
        """Per temperature (by `temperature_name`, lowest first): its value, the prompts answered, the
        user turns answered in all, and each prompt's deepest turn."""
        done: dict[str, dict] = {}
        for (key, temperature), record in sorted(self.answers.items(), key=lambda item: item[0][1]):
            entry = done.setdefault(temperature_name(temperature),
                                    {"temperature": temperature, "prompts": 0, "turns": 0, "done": {}})
            entry["prompts"] += 1
            entry["turns"] += record["turn"]
            entry["done"][key] = record["turn"]
        return done


def slot_of(record: dict) -> tuple[str, float]:
    """What an answer record answers: its prompt (by key) at its temperature."""
    return record["key"], float(record["temperature"])


def deeper(record: dict, held: dict | None) -> bool:
    """Whether `record` answers more of its prompt's turns than `held`, the record kept for its slot so
    far (the first one kept on a tie: a record answers every turn up to its own)."""
    return held is None or record["turn"] > held["turn"]


class DataFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.shards = self.path / SHARDS

    @property
    def prompts_path(self) -> Path:
        return self.path / PROMPTS

    def scan(self) -> Scan:
        """Check and read every shard (closing cut-off ones), and write the manifest."""
        self.shards.mkdir(parents=True, exist_ok=True)
        for partial in sorted(self.shards.glob("*.partial")):
            if not _written_now(partial):
                _close(partial)
        scan = Scan()
        plain = sorted(self.shards.glob("*.jsonl"))
        kept = [shard for shard in sorted(self.shards.glob(f"*.jsonl{KEPT}")) if shard.with_suffix("") not in plain]
        for shard in plain + kept:
            try:
                text = _shard_bytes(shard)
            except (gzip.BadGzipFile, EOFError, zlib.error):  # a kept shard that is not gzip, or cut off
                scan.shards.append({"file": shard.name, "status": "not a whole gzip file: left out"})
                continue
            entry = {"file": shard.name, "sha256": hashlib.sha256(text).hexdigest()}
            expected = _read_checksum(shard)
            scan.shards.append(entry)
            if expected is not None and expected != entry["sha256"]:
                entry["status"] = "checksum mismatch: left out"
                continue
            entry["status"] = "ok" if expected else "no checksum file: read as it is"
            records = []
            for line in file_lines(text.decode("utf-8", errors="replace")):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # only a shard without a checksum can hold one
                    continue
            entry["records"] = len(records)
            for record in records:
                slot = slot_of(record)
                held = scan.answers.get(slot)
                if not deeper(record, held):
                    scan.duplicates += held["turn"] == record["turn"]
                    continue
                scan.answers[slot] = record
        self._write_manifest(scan)
        return scan

    def _write_manifest(self, scan: Scan) -> None:
        manifest = {"version": 1, "updated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "shards": scan.shards,
                    "duplicate_answers": scan.duplicates, "answers": scan.by_temperature()}
        with atomic_output(str(self.path / MANIFEST)) as sink:  # scans in two processes do not collide
            sink.write(json.dumps(manifest, indent=1) + "\n")

    def writer(self) -> ShardWriter:
        return ShardWriter(self.shards)

    @staticmethod
    def holds(path: Path) -> bool:
        """Whether `path` is a data folder (what `train --data` reads as one)."""
        return path.is_dir() and ((path / SHARDS).is_dir() or (path / MANIFEST).is_file())

    def conversations(self, scan: Scan | None = None) -> list[tuple[list[dict], str]]:
        """The training conversations (messages, where): each prompt's deepest answered turn, at every
        temperature."""
        scan = scan or self.scan()
        return [(record["messages"], f"{self.path.name}#{key[:8]}@{temperature_name(t)}")
                for (key, t), record in sorted(scan.answers.items())
                if record["messages"][-1]["content"].strip()]


class ShardWriter:
    """Appends records to a new shard of its own; closing it (also on an error or Ctrl-C) writes
    its checksum, so no other process ever writes into it and a copy can be checked anywhere."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        # host, process and time say where it comes from; the random part keeps two writers apart anyway
        name = f"{socket.gethostname()}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.partial = folder / f"{name}.partial"
        self.sink = open(self.partial, "a", encoding="utf-8")
        fcntl.flock(self.sink, fcntl.LOCK_EX)  # while it is held, no scan closes the shard under us
        self.records = 0
        self.closed: Path | None = None  # the shard, once closed (None: no record was written)

    def write(self, record: dict) -> None:
        self.sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.records += 1

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> Path | None:
        self.sink.flush()
        self.closed = _close(self.partial)  # under its lock: no scan closes it too
        self.sink.close()
        return self.closed

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _written_now(partial: Path) -> bool:
    """Whether a live writer holds `partial` (the system drops a dead process's lock)."""
    try:
        with open(partial, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the handle closes
    except BlockingIOError:
        return True
    except FileNotFoundError:  # its writer closed it meanwhile
        return True
    return False


def _close(partial: Path) -> Path | None:
    """A shard's whole lines as a closed shard with its checksum (None and nothing left when it has none)."""
    text = partial.read_bytes()
    whole = text[: text.rfind(b"\n") + 1]  # a line cut off by an interrupted write is dropped
    if not whole.strip():
        partial.unlink()
        return None
    shard = partial.with_suffix(".jsonl")
    shard.write_bytes(whole)
    checksum = {"sha256": hashlib.sha256(whole).hexdigest(), "records": whole.count(b"\n")}
    Path(f"{shard}.sha256").write_text(json.dumps(checksum) + "\n")
    partial.unlink()
    return shard


def keep(shard: Path, folder: Path) -> Path:
    """A closed shard, gzip-compressed, into `folder` with its checksum file (the plain text's); the kept file."""
    folder.mkdir(parents=True, exist_ok=True)
    text = _shard_bytes(shard)
    if _read_checksum(shard) != hashlib.sha256(text).hexdigest():
        raise ValueError(f"{shard.name} is not a closed shard that matches its checksum: not kept")
    plain = shard.with_suffix("") if shard.suffix == KEPT else shard
    kept = folder / f"{plain.name}{KEPT}"
    kept.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    Path(f"{folder / plain.name}.sha256").write_bytes(_checksum_path(shard).read_bytes())
    return kept


def kept_shards(folder: Path) -> list[Path]:
    """The kept shards in `folder` and their checksum files."""
    kept = sorted(folder.glob(f"*.jsonl{KEPT}"))
    return kept + [_checksum_path(shard) for shard in kept]


def _shard_bytes(shard: Path) -> bytes:
    """A closed shard's text, a kept one's decompressed."""
    text = shard.read_bytes()
    return gzip.decompress(text) if shard.suffix == KEPT else text


def _checksum_path(shard: Path) -> Path:
    """NAME.jsonl.sha256, for NAME.jsonl and for its kept NAME.jsonl.gz alike."""
    return Path(f"{shard.with_suffix('') if shard.suffix == KEPT else shard}.sha256")


def _read_checksum(shard: Path) -> str | None:
    try:
        return json.loads(_checksum_path(shard).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
