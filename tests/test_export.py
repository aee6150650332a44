"""`specchat export-head` and `train --export`: heads written in the layouts vLLM and SGLang load as
they are, read back by `--draft` strictly, drafting exactly what the original drafts.

The fields and key names are pinned against the loader code, read on 2026-11-24:

- vLLM, speculators layout: `vllm/transformers_utils/configs/speculators/base.py`
  (`SpeculatorsConfig.extract_transformers_pre_trained_config`: the layer's fields come from
  `transformer_layer_config`, the algorithm from `speculators_model_type`, the draft length from
  `speculators_config.proposal_methods[0].speculative_tokens`; `validate_speculators_config` also
  requires `speculators_config.verifier.name_or_path`) and `.../speculators/algos.py`
  (`update_eagle3`: `draft_vocab_size`, `target_hidden_size`, `norm_before_residual` (True when
  absent), `eagle_aux_hidden_state_layer_ids`); `vllm/model_executor/models/llama_eagle3.py`
  (`Eagle3LlamaForCausalLM.load_weights`: `t2d` skipped, `d2t` -> `draft_id_to_target_id`, every
  other name but `lm_head` prefixed `model.`, `midlayer.` read as `layers.0.`, q/k/v and gate/up
  stacked; `fc` has no bias; `_norm_after_residual` unless `norm_before_residual`); the model
  runner captures the *input* of each listed layer (`if layer_idx in aux_hidden_state_layers:
  aux_hidden_states.append(hidden_states + residual)` before the layer runs).
- speculators itself: `src/speculators/models/eagle3/config.py` (`Eagle3SpeculatorConfig`:
  architectures `Eagle3Speculator`, the fields above) and its EAGLE-3 converter
  (`src/speculators/convert/eagle/eagle3_converter.py`: greedy proposal, 5 speculative tokens).
- SGLang: `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`: `d2t`
  -> hot token ids, `t2d` skipped, a name not among the parameters is tried with `model.` in
  front and otherwise *silently skipped*; the layer is `model.midlayer`; `fc` bias only with
  `config.bias`; `tie_word_embeddings` makes the LM head the embedding) and its targets'
  `set_eagle3_layers_to_capture` (captures at id + 1: the ids name layer outputs).

The context, read on 2026-11-25: vLLM's draft layer is its Llama layer
(`vllm/model_executor/models/llama.py`, `LlamaAttention`: `max_position_embeddings =
getattr(config, "max_position_embeddings", 8192)` sizes the rotary table), so a head whose config
lacks the field accepts nothing past 8,192 tokens (measured: 0 of 300 drafts on an 8,641-token
prompt, 1.36 once set). SGLang (`python/sglang/srt/configs/model_config.py`,
`ModelConfig._derive_context_length`) refuses at start-up a draft whose derived context
(`max_position_embeddings`, transformers' LlamaConfig default 2048) is below the target's, unless
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set. So every layout says the target's context.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke, load_tiny_target, random_head, tokens_of
from drafters import HeadLoadError, Verifier, export_head, load_head, save_head, layer_fields
from drafters.eagle3 import default_feature_layers
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.drafting import heads
from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams

PROMPT = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]
VERIFIER = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
# Its config.json says Qwen2ForCausalLM, max_position_embeddings 32768 and rope_theta 1e6.
QWEN = Verifier(VERIFIER, ("Qwen2ForCausalLM",), 32768)


@pytest.fixture(scope="module")
def target(qwen_dir):
    return load_tiny_target(qwen_dir)


@pytest.fixture(scope="module")
def eagle3_dir(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    save_head(random_head("eagle3", target), folder)
    (folder / "training.json").write_text(json.dumps({"target": {"name": "qwen2.5-coder-0.5b-instruct",
                                                                 "layers": target.num_layers}}))
    return folder


def weights(folder) -> dict[str, torch.Tensor]:
    from drafters.checkpoint import read_weights

    return read_weights(folder)[0]


def vllm_parameter(name: str) -> str | None:
    """The parameter of vLLM's Eagle3LlamaForCausalLM a checkpoint key loads into (its load_weights'
    renaming), or None for a key it skips."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.")
    for stacked, part in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                          (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
        name = name.replace(part, stacked)
    return name


VLLM_PARAMETERS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
    *(f"model.layers.0.{p}" for p in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                                      "hidden_norm.weight", "post_attention_layernorm.weight")),
}


def sglang_parameter(name: str) -> str | None:
    """The parameter of SGLang's LlamaForCausalLMEagle3 a key loads into, or None where SGLang skips it
    (silently: an unknown name is no error there)."""
    if "d2t" in name or "t2d" in name:
        return None
    for stacked, part in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                          (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
        name = name.replace(part, stacked)
    name = name if name in SGLANG_PARAMETERS else f"model.{name}"
    return name if name in SGLANG_PARAMETERS else None


SGLANG_PARAMETERS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
    *(f"model.midlayer.{p}" for p in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                                      "hidden_norm.weight", "post_attention_layernorm.weight")),
}


def test_the_speculators_layout_holds_what_vllm_reads(eagle3_dir, target, tmp_path):
    out = tmp_path / "speculators"
    export_head(eagle3_dir, out, "speculators", QWEN, 5, default_feature_layers(target.num_layers))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == target.vocab_size
    assert layer["hidden_size"] == 64 and layer["tie_word_embeddings"] is False and layer["attention_bias"] is False
    assert config["draft_vocab_size"] == 100
    assert config["norm_before_residual"] is False  # said: vLLM reads an absent field as True, another layer
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"] == {"name_or_path": VERIFIER, "architectures": ["Qwen2ForCausalLM"]}
    assert layer["max_position_embeddings"] == 32768  # vLLM's Llama layer: 8192 when absent
    # vLLM captures the input of layer id: the hidden-state indices here, as they are
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_feature_layers(target.num_layers))
    keys = set(weights(out))
    assert not any(key.startswith("midlayer.") for key in keys) and "fc.bias" not in keys
    loaded = {vllm_parameter(key) for key in keys} - {None}
    assert loaded <= VLLM_PARAMETERS and loaded >= VLLM_PARAMETERS - {"model.embed_tokens.weight"}


def test_the_sglang_layout_holds_what_sglang_reads(target, tmp_path):
    head = random_head("eagle3", target)
    head.config = type(head.config)(**{**head.config.__dict__, "feature_layer_ids": (1, 3, 5)})
    save_head(head, tmp_path / "head")
    export_head(tmp_path / "head", tmp_path / "sglang", "sglang", QWEN)
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["max_position_embeddings"] == 32768  # SGLang refuses a draft below the target's context
    assert config["tie_word_embeddings"] is False  # else SGLang makes the LM head the embedding
    assert config["draft_vocab_size"] == 100 and "bias" not in config
    # SGLang captures at id + 1: the ids name layer outputs, one below the hidden-state indices
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    keys = set(weights(tmp_path / "sglang"))
    skipped = [key for key in keys if sglang_parameter(key) is None and key not in ("d2t", "t2d")]
    assert not skipped, f"SGLang would skip {skipped} without a word"
    assert {sglang_parameter(key) for key in keys} - {None} >= SGLANG_PARAMETERS - {"model.embed_tokens.weight"}


def test_a_head_staged_for_another_tools_converter_is_an_eagle3_head_that_names_its_layers(eagle3_dir, target, tmp_path):
    """OpenVINO GenAI's and llama.cpp's exports stage the head in a published layout first
    (`exports.stage_eagle3`): an EAGLE-3 head gives the layers it reads; another format is said."""
    from specchat.errors import SpecchatError
    from specchat.exports import stage_eagle3

    layers = default_feature_layers(target.num_layers)
    read = stage_eagle3(eagle3_dir, tmp_path / "speculators", "speculators", QWEN, layers, "llama.cpp")
    assert read == list(layers)
    assert stage_eagle3(eagle3_dir, tmp_path / "sglang", "sglang", QWEN, layers, "OpenVINO GenAI") == [i - 1 for i in layers]
    save_head(random_head("eagle", target), tmp_path / "eagle")
    with pytest.raises(SpecchatError, match="OpenVINO GenAI drafts with EAGLE-3 heads only, not LlamaForCausalLM$"):
        stage_eagle3(tmp_path / "eagle", tmp_path / "eagle-sglang", "sglang", QWEN, None, "OpenVINO GenAI")


@pytest.mark.parametrize("kind,layout", [("eagle3", "speculators"), ("eagle3", "sglang"), ("eagle3", "eagle"),
                                         ("eagle", "eagle"), ("eagle", "sglang"), ("jakiro", "eagle")])
def test_exported_heads_load_back_strictly_and_draft_the_same(kind, layout, target, tmp_path):
    head = random_head(kind, target)
    save_head(head, tmp_path / "head")
    export_head(tmp_path / "head", tmp_path / layout, layout, QWEN, 5, default_feature_layers(target.num_layers))
    back = load_head(tmp_path / layout, target, kind)
    assert back.feature_layers(target.num_layers) == head.feature_layers(target.num_layers)
    ours, theirs = head.trainable_state_dict(), back.trainable_state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    settings = GenerationSettings(max_new_tokens=24)
    shape = DynamicTree(DynamicTreeParams(total_tokens=12, depth=4, top_k=3))
    steps = [list(Engine(target, heads.for_target(h, target, shape)).generate(PROMPT, settings))
             for h in (head, back)]
    assert [s.cycle.tree.tokens for s in steps[0][1:]] == [s.cycle.tree.tokens for s in steps[1][1:]]
    assert tokens_of(Engine(target, heads.for_target(back, target, shape)), PROMPT, settings) == \
        tokens_of(Engine(target), PROMPT, settings)


def test_a_speculators_head_that_norms_before_its_residual_loads_as_such_and_stays_there(eagle3_dir, target, tmp_path):
    export_head(eagle3_dir, tmp_path / "spec", "speculators", QWEN)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    del config["norm_before_residual"]  # absent: vLLM's default, true
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    before = load_head(tmp_path / "spec", target)
    plain = load_head(eagle3_dir, target)
    assert before.config.norm_before_residual and not plain.config.norm_before_residual
    hidden, tokens, positions = torch.randn(3, 3 * 64), torch.tensor([5, 6, 7]), torch.arange(3)
    from drafters.cache import HeadCache

    outputs = [h(hidden, tokens, positions, None, HeadCache()) for h in (before, plain)]
    assert not torch.allclose(outputs[0], outputs[1])  # another layer: another output
    with pytest.raises(HeadLoadError, match="only the speculators layout holds it"):
        export_head(tmp_path / "spec", tmp_path / "sglang", "sglang", QWEN)


def test_what_a_layout_cannot_hold_is_refused_in_one_line(eagle3_dir, target, tmp_path):
    save_head(random_head("jakiro", target), tmp_path / "jakiro")
    with pytest.raises(HeadLoadError, match="written in the eagle layout, not speculators"):
        export_head(tmp_path / "jakiro", tmp_path / "out", "speculators", QWEN)
    with pytest.raises(HeadLoadError, match="names the head's verifier"):
        export_head(eagle3_dir, tmp_path / "out", "speculators", Verifier(max_position_embeddings=32768))
    with pytest.raises(HeadLoadError, match=r"says the target's context \(max_position_embeddings\)"):
        export_head(eagle3_dir, tmp_path / "out", "sglang")  # neither the head nor the caller says it


@pytest.mark.parametrize("layout", ["speculators", "sglang", "eagle"])
def test_every_layout_says_the_targets_context_over_the_heads_own(eagle3_dir, tmp_path, layout):
    """The target's context wins (the head's positions must reach the target's); the head's own
    config's is the fallback."""
    config = json.loads((eagle3_dir / "config.json").read_text())
    (tmp_path / "head").mkdir()
    for name in ("model.safetensors", "training.json"):
        (tmp_path / "head" / name).write_bytes((eagle3_dir / name).read_bytes())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    export_head(tmp_path / "head", tmp_path / "a", layout, QWEN)
    assert layer_fields(json.loads((tmp_path / "a" / "config.json").read_text()))["max_position_embeddings"] == 32768
    export_head(tmp_path / "head", tmp_path / "b", layout, Verifier(VERIFIER))
    assert layer_fields(json.loads((tmp_path / "b" / "config.json").read_text()))["max_position_embeddings"] == 2048


def test_bundled_heads_say_their_targets_context_and_rotary_base():
    """Their configs (not their weights) carry Qwen2.5-Coder-0.5B-Instruct's max_position_embeddings
    and rope_theta, as the target's config.json says them."""
    from specchat.heads import bundled_heads

    for name, folder in bundled_heads().items():
        config = json.loads((folder / "config.json").read_text())
        assert config["max_position_embeddings"] == 32768 and config["rope_theta"] == 1e6, name
        assert config.get("rope_scaling") is None, name  # Qwen2.5's is none: the head's must be none too


def test_export_head_command_writes_a_bundled_head_for_vllm_and_sglang(capsys, tmp_path):
    """The bundled EAGLE-3 head, for vLLM: its verifier, the verifier's architectures, the target's
    context and the target layers come from its training record (the embedded model's facts)."""
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-eagle3", "--format", "speculators",
                             "-o", str(tmp_path / "vllm")], capsys)
    assert status == 0, err
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": VERIFIER, "architectures": ["Qwen2ForCausalLM"]}
    assert config["transformer_layer_config"]["max_position_embeddings"] == 32768
    assert config["transformer_layer_config"]["rope_theta"] == 1e6
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 12, 21]  # Qwen2.5-0.5B's 24 layers
    assert (tmp_path / "vllm" / "training.json").is_file()
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-eagle3", "--format", "sglang",
                             "-o", str(tmp_path / "sglang")], capsys)
    assert status == 0, err
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768 and config["rope_theta"] == 1e6
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 11, 20]  # outputs of those layers
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-eagle3", "--format", "sglang",
                             "--max-position-embeddings", "65536", "-o", str(tmp_path / "longer")], capsys)
    assert status == 0 and json.loads((tmp_path / "longer" / "config.json").read_text())["max_position_embeddings"] == 65536
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-jakiro", "--format", "speculators",
                             "-o", str(tmp_path / "no")], capsys)
    assert status != 0 and "not speculators" in err and "Traceback" not in err
