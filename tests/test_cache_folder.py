"""`specchat cache`: what the cache folder holds, what is stale, and deleting it without touching what
another process is making or the user's own answers."""

import os
import subprocess

import pytest
import torch
from filelock import FileLock

from conftest import invoke
from specchat import cache_folder
from specchat.decode.runtime import packed, quantized
from specchat.decode.runtime.machine import cache_dir, write_safetensors


def _ended() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def tensors_file(path, metadata):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, {"x": torch.zeros(4)}, metadata)


@pytest.fixture
def folder():
    """A cache folder with one entry of each kind, current or stale as its name says."""
    root = cache_dir()
    tensors_file(root / "packed" / "current-int5-bfloat16.safetensors", packed._stamp(5))
    tensors_file(root / "packed" / "old-kernel-int5-bfloat16.safetensors", {**packed._stamp(5), "kernel": "deadbeef"})
    tensors_file(root / "quantized" / "current-int4.safetensors", {"layout": f"{quantized.LAYOUT}-4"})
    tensors_file(root / "quantized" / "old-layout-int5.safetensors", {"layout": "woq1-5"})
    (root / "packed" / f"killed.safetensors.{_ended()}.partial").write_bytes(b"half")
    (root / "packed" / f"writing.safetensors.{os.getpid()}.partial").write_bytes(b"half")
    (root / "models" / "no-stamp-bfloat16").mkdir(parents=True)
    (root / "models" / "no-stamp-bfloat16" / "config.json").write_text("{}")
    (root / "models" / "killed-bfloat16.tmp-abc").mkdir()
    (root / "answers" / "c4d6").mkdir(parents=True)
    (root / "answers" / "c4d6" / "answers.jsonl").write_text("{}\n")
    (root / "verify-cost.json").write_text("{}")
    (root / "packed" / "current-int5-bfloat16.safetensors.lock").write_text("")
    return root


def names(entries):
    return {str(entry.path.relative_to(cache_dir())) for entry in entries}


STALE = {"packed/old-kernel-int5-bfloat16.safetensors", "quantized/old-layout-int5.safetensors",
         "models/no-stamp-bfloat16", "models/killed-bfloat16.tmp-abc"}


def test_each_entry_says_whether_a_start_of_this_version_reads_it(folder):
    found = cache_folder.entries()
    killed = next(name for name in names(found) if name.startswith("packed/killed"))
    assert names(cache_folder.prunable(found)) == STALE | {killed}
    assert not any(name.endswith(".lock") for name in names(found))
    reasons = {str(entry.path.relative_to(folder)): entry.stale for entry in found}
    assert reasons["packed/old-kernel-int5-bfloat16.safetensors"] == \
        f"its kernel is 'deadbeef', not '{packed._stamp(5)['kernel']}'"
    assert "woq1-5" in reasons["quantized/old-layout-int5.safetensors"]
    assert reasons[killed] == "a write that did not finish (its process is gone)"


def test_prune_deletes_the_stale_entries_only_and_leaves_what_another_process_is_making(folder, capsys):
    with FileLock(str(folder / "models" / "killed-bfloat16.lock")):  # a conversion under way, after all
        assert "models/killed-bfloat16.tmp-abc" not in names(cache_folder.prunable(cache_folder.entries()))
        done = cache_folder.remove(cache_folder.entries())  # every entry, as `clear` would
        assert names(done.in_use) == {"models/killed-bfloat16.tmp-abc"}
    assert (folder / "models" / "killed-bfloat16.tmp-abc").is_dir()
    assert not list((folder / "packed").glob("*.safetensors"))


def test_the_command_lists_prunes_and_clears_but_keeps_the_answers(folder, capsys, monkeypatch):
    code, out, _ = invoke(["cache"], capsys)
    assert code == 0 and "stale: its kernel is 'deadbeef'" in out and "answers/  your earlier answers" in out
    assert out.splitlines()[-1].endswith("(`specchat cache prune` deletes them)")
    code, out, _ = invoke(["cache", "prune", "--dry-run"], capsys)
    assert code == 0 and "would delete packed/old-kernel-int5-bfloat16.safetensors" in out
    assert (folder / "packed" / "old-kernel-int5-bfloat16.safetensors").is_file()
    code, out, _ = invoke(["cache", "prune"], capsys)
    assert code == 0 and "deleted quantized/old-layout-int5.safetensors" in out
    assert not any(name in STALE for name in names(cache_folder.entries()))
    assert (folder / "packed" / "current-int5-bfloat16.safetensors").is_file()
    code, _, err = invoke(["cache", "clear"], capsys, monkeypatch, stdin="")
    assert code == 2 and "--yes" in err and (folder / "verify-cost.json").is_file()
    code, out, _ = invoke(["cache", "clear", "--yes"], capsys)
    assert code == 0 and names(cache_folder.entries()) == {"answers/c4d6"}
    code, out, _ = invoke(["cache", "clear", "--yes", "--answers"], capsys)
    assert code == 0 and cache_folder.entries() == []


def test_sizes_read_as_du_says_them():
    assert [cache_folder.human(size) for size in (0, 999, 1000, 648_205_722, 3_600_000_000)] == \
        ["0 B", "999 B", "1.0 KB", "648.2 MB", "3.6 GB"]
