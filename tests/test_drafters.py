"""Loading draft heads in the published formats, strictly, with an error naming every mismatch."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_tiny_target, random_head
from drafters import HeadLoadError, load_head, save_head


@pytest.fixture(scope="module")
def target(qwen_dir):
    return load_tiny_target(qwen_dir)


def outputs(head, target):
    from drafters.cache import HeadCache

    torch.manual_seed(0)
    width = head.fc.in_features if head.kind == "eagle3" else target.hidden_size
    features, tokens = torch.randn(5, width), torch.tensor([3, 4, 5, 6, 7])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out = head(features, tokens, torch.arange(5), mask, HeadCache())
        return head.log_probs(out)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_round_trip_through_the_published_format(kind, target, tmp_path):
    head = random_head(kind, target, seed=1)
    save_head(head, tmp_path / "head")
    loaded = load_head(str(tmp_path / "head"), target)
    assert loaded.kind == kind
    torch.testing.assert_close(outputs(loaded, target), outputs(head, target))
    if kind == "eagle3":
        assert torch.equal(loaded.draft_to_target, head.draft_to_target)


def test_a_head_built_empty_takes_the_checkpoints_tensors_and_an_absent_optional_key_is_named(target, tmp_path):
    """Heads are built on the meta device for their checkpoint (no random weights made to be overwritten)."""
    from drafters.checkpoint import built_empty, load_strict

    head = random_head("eagle3", target, seed=3)
    state = {key: value.clone() for key, value in head.state_dict().items() if key != "embed_tokens.weight"}
    with built_empty():
        empty = type(head)(head.config, target.embed_tokens)
    load_strict(empty, dict(state), tmp_path, optional=("embed_tokens.weight",), assign=True)
    assert all(empty.state_dict()[key].data_ptr() == value.data_ptr() for key, value in state.items())  # not copied
    assert empty.embed_tokens is target.embed_tokens and empty.fc.weight.requires_grad
    with built_empty():
        own = type(head)(head.config, target.embed_tokens, own_embedding=True)
    with pytest.raises(HeadLoadError, match="missing embed_tokens.weight"):  # optional, yet nothing set it
        load_strict(own, dict(state), tmp_path, optional=("embed_tokens.weight",), assign=True)


def test_sharded_weights_round_trip_and_a_missing_shard_is_named(target, tmp_path):
    import json

    head = random_head("eagle3", target, seed=2)
    save_head(head, tmp_path / "head", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "head" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "head" / "model.safetensors").exists()
    torch.testing.assert_close(outputs(load_head(str(tmp_path / "head"), target), target), outputs(head, target))
    (tmp_path / "head" / shards[-1]).unlink()
    with pytest.raises(HeadLoadError, match=shards[-1]):
        load_head(str(tmp_path / "head"), target)
    save_head(head, tmp_path / "head")  # one file again: the shards and the index go
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json", "model.safetensors"]


def test_pickle_checkpoint_with_its_own_embedding_loads(target, tmp_path):
    head = random_head("eagle", target, seed=2)
    state = {k: v.clone() for k, v in head.state_dict().items()}  # includes embed_tokens.weight
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1  # the head's own copy
    folder = tmp_path / "head"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(head.config.to_dict()))
    loaded = load_head(str(folder), target)
    assert loaded.owns_embedding
    assert torch.equal(loaded.embed_tokens.weight, state["embed_tokens.weight"])
    assert not torch.equal(target.embed_tokens.weight, loaded.embed_tokens.weight)  # the target's is untouched


def test_eagle3_community_layer_names_and_equal_vocabularies(target, tmp_path):
    head = random_head("eagle3", target, seed=3, draft_vocab_size=288)  # equal vocabularies: no d2t/t2d
    folder = tmp_path / "head"
    save_head(head, folder)
    state = load_file(folder / "model.safetensors")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    renamed["d2t"] = torch.zeros(288, dtype=torch.long)  # an all-zero map, as some checkpoints carry
    save_file(renamed, folder / "model.safetensors")
    loaded = load_head(str(folder), target)
    assert loaded.draft_to_target is None
    torch.testing.assert_close(outputs(loaded, target), outputs(head, target))


def broken(target, tmp_path, kind="eagle", edit_state=None, edit_config=None):
    head = random_head(kind, target, seed=4)
    folder = tmp_path / "head"
    save_head(head, folder)
    if edit_state:
        state = load_file(folder / "model.safetensors")
        edit_state(state)
        save_file(state, folder / "model.safetensors")
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("kind,edit_state,edit_config,message", [
    ("eagle", lambda s: s.pop("layers.0.mlp.up_proj.weight"), None, r"missing key layers\.0\.mlp\.up_proj\.weight"),
    ("eagle", lambda s: s.update(extra=torch.zeros(2)), None, r"unexpected key extra"),
    ("eagle", lambda s: s.update({"fc.weight": torch.zeros(64, 100)}), None,
     r"fc\.weight has shape \[64, 100\], expected \[64, 128\]"),
    ("eagle", None, lambda c: c.update(vocab_size=300), r"vocab_size is 300 but the target's is 288"),
    ("eagle", None, lambda c: c.update(bias=False), r"unexpected key fc\.bias"),
    ("eagle3", lambda s: s.pop("lm_head.weight"), None, r"missing key lm_head\.weight"),
    ("eagle3", lambda s: s.update(d2t=s["d2t"] + 1000), None, r"d2t maps draft ids beyond the target vocabulary"),
    ("eagle3", None, lambda c: c.update(target_hidden_size=32), r"expects target hidden size 32 but the target's is 64"),
    ("jakiro", lambda s: s.update({"layers.0.mlp_moe.gate.weight": torch.zeros(2, 64)}), None,
     r"layers\.0\.mlp_moe\.gate\.weight has shape \[2, 64\], expected \[4, 64\]"),
    ("jakiro", lambda s: s.pop("layers.0.mlp_moe.experts.1.down_proj.weight"), None,
     r"missing key layers\.0\.mlp_moe\.experts\.1\.down_proj\.weight"),
    ("jakiro", None, lambda c: c.update(num_local_experts=4), r"Jakiro heads with 4 experts are not supported"),
])
def test_every_mismatch_is_named(kind, edit_state, edit_config, message, target, tmp_path):
    with pytest.raises(HeadLoadError, match=message):
        load_head(broken(target, tmp_path, kind, edit_state, edit_config), target)


def test_hidden_size_mismatch_names_both_numbers(target, tmp_path):
    folder = broken(target, tmp_path, "eagle", None, lambda c: c.update(hidden_size=32, num_attention_heads=4))
    with pytest.raises(HeadLoadError, match=r"expects target hidden size 32 but the target's is 64"):
        load_head(folder, target)


def test_unknown_format_lists_the_known_ones(target, tmp_path):
    folder = tmp_path / "head"
    folder.mkdir()
    save_file({"medusa_head.0.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    with pytest.raises(HeadLoadError, match=r"unrecognised draft head format; known formats: EAGLE-1/2 .*EAGLE-3"):
        load_head(str(folder), target)


def test_kind_mismatch_and_missing_files(target, tmp_path):
    folder = broken(target, tmp_path)
    with pytest.raises(HeadLoadError, match="is a EAGLE-1/2 head, not EAGLE-3"):
        load_head(folder, target, kind="eagle3")
    with pytest.raises(HeadLoadError, match="is a EAGLE-1/2 head, not Jakiro"):
        load_head(folder, target, kind="jakiro")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadLoadError, match="no config.json"):
        load_head(str(tmp_path / "empty"), target)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(HeadLoadError, match="no model.safetensors, model.safetensors.index.json or pytorch_model.bin"):
        load_head(str(tmp_path / "empty"), target)


def test_a_head_name_that_is_no_folder_is_fetched_from_the_hub(target):
    from specchat.sources import DraftHeadError, load_head as load_named_head

    with pytest.raises(DraftHeadError, match="cannot reach the Hugging Face hub"):
        load_named_head("someone/no-such-head", target)


class Payload:
    """Stands for arbitrary code a pickle could run on load."""


def test_pickles_are_loaded_with_weights_only(target, tmp_path):
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(random_head("eagle", target).config.to_dict()))
    torch.save({"fc.weight": torch.zeros(1), "payload": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(HeadLoadError, match="weights_only=True"):
        load_head(str(folder), target)


def test_each_architecture_declares_its_interface():
    """What `drafters/__init__.py` promises of each architecture module, declared and consistent."""
    import drafters
    from drafters import FORMATS, DraftHead

    for kind, module in FORMATS.items():
        assert module.KIND == kind and module.HEAD.kind == kind and issubclass(module.HEAD, DraftHead)
        assert module.HEAD.config_class is module.CONFIG
        assert isinstance(module.NAME, str) and isinstance(module.KEYS, str) and isinstance(module.KEY_MAP, dict)
        assert set(module.LAYOUTS) <= set(drafters.LAYOUTS) and callable(module.matches) and callable(module.load)
