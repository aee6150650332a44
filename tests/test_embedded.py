"""Embedded models: chunks found through importlib, checked, and clear errors otherwise."""

import hashlib
import json

import numpy
import pytest
import torch
from safetensors.torch import save_file

from specchat import converted, embedded
from specchat.decode.runtime.target import ModelSpec
from specchat.errors import ModelLoadError
from specchat.sources import locate


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    """Two installed 'chunk packages' holding the two halves of a small file."""
    payload = b"GGUF" + bytes(range(256)) * 40
    halves = [payload[:3000], payload[3000:]]
    for index, half in enumerate(halves, start=1):
        package = tmp_path / f"fake_chunk_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part0{index}.bin").write_bytes(half)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = embedded.EmbeddedModel(
        name="fake", description="", packages=("fake_chunk_part1", "fake_chunk_part2"), extra="demo",
        size=len(payload), sha256=hashlib.sha256(payload).hexdigest(), hub_id="fake/fake",
        architectures=("LlamaForCausalLM",), max_position_embeddings=4096)
    return model, payload


def test_assembles_the_chunks_in_order(fake_chunks, tmp_path):
    model, payload = fake_chunks
    destination = tmp_path / "out.gguf"
    embedded.assemble(model, destination)
    assert destination.read_bytes() == payload


def test_a_wrong_checksum_is_an_error_that_says_how_to_fix_it(fake_chunks, tmp_path):
    model, _ = fake_chunks
    wrong = embedded.EmbeddedModel(**{**model.__dict__, "sha256": "0" * 64})
    with pytest.raises(embedded.EmbeddedModelError, match=r"expected .* sha256 0000.*pip install --force-reinstall"):
        embedded.assemble(wrong, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.partial").exists()


def test_a_missing_package_names_the_install_command(monkeypatch):
    model = embedded.EmbeddedModel(name="fake", description="", packages=("no_such_chunk_package",),
                                   extra="demo", size=1, sha256="0" * 64, hub_id="fake/fake",
                                   architectures=("LlamaForCausalLM",), max_position_embeddings=4096)
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", model)
    with pytest.raises(ModelLoadError, match=r"no-such-chunk-package, which is not installed.*specchat\[demo\]"):
        locate(ModelSpec(model="fake"), None)


def test_a_file_named_gguf_that_is_not_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        locate(ModelSpec(model=str(fake)), None)


def test_offline_hub_id_fails_fast_with_a_hint(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"cannot reach the Hugging Face hub.*--model qwen2.5-coder-0.5b-instruct"):
        locate(ModelSpec(model="Qwen/Qwen2.5-Coder-0.5B-Instruct"), None)


def _converted_folder(cache, model, stamp_chunks):
    """A finished conversion in the cache, as an earlier install would have left it."""
    folder = cache / "models" / f"{model.name}-float32"
    folder.mkdir(parents=True)
    for name in converted.NEEDED_FILES:
        (folder / name).write_text("{}")
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    (folder / converted.STAMP).write_text(json.dumps({"embedded": model.name, "sha256": model.sha256,
                                                    "dtype": "float32", "chunks": stamp_chunks}))
    return folder


def test_a_conversion_from_another_install_is_reused_after_checking_the_chunks(fake_chunks, tmp_path, monkeypatch):
    model, _ = fake_chunks
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(converted, "convert_gguf", lambda *args: pytest.fail("converted again"))
    folder = _converted_folder(tmp_path / "cache", model, [["/old/venv/part01.bin", 3000, 0]])
    assert converted.embedded_folder(model, torch.float32) == folder
    stamp = json.loads((folder / converted.STAMP).read_text())
    assert stamp["chunks"] == embedded.fingerprint(embedded.chunk_files(model))


def test_chunks_that_changed_under_an_old_conversion_are_an_error(fake_chunks, tmp_path, monkeypatch):
    model, _ = fake_chunks
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    part = embedded.chunk_files(model)[1]
    part.write_bytes(b"corrupted" + part.read_bytes()[9:])
    _converted_folder(tmp_path / "cache", model, [])
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall"):
        converted.embedded_folder(model, torch.float32)


def test_the_shared_reader_makes_gguf_pys_fields_and_transformers_values(tmp_path):
    """A conversion reads a GGUF's arrays (a vocabulary's tokens, merges, token types) in one loop, and
    decodes a string at once (`converted._gguf_parsed_once`): the same fields, parts and parsed values
    as gguf-py's reader and transformers' parse, for every kind of value a GGUF holds."""
    import gguf
    from transformers.integrations.gguf import reader as transformers_reader
    from transformers.integrations.ggml import _gguf_parse_value

    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "ünïcode ✓")
    writer.add_array("tokenizer.ggml.tokens", ["a", "", "Ġthe", "✓✓", "\n"])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3, 1, 6])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0, 0.0, 1e-3])
    writer.add_array("empty", [])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_bool("flag", True)
    writer.add_uint64("big", 2**40)
    writer.add_tensor("w", numpy.arange(8, dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def values(reader, parse):  # (transformers parses no array of arrays: that one's parts are compared below)
        return {name: [parse(field.parts[i], field.types) for i in field.data]
                for name, field in reader.fields.items() if len(field.types) <= 2}

    expected = gguf.GGUFReader(path)
    expected_values = values(expected, _gguf_parse_value)
    flat = str(path.with_name("flat.gguf"))  # transformers' own reader takes no array of arrays
    writer = gguf.GGUFWriter(flat, "llama")
    for name, value in [("tokenizer.ggml.tokens", ["a", "", "Ġthe", "✓✓", "\n"]), ("types", [1, 2, 3])]:
        writer.add_array(name, value)
    writer.add_string("general.name", "ünïcode ✓")
    writer.add_tensor("w", numpy.arange(8, dtype=numpy.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    mapped = transformers_reader._mapped
    expected_metadata = transformers_reader.read_gguf_metadata(flat, ("tokenizer.ggml.tokens",))
    assert isinstance(mapped(flat), numpy.memmap)
    with converted._gguf_parsed_once():
        from transformers import modeling_gguf_pytorch_utils as gguf_loading

        reader = gguf.GGUFReader(path)
        parsed = values(reader, gguf_loading._gguf_parse_value)
        # transformers' own reader (the tokenizer's, the config's keys) reads a plain array: the same values
        assert type(transformers_reader._mapped(flat)) is numpy.ndarray
        assert transformers_reader.read_gguf_metadata(flat, ("tokenizer.ggml.tokens",)) == expected_metadata
    assert transformers_reader._mapped is mapped  # put back afterwards
    assert expected_metadata[0]["tokenizer.ggml.tokens"] == ["a", "", "Ġthe", "✓✓", "\n"]
    assert list(reader.fields) == list(expected.fields) and parsed == expected_values
    assert parsed["tokenizer.ggml.tokens"] == ["a", "", "Ġthe", "✓✓", "\n"]
    assert parsed["general.name"] == ["ünïcode ✓"]
    for name, field in expected.fields.items():
        other = reader.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types), name
        assert [(p.dtype, p.shape, p.tobytes()) for p in other.parts] == \
            [(p.dtype, p.shape, p.tobytes()) for p in field.parts], name
    assert [t.data.tobytes() for t in reader.tensors] == [t.data.tobytes() for t in expected.tensors]
