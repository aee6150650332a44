"""The model cache heals itself: a converted folder is checked before use and made again when any
of its files is missing, cut short or garbled; what a killed conversion left behind is removed;
a full disk and a pickled model give one-line errors."""

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gguf as gguf_package
import pytest
import torch
from transformers import modeling_gguf_pytorch_utils

from conftest import load_tiny_target
from specchat import converted as conversion
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.errors import ModelLoadError
from specchat.logs import show_core_messages


@pytest.fixture
def gguf(tmp_path, qwen_dir, monkeypatch):
    """A GGUF file whose conversion copies the tiny model folder (the parser is transformers' business)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    conversions = []

    def write_hf_folder(gguf_path, dtype, folder):
        conversions.append(folder)
        shutil.copytree(qwen_dir, folder, dirs_exist_ok=True)

    monkeypatch.setattr(conversion, "write_hf_folder", write_hf_folder)
    return SimpleNamespace(path=path, conversions=conversions)


def converted(gguf):
    return conversion.gguf_folder(gguf.path, torch.float32)


def test_a_conversion_records_its_files_and_is_whole(gguf):
    folder = converted(gguf)
    stamp = json.loads((folder / conversion.STAMP).read_text())
    assert set(stamp["files"]) >= {"config.json", "tokenizer.json", "model.safetensors"}
    assert conversion.damage(folder) is None
    assert converted(gguf) == folder and len(gguf.conversions) == 1  # used as it is


def damage_cases(folder):
    for path in sorted(folder.iterdir()):
        yield f"delete {path.name}", lambda path=path: path.unlink()
        yield f"cut {path.name}", lambda path=path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        if path.suffix == ".json":  # same size, not JSON any more
            yield f"garble {path.name}", lambda path=path: path.write_bytes(b"\xff" * path.stat().st_size)
    yield "empty safetensors", lambda: (folder / "model.safetensors").write_bytes(b"")


def test_every_file_of_a_converted_model_damaged_is_made_again(gguf, capfd):
    show_core_messages()  # as the command line does: each message one `specchat: ` line on stderr
    folder = converted(gguf)
    capfd.readouterr()
    cases = list(damage_cases(folder))
    assert len(cases) >= 10
    for number, (what, damage) in enumerate(cases, start=2):
        damage()
        assert converted(gguf) == folder, what
        assert len(gguf.conversions) == number, f"{what}: not converted again"
        assert conversion.damage(folder) is None, what
        err = capfd.readouterr().err
        assert f"the converted model in {folder} is damaged" in err and "converting it again" in err, what
        assert len(err.strip().splitlines()) == 2, err  # the damage line, then the conversion's own line


def greedy_answer(target) -> list[int]:
    prompt = target.tokenizer("hi")["input_ids"]
    return [token for step in Engine(target).generate(prompt, GenerationSettings(max_new_tokens=6))
            for token in step.tokens]


def test_a_repaired_model_answers(gguf, capfd):
    """A converted folder that lost a file is converted again, and its model answers as before."""
    folder = converted(gguf)
    before = greedy_answer(load_tiny_target(folder))
    (folder / "tokenizer.json").unlink()  # once: a stamp trusted, nothing printed, exit 0
    target = load_tiny_target(converted(gguf))
    assert (folder / "tokenizer.json").is_file() and len(before) == 6
    assert greedy_answer(target) == before


def test_what_a_killed_conversion_left_is_removed(gguf, tmp_path):
    """A conversion killed with SIGKILL in a child process: its temporary folder goes at the next start."""
    started = tmp_path / "started"
    code = textwrap.dedent(f"""
        import shutil, sys, time, torch
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from specchat import converted as conversion
        def write_hf_folder(gguf_path, dtype, folder):
            (folder / "config.json").write_text("{{}}")
            open({str(started)!r}, "w").close()
            time.sleep(60)
        conversion.write_hf_folder = write_hf_folder
        conversion.gguf_folder(__import__("pathlib").Path({str(gguf.path)!r}), torch.float32)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the child did not start converting"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    models = conversion.cache_dir() / "models"
    assert list(models.glob("*.tmp-*")), "the killed conversion should have left its folder"
    folder = converted(gguf)
    assert not list(models.glob("*.tmp-*")) and conversion.damage(folder) is None


def test_a_living_conversion_keeps_its_folder(gguf, qwen_dir, monkeypatch):
    """A second start while the first converts waits for it; the first one's work is never removed."""
    def slow(gguf_path, dtype, folder):
        gguf.conversions.append(folder)
        time.sleep(0.5)
        shutil.copytree(qwen_dir, folder, dirs_exist_ok=True)

    monkeypatch.setattr(conversion, "write_hf_folder", slow)
    folders, errors = [], []

    def load():
        try:
            folders.append(converted(gguf))
        except Exception as error:  # collected, so the assertion below shows it
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    assert not errors and len(gguf.conversions) == 1 and folders[0] == folders[1]


def test_a_full_disk_is_one_line_and_leaves_nothing(gguf, monkeypatch):
    def full(gguf_path, dtype, folder):
        (folder / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversion, "write_hf_folder", full)
    with pytest.raises(ModelLoadError, match="cannot write the converted model into .*No space left on device"):
        converted(gguf)
    assert [path.name for path in (conversion.cache_dir() / "models").iterdir() if not path.name.endswith(".lock")] == []


class Payload:
    """Stands for arbitrary code a pickle could run on load."""


def test_a_pickled_model_folder_gets_specchats_message(qwen_dir, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(qwen_dir, folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "payload": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="weights_only=True") as caught:
        load_tiny_target(folder)
    assert "\n" not in str(caught.value) and "Unpickl" not in str(caught.value)


def test_a_gguf_is_parsed_once_while_converting(tmp_path, monkeypatch):
    """transformers builds a `gguf.GGUFReader` for the tokenizer, the config and the weights (a
    ~6 s parse each for a 150k-token vocabulary); while converting, one reader serves all three."""
    # the sharing relies on transformers importing the name when it reads a file
    assert "from gguf import GGUFReader" in inspect.getsource(modeling_gguf_pytorch_utils.load_gguf_checkpoint)
    made = []

    class CountingReader:
        def __init__(self, path, mode="r"):
            made.append(path)

    monkeypatch.setattr(gguf_package, "GGUFReader", CountingReader)
    with conversion._gguf_parsed_once():
        from gguf import GGUFReader
        first, second = GGUFReader(tmp_path / "m.gguf"), GGUFReader(str(tmp_path / "m.gguf"))
        other = GGUFReader(tmp_path / "other.gguf")
    assert first is second and other is not first and len(made) == 2
    assert gguf_package.GGUFReader is CountingReader  # put back afterwards


def test_gguf_pys_tensor_name_map_is_built_once_per_architecture_while_converting(monkeypatch):
    """transformers asks gguf-py for its tensor-name map again for every module of the model (~2.3 s
    of a 0.5B's conversion); while converting, one map per architecture and depth serves them all."""
    # the sharing relies on transformers importing the name when it maps a model's tensors
    assert "get_tensor_name_map" in inspect.getsource(modeling_gguf_pytorch_utils.get_gguf_hf_weights_map)
    built = []

    def counting_map(arch, n_blocks):
        built.append((arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf_package, "get_tensor_name_map", counting_map)
    with conversion._gguf_parsed_once():
        from gguf import get_tensor_name_map
        first, second, deeper = get_tensor_name_map(1, 24), get_tensor_name_map(1, 24), get_tensor_name_map(1, 28)
    assert first is second and deeper is not first and built == [(1, 24), (1, 28)]
    assert gguf_package.get_tensor_name_map is counting_map  # put back afterwards


def test_the_gguf_readers_bar_is_not_drawn_and_stderr_stays_the_processes(tmp_path, capfd, monkeypatch):
    """transformers draws a tqdm bar of its own while it dequantizes a GGUF's tensors; the conversion
    says its one line instead. The bar is turned off where it is drawn: stderr is not taken from the
    whole process meanwhile, where another thread's line (an error among them) would go with it."""
    import transformers

    assert "tqdm(" in inspect.getsource(modeling_gguf_pytorch_utils.load_gguf_checkpoint)  # where it is drawn
    drawn = modeling_gguf_pytorch_utils.tqdm

    class Tokenizer:  # what transformers does while converting: its bar, and meanwhile another thread's line
        @staticmethod
        def from_pretrained(*args, **kwargs):
            for _ in modeling_gguf_pytorch_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
            print("another thread's line", file=sys.stderr)
            raise ValueError("stop here")

    monkeypatch.setattr(transformers, "AutoTokenizer", Tokenizer)
    with pytest.raises(ModelLoadError, match="stop here"):
        conversion.write_hf_folder(tmp_path / "m.gguf", torch.bfloat16, tmp_path / "out")
    assert modeling_gguf_pytorch_utils.tqdm is drawn  # put back afterwards
    err = capfd.readouterr().err
    assert "another thread's line" in err and "de-quantizing" not in err


@pytest.mark.parametrize("packed_model", [True, False], ids=["for-a-packed-model", "for-transformers"])
@pytest.mark.parametrize("compiles", [True, False])
def test_a_conversion_beside_the_kernels_compile_leaves_the_compiler_a_core(compiles, packed_model, monkeypatch):
    """Two cores shared by the compiler and torch's two threads made a first start slower (each parallel
    region waits for the thread the compiler displaced): the model is found and converted (in memory
    for a packed model) on one thread fewer while the kernel compiles, on all of them otherwise, and
    torch's count is put back."""
    from specchat import sources
    from specchat.decode.runtime.target import ModelSpec

    monkeypatch.setattr(sources, "kernel_candidate", lambda spec, device, dtype: True)
    monkeypatch.setattr(sources.woq_kernel, "missing_cpu_features", lambda: [])
    monkeypatch.setattr(sources.woq_kernel, "start_build", lambda: compiles)
    threads_while_found = []

    def locate_source(source, dtype, in_memory=False):
        threads_while_found.append(torch.get_num_threads())
        assert in_memory == packed_model
        raise ModelLoadError("found (the test stops here)")

    monkeypatch.setattr(sources, "find_source", lambda spec: sources.Source(gguf=Path("any.gguf")))
    monkeypatch.setattr(sources, "source_key", lambda source: "any")
    monkeypatch.setattr(sources, "locate_source", locate_source)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ModelLoadError, match="the test stops here"):
            sources.load_target(ModelSpec(model="any", device="cpu", dtype="bfloat16"), packed_model)
        assert threads_while_found == [1 if compiles else 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_torch_threads_are_set_for_a_block_and_put_back_even_on_an_error():
    from specchat.decode.runtime.machine import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(KeyError):
            with torch_threads(0):  # at least one
                assert torch.get_num_threads() == 1
                raise KeyError
        assert torch.get_num_threads() == 2
        with torch_threads(None):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
