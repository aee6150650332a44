"""The packed model (decode/runtime/packed.py) and its tokenizer (decode/runtime/tokenizer.py): a start
from the packed file computes what the start through transformers computes (the same logits and
features, bit for bit), prompts become the same ids and ids the same text; the file is remade when
what it was made from changes; and a piped chat from it imports neither transformers nor torch's
compiler nor the REPL's prompt_toolkit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import (CHATML_TEMPLATE, build_tokenizer, prefill_decode_and_tree, random_head,
                      save_model_folder)
from drafters import save_head
from specchat.decode.runtime import packed, woq_kernel
from specchat.decode.runtime.packed import PackedModel
from specchat.decode.runtime.machine import write_safetensors
from specchat.decode.runtime.quantized import save_atomically, weights_key
from specchat.decode.runtime.target import ModelSpec
from specchat.decode.runtime.tokenizer import SnapshotTokenizer, quick_merges, render_chat, snapshot
from specchat.sources import load_target

needs_kernel = pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                                  reason="the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")

# Qwen2.5's chat template (the embedded model's): a default system prompt, tools, tool calls
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
# What else transformers' template environment offers: namespaces, loop controls, the generation
# block, tojson's arguments, dict, the special tokens as variables, and raise_exception
FEATURES_TEMPLATE = (
    "{{ bos_token if bos_token is defined else '' }}{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}{% if message.role not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unknown role ' + message.role) }}{% endif %}"
    "{% if message.role == 'system' %}{% continue %}{% endif %}{% set ns.turns = ns.turns + 1 %}"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message | tojson(indent=1, sort_keys=True) }}{% endif %}\n{% endfor %}"
    "{{ dict(turns=ns.turns) | tojson }}{% if add_generation_prompt %}>>>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Say hi"}],  # the default system prompt (Qwen's)
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi"}],
    [{"role": "user", "content": "Ünïcödé: e\u0301, ﬁ, A\u030a, 汉字, 🙂"},  # text NFC changes, as Qwen's tokenizer applies it
     {"role": "assistant", "content": "An answer <|im_end|> with a special token", "interrupted": True},
     {"role": "user", "content": "  spaces\tand\n\nnewlines  ", "name": None}],
]


def tiny_folder(tmp_path_factory, arch: str, **overrides):
    return save_model_folder(tmp_path_factory.mktemp(f"packed-{arch}"), arch, **overrides)


def load(folder, dtype: str, packed_model: bool):
    return load_target(ModelSpec(model=str(folder), dtype=dtype, device="cpu", quantize="int5"), packed_model)


@needs_kernel
@pytest.mark.parametrize("arch,dtype,overrides", [("qwen2", "float32", {}), ("qwen2", "bfloat16", {}),
                                                  ("qwen3", "float32", {"head_dim": 32}),
                                                  ("llama", "float32", {"attention_bias": True})],
                         ids=["qwen2-float32", "qwen2-bfloat16", "qwen3-float32", "llama-biases"])
def test_a_packed_model_computes_what_the_model_it_was_packed_from_computes(tmp_path_factory, arch, dtype, overrides):
    folder = tiny_folder(tmp_path_factory, arch, **overrides)
    through_transformers = load(folder, dtype, packed_model=True)  # none yet: transformers, and the file written
    assert not isinstance(through_transformers.model, PackedModel)
    from_file = load(folder, dtype, packed_model=True)
    assert isinstance(from_file.model, PackedModel) and from_file.own_forward.fused is not None
    assert (from_file.runtime, from_file.dtype, from_file.vocab_size, from_file.max_context, from_file.num_layers) == \
        (through_transformers.runtime, through_transformers.dtype, through_transformers.vocab_size,
         through_transformers.max_context, through_transformers.num_layers)
    for ours, theirs in zip(prefill_decode_and_tree(from_file, from_file.new_cache()), prefill_decode_and_tree(through_transformers, through_transformers.new_cache())):
        assert torch.equal(ours.logits, theirs.logits)
        assert torch.equal(ours.features, theirs.features)
    # specchat's Python forward (what runs where the fused one does not take a mask) over the packed modules
    from_file.own_forward.fused = through_transformers.own_forward.fused = None
    for ours, theirs in zip(prefill_decode_and_tree(from_file, from_file.new_cache()), prefill_decode_and_tree(through_transformers, through_transformers.new_cache())):
        assert torch.equal(ours.logits, theirs.logits)


@needs_kernel
def test_the_packed_file_is_keyed_by_the_weights_and_remade_when_what_made_it_changes(tmp_path_factory, capsys):
    folder = tiny_folder(tmp_path_factory, "qwen2")
    load(folder, "float32", packed_model=True)
    stored = packed.path(weights_key(folder), "int5", torch.float32)
    assert stored.is_file() and not any(path.name.endswith(".partial") for path in stored.parent.iterdir())
    assert packed.path(weights_key(folder), "int4", torch.float32) != stored != \
        packed.path(weights_key(folder), "int5", torch.bfloat16)
    with safe_open(stored, framework="pt") as handle:
        tensors, stamp = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    assert stamp["kernel"] == woq_kernel.source_hash() and stamp["format"] == packed.FORMAT

    for changed in ({**stamp, "kernel": "0" * 8}, {**stamp, "transformers": "0.0"}):  # another kernel, transformers
        save_atomically(stored, tensors, changed)
        assert not isinstance(load(folder, "float32", packed_model=True).model, PackedModel)  # through transformers
        assert "out of date" in capsys.readouterr().err
        assert isinstance(load(folder, "float32", packed_model=True).model, PackedModel)  # and written anew
    save_atomically(stored, {key: value for key, value in tensors.items() if key != "norm"}, stamp)
    assert not isinstance(load(folder, "float32", packed_model=True).model, PackedModel)
    assert "does not hold what it should ('norm')" in capsys.readouterr().err
    stored.write_bytes(b"not a safetensors file")
    assert not isinstance(load(folder, "float32", packed_model=True).model, PackedModel)
    assert isinstance(load(folder, "float32", packed_model=True).model, PackedModel)

    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # the weights changed
    assert packed.path(weights_key(folder), "int5", torch.float32) != stored


def fake_gguf(tmp_path, folder, monkeypatch) -> Path:
    """A GGUF file whose conversion gives `folder`'s model (in the conversion's dtype) as a GGUF's load
    leaves it: the rotary frequencies in bf16, where a folder's model computes them in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specchat import converted

    def gguf_model(gguf_path, dtype):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(torch.bfloat16)
        return model, AutoTokenizer.from_pretrained(folder)

    monkeypatch.setattr(converted, "gguf_model", gguf_model)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    return path


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_is_converted_in_memory_for_its_packed_model_and_computes_what_its_converted_folder_does(
        tmp_path, tmp_path_factory, monkeypatch, dtype):
    """A chat's first start from a GGUF converts it in memory and writes only the packed model (the
    bf16 folder's gigabytes unwritten): the same logits as the model loaded from that folder (what
    `bench` and training load), then from the packed file; a second start converts nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specchat import converted
    from specchat.decode.runtime.machine import cache_dir

    folder = tiny_folder(tmp_path_factory, "qwen2")
    converted_folder = tmp_path / "converted"  # what the conversion to a folder writes: the weights in bf16
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(converted_folder)
    AutoTokenizer.from_pretrained(folder).save_pretrained(converted_folder)
    spec = ModelSpec(model=str(fake_gguf(tmp_path, folder, monkeypatch)), dtype=dtype, device="cpu", quantize="int5")

    in_memory = load_target(spec, packed_model=True)
    assert not isinstance(in_memory.model, PackedModel) and in_memory.own_forward.fused is not None
    assert not any(path.is_dir() for path in (cache_dir() / "models").glob("gguf-*"))  # (its lock file only)
    assert len(list((cache_dir() / "packed").glob("*.safetensors"))) == 1
    monkeypatch.setattr(converted, "gguf_model", lambda *args: pytest.fail("converted again"))
    from_file = load_target(spec, packed_model=True)
    assert isinstance(from_file.model, PackedModel)
    from_folder = load(converted_folder, dtype, packed_model=False)
    for target in (in_memory, from_file):
        for ours, theirs in zip(prefill_decode_and_tree(target, target.new_cache()),
                                prefill_decode_and_tree(from_folder, from_folder.new_cache())):
            assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.features, theirs.features)


@needs_kernel
def test_a_gguf_converted_in_memory_is_kept_as_its_folder_where_no_packed_model_can_be_made(tmp_path, tmp_path_factory,
                                                                                          monkeypatch):
    """Where the kernel turns out not to run (no compiler, say), no packed model is made: the model
    converted in memory is written as its converted folder, which later starts load."""
    from specchat import converted
    from specchat.decode.runtime.machine import cache_dir

    spec = ModelSpec(model=str(fake_gguf(tmp_path, tiny_folder(tmp_path_factory, "qwen2"), monkeypatch)),
                     dtype="bfloat16", device="cpu")  # quantize auto: the kernel where it runs
    monkeypatch.setattr(woq_kernel, "unavailable_reason", lambda: "no C++ compiler (the test says)")
    load_target(spec, packed_model=True)
    kept = [path for path in (cache_dir() / "models").glob("gguf-*-bfloat16") if path.is_dir()]
    assert len(kept) == 1 and converted.damage(kept[0]) is None
    assert not any((cache_dir() / "packed").glob("*.safetensors"))
    monkeypatch.setattr(converted, "gguf_model", lambda *args: pytest.fail("converted again"))
    assert load_target(spec, packed_model=True).spec.quantize == "none"


@needs_kernel
def test_what_calls_transformers_model_itself_does_not_get_a_packed_one(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory, "qwen2")
    load(folder, "float32", packed_model=True)
    assert not isinstance(load(folder, "float32", packed_model=False).model, PackedModel)
    compiled = ModelSpec(model=str(folder), dtype="float32", device="cpu", quantize="int5", cuda_graphs="on")
    assert not isinstance(load_target(compiled, packed_model=True).model, PackedModel)  # fixed-shape steps


def test_the_tokenizer_snapshot_answers_as_transformers_tokenizer():
    theirs = build_tokenizer()
    ours = SnapshotTokenizer(json.loads(json.dumps(snapshot(theirs))))  # as the packed file keeps it
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id and ours.chat_template == theirs.chat_template
    for template in (CHATML_TEMPLATE, QWEN25_TEMPLATE, FEATURES_TEMPLATE):
        for conversation in CONVERSATIONS:
            for generation_prompt in (True, False):
                kwargs = dict(chat_template=template, add_generation_prompt=generation_prompt, return_dict=False)
                assert ours.apply_chat_template(conversation, tokenize=False, **kwargs) == \
                    theirs.apply_chat_template(conversation, tokenize=False, **kwargs)
                assert ours.apply_chat_template(conversation, **kwargs) == \
                    theirs.apply_chat_template(conversation, **kwargs)
    for text in ("Say hi", "  <|im_start|>user\nA\u030a ﬁ 🙂<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    ids = list(range(len(theirs))) + [258, 104, 258, 33]
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_merges_written_as_strings_are_the_same_merges_and_a_token_with_a_space_keeps_them_pairs():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4, "aab": 5}
    byte_level = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("\u0120", "ab"), ("a", "ab")]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    quick = quick_merges(byte_level.to_str())
    assert json.loads(quick)["model"]["merges"] == ["a b", "\u0120 ab", "a ab"]
    assert Tokenizer.from_str(quick).to_str() == byte_level.to_str()  # read back: the very same tokenizer
    assert Tokenizer.from_str(quick).encode("aab ab").ids == byte_level.encode("aab ab").ids == [5, 4]
    spaced = Tokenizer(models.BPE(vocab={"a": 0, " ": 1, "a ": 2}, merges=[("a", " ")])).to_str()
    assert quick_merges(spaced) == spaced  # "a  " would not say which space splits it


def test_a_template_that_refuses_a_conversation_refuses_it_as_transformers_does():
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        render_chat(FEATURES_TEMPLATE, [{"role": "tool", "content": "x"}], True, {})
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no attribute of the str type
        render_chat("{{ messages[0].content.__class__('x') }}", [{"role": "user", "content": "x"}], True, {})


@needs_kernel
@pytest.mark.parametrize("method", ["vanilla", "deagle"])
def test_a_piped_chat_from_the_packed_model_imports_no_transformers_compiler_or_repl(tmp_path_factory, method):
    """The default's head too: a head built empty for its weights (`drafters.built_empty`) that ran an
    operation on the meta device would import torch's compiler (~1.2 s of the start)."""
    folder = tiny_folder(tmp_path_factory, "qwen2")
    target = load(folder, "float32", packed_model=True)  # the packed file, as a first start leaves it
    head = tmp_path_factory.mktemp("head")
    save_head(random_head("eagle3", target), head)  # a draft vocabulary of its own: a map to make
    code = ("import sys\nfrom specchat.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    assert not done.code, done.code\n"
            "print(sorted(m for m in ('transformers', 'torch._dynamo', 'prompt_toolkit', 'specchat.repl') "
            "if m in sys.modules))")
    args = ["chat", "--model", str(folder), "--quantize", "int5", "--dtype", "float32", "--method", method,
            *(["--draft", str(head)] if method != "vanilla" else []), "--max-new-tokens", "3", "--verbose"]
    run = subprocess.run([sys.executable, "-c", code, *args], input="Say hi", capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"
    phases = [line for line in run.stderr.splitlines() if line.startswith("specchat: ") and "s  " in line]
    assert any("loaded the packed model" in line for line in phases) and "the first token" in phases[-1]


def test_a_safetensors_file_written_tensor_by_tensor_reads_back_as_written(tmp_path):
    """`write_safetensors` (the converted and packed models' writer) against safetensors' own reader:
    every dtype the models hold, a scalar, an empty tensor, a view that is not contiguous, the
    metadata; each tensor starts at a multiple of its element size."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "norm": torch.randn(5, generator=generator),
        "half": torch.randn(3, generator=generator).half(),
        "codes": torch.randint(0, 255, (9,), generator=generator, dtype=torch.uint8),
        "ids": torch.arange(3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=generator).t(),
    }
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "layout": "x"})
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "layout": "x"}
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor) and handle.get_tensor(name).dtype == tensor.dtype
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert all(entry["data_offsets"][0] % tensors[name].element_size() == 0
               for name, entry in header.items() if name != "__metadata__")
