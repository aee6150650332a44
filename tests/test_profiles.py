"""Profiles from the user's side: the shipped ones, `specchat profiles list|show`, and precedence
(command line > SPECCHAT_* environment > profile > defaults) all the way into a real run."""

import json

import pytest

from specchat import settings
from specchat.settings import read_profile, shipped_profiles
from conftest import invoke


def origins(show_output: str) -> dict[str, tuple[str, str]]:
    """`profiles show` rows as {section.key: (value, origin)}."""
    rows = {}
    for line in show_output.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and "." in parts[0] and not line.startswith(("profile", "description")):
            rows[parts[0]] = (parts[1], parts[2])
    return rows


def test_every_shipped_profile_is_valid_and_described():
    profiles = shipped_profiles()
    assert {"default", "qwen2.5-coder-1.5b-sps", "qwen2.5-coder-0.5b-pld", "llama3.1-8b-eagle3",
            "vicuna-7b-eagle"} <= set(profiles)
    for name, source in profiles.items():
        values, meta = read_profile(source)
        assert meta.get("description"), name
        assert values.get("model"), name


def test_the_hub_pairs_use_the_papers_tree_settings():
    llama, _ = read_profile(shipped_profiles()["llama3.1-8b-eagle3"])
    assert llama["draft"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and llama["method"] == "eagle2"
    assert (llama["total_tokens"], llama["depth"], llama["tree_top_k"]) == (60, 8, 10)
    vicuna, _ = read_profile(shipped_profiles()["vicuna-7b-eagle"])
    assert (vicuna["model"], vicuna["draft"]) == ("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3")
    sps, _ = read_profile(shipped_profiles()["qwen2.5-coder-1.5b-sps"])
    assert (sps["model"], sps["draft"], sps["method"]) == ("qwen2.5-coder-1.5b-instruct",
                                                           "qwen2.5-coder-0.5b-instruct", "sps")


def test_show_names_where_each_value_comes_from(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "mine.toml"
    profile.write_text('description = "mine"\n[generation]\ntemperature = 0.3\ntop_p = 0.9\ntop_k = 7\n')
    monkeypatch.setenv("SPECCHAT_TOP_P", "0.8")
    monkeypatch.setenv("SPECCHAT_TOP_K", "8")
    code, out, _ = invoke(["profiles", "show", str(profile), "--top-k", "9"], capsys)
    assert code == 0 and "description  mine" in out
    rows = origins(out)
    assert rows["generation.temperature"] == ("0.3", "profile")
    assert rows["generation.top_p"] == ("0.8", "environment (SPECCHAT_TOP_P)")
    assert rows["generation.top_k"] == ("9", "command line (--top-k)")
    assert rows["generation.max_new_tokens"] == ("512", "default")


def test_precedence_reaches_a_real_run(qwen_dir, tmp_path, capsys, monkeypatch):
    profile = tmp_path / "tiny.toml"
    profile.write_text(f'[model]\npath = "{qwen_dir}"\ndtype = "float32"\ndevice = "cpu"\n'
                       "[generation]\nmax_new_tokens = 5\n")
    monkeypatch.setenv("SPECCHAT_PROFILE", str(profile))

    def new_tokens(*flags):
        code, out, err = invoke(["run", "-", *flags], capsys, monkeypatch, stdin="hello\n")
        assert code == 0, err
        return json.loads(out)["turns"][0]["new_tokens"]

    assert new_tokens() == 5  # the profile (chosen through SPECCHAT_PROFILE)
    monkeypatch.setenv("SPECCHAT_MAX_NEW_TOKENS", "3")
    assert new_tokens() == 3  # the environment beats the profile
    assert new_tokens("--max-new-tokens", "2") == 2  # the command line beats both


def test_list_shows_user_profiles_first_and_what_they_hide(capsys):
    folder = settings.user_profile_dir()
    folder.mkdir(parents=True)
    (folder / "default.toml").write_text('[method]\nname = "pld"\n')
    (folder / "broken.toml").write_text('[generation]\ntemprature = 1\n')
    code, out, _ = invoke(["profiles", "list"], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["NAME", "METHOD", "MODEL"]
    assert lines[1].startswith("broken") and "broken:" in lines[1] and "unknown key generation.temprature" in lines[1]
    assert lines[2].split()[:2] == ["default", "pld"]
    assert any(line.startswith("default") and "hidden by the user's" in line for line in lines[3:])
    assert any(line.startswith("llama3.1-8b-eagle3") for line in lines)


@pytest.mark.parametrize("args,message", [
    (["profiles", "show", "nope"], "no profile named 'nope'"),
    (["profiles", "show", "default", "--profile", "default"], "give the profile as NAME or as --profile"),
    (["profiles", "show", "{bad}"], "bad.toml: unknown section [sampling]"),
])
def test_show_errors_are_one_line_usage_errors(args, message, tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("[sampling]\ntemperature = 1\n")
    args = [arg.replace("{bad}", str(tmp_path / "bad.toml")) for arg in args]
    code, _, err = invoke(args, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_bad_environment_value_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("SPECCHAT_TEMPERATURE", "warm")
    code, _, err = invoke(["profiles", "show"], capsys)
    assert code == 2 and "'warm' is not a valid float" in err
