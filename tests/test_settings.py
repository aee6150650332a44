"""Profiles: lookup, strict schema, and precedence (flags > environment > profile > defaults)."""

import pytest

from specchat import embedded, settings
from specchat.methods import QWEN_05B, QWEN_15B, drafted_for_model, effective_draft
from specchat.settings import ProfileError, resolve


def write_profile(tmp_path, text, name="mine.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_default_profile_is_the_embedded_model():
    resolved, name = resolve({})
    assert name == "default" and resolved.model == "qwen2.5-coder-0.5b-instruct"


def test_profile_values_then_overrides(tmp_path):
    path = write_profile(tmp_path, '[generation]\ntemperature = 1\ntop_k = 5\n[method]\nname = "vanilla"\n')
    resolved, _ = resolve({"top_k": 9, "seed": None}, path)
    assert resolved.temperature == 1.0 and isinstance(resolved.temperature, float)
    assert resolved.top_k == 9  # the override wins
    assert resolved.seed is None  # unset everywhere: the default


def test_user_profiles_shadow_shipped_ones(tmp_path):
    folder = settings.user_profile_dir()
    folder.mkdir(parents=True)
    (folder / "default.toml").write_text('[generation]\nmax_new_tokens = 7\n')
    assert resolve({})[0].max_new_tokens == 7


@pytest.mark.parametrize("text,message", [
    ("[generation]\ntemprature = 1\n", r"unknown key generation\.temprature"),
    ("[sampling]\nx = 1\n", r"unknown section \[sampling\]"),
    ('[generation]\ntop_k = "many"\n', r"generation\.top_k must be int, got str"),
    ('[method]\nname = "medusa"\n', r"method\.name must be one of"),
    ("[generation\n", r"not valid TOML"),
])
def test_bad_profiles_name_file_key_and_expectation(tmp_path, text, message):
    path = write_profile(tmp_path, text)
    with pytest.raises(ProfileError, match=message) as error:
        resolve({}, path)
    assert "mine.toml" in str(error.value)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ProfileError, match="known: .*default"):
        resolve({}, "nonexistent")


def test_a_model_without_the_profiles_draft_drafts_with_what_it_has(monkeypatch):
    """--model alone, where the default profile's head was not trained for it: the smaller embedded
    model that shares its tokenizer drafts where it is installed (the profile's lookup and pace kept),
    else prompt lookup alone; a method or draft the user gave is never replaced."""
    given = {"model": QWEN_15B}
    chosen, _ = resolve(given, None)
    monkeypatch.setattr(embedded, "installed", lambda name: name == QWEN_05B)
    drafted, note = drafted_for_model(chosen, given)
    assert (drafted.method, drafted.lookup, drafted.plain_when_faster) == ("sps", True, True)
    assert note.startswith(f"no deagle draft for {QWEN_15B}: {QWEN_05B} drafts for it (sps;")
    monkeypatch.setattr(embedded, "installed", lambda name: False)
    drafted, note = drafted_for_model(chosen, given)
    assert drafted.method == "pld" and "prompt lookup alone (pld;" in note
    assert drafted_for_model(resolve({**given, "method": "pld"}, None)[0], {**given, "method": "pld"})[1] is None


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen/qwen2.5-coder-0.5b-instruct",
                                   "/home/me/.cache/huggingface/hub/models--Qwen--Qwen2.5-Coder-0.5B-Instruct/"
                                   "snapshots/0eb",
                                   "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                                   "/hf/models--Qwen--Qwen2.5-Coder-0.5B-Instruct-GGUF/snapshots/1/qwen2.5-coder-0.5b-"
                                   "instruct-q4_k_m.gguf"])
def test_the_published_model_the_embedded_one_quantizes_drafts_with_its_bundled_head(model):
    """--model naming the embedded model's published original (its hub id, its publisher's GGUF
    repository, a snapshot of either in the hub's cache) keeps the profile's method and the head
    trained for it, where any other model would fall back to what it has (prompt lookup here)."""
    given = {"model": model}
    chosen, _ = resolve(given, None)
    drafted, note = drafted_for_model(chosen, given)
    assert (drafted.method, note) == ("deagle", None)
    assert effective_draft(drafted) == "qwen2.5-coder-0.5b-eagle3"
    assert embedded.embedded_name(model) == QWEN_05B


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B", "./my-finetune",
                                   "/hf/models--me--Qwen2.5-Coder-0.5B-Instruct/snapshots/1"])
def test_another_model_of_the_same_size_does_not_take_the_bundled_head(model, monkeypatch):
    monkeypatch.setattr(embedded, "installed", lambda name: False)
    given = {"model": model}
    drafted, note = drafted_for_model(resolve(given, None)[0], given)
    assert embedded.embedded_name(model) is None
    assert drafted.method == "pld" and note.startswith(f"no deagle draft for {model}:")
