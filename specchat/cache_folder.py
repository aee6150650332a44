"""What specchat keeps in its cache folder (`specchat cache`): each entry, what reads it, its size, and
whether a start of this specchat still reads it.

Starts keep what they made in `$SPECCHAT_CACHE_DIR` (else `~/.cache/specchat`): packed models (what
chat loads on a CPU), converted models and quantized layers (what `bench`, training and the paths
through transformers load), assembled GGUF files (llama.cpp's peers), the measured verify costs,
the index of the user's earlier answers, training's work. A start rewrites an entry it finds out
of date in place, but an entry no start asks for again stays: a packed model made by an older
kernel for a model no longer used, the caches earlier versions wrote under other names, a write
killed half-way. `prune` deletes what no start of this version would read as it is; `clear`
deletes everything but the answer index (which holds the user's own answers) unless asked.

An entry another process is making (its lock held) is left alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from specchat import converted
from specchat.decode import cache_dir
from specchat.decode.runtime import packed, quantized
from specchat.decode.runtime.machine import PARTIAL, lock_beside, partial_writer
from specchat.errors import first_line

ANSWERS = "answers"  # the answer index's folder: the user's own answers (`specchat.answers`)
# Each folder of the cache: what its entries are and what reads them.
FOLDERS = {
    "packed": "packed models (chat, run and serve on a CPU)",
    "models": "converted models (bench, training, GPU and float32 starts)",
    "quantized": "quantized layers (bench, training, draft heads)",
    "gguf": "assembled GGUF files (llama.cpp's peers)",
    ANSWERS: "your earlier answers (drafts from them with --answer-index)",
    "train": "training's work (features, batches)",
    "peers": "other tools' builds, exports and logs (bench's peers)",
}
STATE_FILES = {"kernel.json": "the kernel's last build", "verify-cost.json": "measured verify costs",
               "sha256-index.json": "GGUF files' sha256"}


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str
    size: int  # bytes, a folder's files together
    modified: float  # seconds since the epoch
    stale: str | None  # why no start of this specchat reads it as it is; None: current


def entries(root: Path | None = None) -> list[Entry]:
    """Everything in the cache folder, folder by folder (lock files left out: they hold nothing)."""
    root = root or cache_dir()
    if not root.is_dir():
        return []
    found = []
    for name, kind in FOLDERS.items():
        if (root / name).is_dir():
            found += [_entry(item, kind, _stale(name, item))
                      for item in sorted((root / name).iterdir()) if not item.name.endswith(".lock")]
    for path in sorted(root.iterdir()):  # the folder's own files (and what this specchat does not know)
        if not (path.name in FOLDERS and path.is_dir()) and not path.name.endswith(".lock"):
            unknown = "a file of the cache folder" if path.is_file() else "unknown to this specchat"
            kind = STATE_FILES.get(path.name, unknown)
            found.append(_entry(path, kind, _stale("", path)))
    return found


def _entry(path: Path, kind: str, stale: str | None) -> Entry:
    return Entry(path, kind, _size(path), path.lstat().st_mtime, stale)


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum((Path(folder) / name).lstat().st_size for folder, _, names in os.walk(path) for name in names)


def _stale(folder: str, path: Path) -> str | None:
    if path.name.endswith(PARTIAL):
        return _unfinished_write(path)
    if folder == "packed" and path.suffix == ".safetensors":
        return packed.stale_reason(path)
    if folder == "quantized" and path.suffix == ".safetensors":
        return quantized.stale_reason(path)
    if folder == "models" and converted.WORK in path.name:
        return None if _held(path) else "a conversion that did not finish"
    if folder == "models" and path.is_dir() and not _held(path):
        damage = converted.damage(path)
        return None if damage is None else f"damaged: {damage}"
    return None


def _held(path: Path) -> bool:
    """Whether another process holds the lock `path` is made under (it is being made)."""
    try:
        with _lock_of(path).acquire(timeout=0):
            return False
    except Timeout:
        return True


def _unfinished_write(path: Path) -> str | None:
    """A `.partial` file (`machine.replace_atomically`) whose writer is gone, or None while it writes."""
    pid = partial_writer(path)[1]
    if pid is not None:
        try:
            os.kill(pid, 0)
            return None  # (being written)
        except ProcessLookupError:
            pass
        except PermissionError:
            return None  # another user's live process
    return "a write that did not finish (its process is gone)"


def _lock_of(path: Path) -> FileLock:
    """The lock an entry is made under (`machine.lock_beside`); a conversion's work folder is made under
    its folder's, a `.partial` file under its target's."""
    if path.name.endswith(PARTIAL):
        return lock_beside(partial_writer(path)[0])
    return lock_beside(path.with_name(path.name.split(converted.WORK)[0]))


@dataclass(frozen=True)
class Removal:
    removed: list[Entry]
    in_use: list[Entry]  # left: another process holds their lock
    failed: list[tuple[Entry, str]]  # could not be deleted, and why

    @property
    def freed(self) -> int:
        return total(self.removed)


def remove(chosen: list[Entry]) -> Removal:
    """Delete `chosen`, each under its lock (taken at once, or the entry is left as in use)."""
    removed, in_use, failed = [], [], []
    for entry in chosen:
        try:
            with _lock_of(entry.path).acquire(timeout=0):
                _delete(entry.path)
                removed.append(entry)
        except Timeout:
            in_use.append(entry)
        except OSError as error:
            failed.append((entry, first_line(error)))
    return Removal(removed, in_use, failed)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prunable(found: list[Entry]) -> list[Entry]:
    """What no start of this specchat reads as it is (`Entry.stale`)."""
    return [entry for entry in found if entry.stale is not None]


def clearable(found: list[Entry], answers: bool = False) -> list[Entry]:
    """Everything but the answer index (`answers`: that too)."""
    return [entry for entry in found if answers or entry.path.parent.name != ANSWERS]


def total(found: list[Entry]) -> int:
    """The entries' bytes together."""
    return sum(entry.size for entry in found)


def human(size: int) -> str:
    """A size as `du -h --si` says it: 630.2 MB."""
    if size < 1000:
        return f"{size} B"
    value, unit = size / 1000, "KB"
    for larger in ("MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, larger
    return f"{value:.1f} {unit}"


def table(found: list[Entry], root: Path | None = None) -> Iterator[str]:
    """`found` as lines of text: a heading per folder saying what its entries are; each entry's size,
    name and, where stale, why; then the totals."""
    root = root or cache_dir()
    heading = None
    for entry in found:
        folder = entry.path.parent
        if folder != heading:
            heading = folder
            yield f"{folder.name}/  {entry.kind}" if folder != root else "the folder's own files"
        said = f"  {entry.kind}" if folder == root else ""
        stale = f"  stale: {entry.stale}" if entry.stale is not None else ""
        yield f"  {human(entry.size):>9}  {entry.path.name}{said}{stale}"
    stale = prunable(found)
    yield (f"{human(total(found))} in {len(found)} entries under {root}; "
           f"{human(total(stale))} in {len(stale)} stale (`specchat cache prune` deletes them)")
