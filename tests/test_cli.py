"""The command line end to end on a tiny model: records, exit codes and one-line errors."""

import json
import sys

import pytest

from conftest import invoke, load_tiny_target, random_head, tiny
from specchat.methods import METHODS


def test_run_writes_one_record_per_line_with_all_fields(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"]}) + "\n"
                       + json.dumps({"prompt": "c"}) + "\n")
    code, out, err = invoke(["run", str(prompts), *tiny(qwen_dir, "--method", "vanilla")], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == [81, 2]
    first = records[0]
    assert first["category"] == "writing" and first["method"] == "vanilla" and first["model"] == str(qwen_dir)
    assert len(first["turns"]) == 2
    for turn in first["turns"]:
        assert {"prompt", "response", "new_tokens", "seconds", "tokens_per_s", "tau", "target_forwards",
                "prefill_seconds"} <= set(turn)
        assert turn["tau"] == 1.0 and turn["new_tokens"] == turn["target_forwards"]


def test_run_output_file_and_text_input(qwen_dir, tmp_path, capsys):
    prompts, output = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("one\ntwo\n")
    code, _, _ = invoke(["run", str(prompts), "-o", str(output), *tiny(qwen_dir)], capsys)
    assert code == 0 and len(output.read_text().splitlines()) == 2


def test_greedy_run_is_deterministic(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    outputs = [invoke(["run", str(prompts), *tiny(qwen_dir)], capsys)[1] for _ in range(2)]
    assert json.loads(outputs[0])["turns"][0]["response"] == json.loads(outputs[1])["turns"][0]["response"]


def test_piped_chat_answers_on_stdout_and_reports_on_stderr(qwen_dir, capsys, monkeypatch):
    code, out, err = invoke(["chat", *tiny(qwen_dir)], capsys, stdin="hi\n", monkeypatch=monkeypatch)
    assert code == 0 and out.endswith("\n")
    assert "tok/s" in err and "τ " in err
    # The default profile's method drafts with a head bundled for its own model; this one has none,
    # so prompt lookup drafts alone (it needs no draft).
    assert "draft for " + str(qwen_dir) + ": prompt lookup alone (pld;" in err


def test_the_collector_is_paused_for_a_block_and_put_back_as_it_was():
    import gc

    from specchat.cli import collector_paused

    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collector_paused():
            assert not gc.isenabled()
            raise KeyError("an import failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # (it was off before: left off)
    finally:
        gc.enable()


def test_the_collector_runs_while_a_chat_loads_its_model(qwen_dir, capsys, monkeypatch):
    """Only the imports run with the collector paused (`cli.collector_paused`): loading a model, a first
    start's conversions among it, leaves cyclic garbage that must be freed as it goes."""
    import gc

    from specchat import app

    opening = app.open_chat
    seen = []

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return opening(*args, **kwargs)

    monkeypatch.setattr(app, "open_chat", recording)
    assert invoke(["chat", *tiny(qwen_dir)], capsys, stdin="hi\n", monkeypatch=monkeypatch)[0] == 0
    assert invoke(["chat", "--model", "/no/such/model"], capsys, stdin="hi\n", monkeypatch=monkeypatch)[0] == 1
    assert seen == [True, True] and gc.isenabled()


@pytest.mark.parametrize("args,code,message", [
    (["run", "-", "--model", "/no/such/model"], 1, "no model named '/no/such/model'"),
    (["run", "-", "--model", "README.md"], 1, "is a file but not a model"),
    (["run", "-", "--model", "/no/bundled/head", "--method", "eagle2"], 2, "--method eagle2 needs --draft: a draft head"),
    (["run", "-", "--model", "/no/bundled/head", "--method", "sps"], 2, "--method sps needs --draft: a small draft model"),
    (["run", "-", "--temperature", "-1"], 2, "temperature must be >= 0"),
    (["run", "-", "--profile", "nope"], 2, "no profile named 'nope'"),
])
def test_bad_invocations_fail_in_one_line(args, code, message, capsys, monkeypatch, tmp_path):
    (tmp_path / "README.md").write_text("# not a model")
    monkeypatch.chdir(tmp_path)
    got, out, err = invoke(args, capsys, stdin="question\n", monkeypatch=monkeypatch)
    assert got == code
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args,shows", [([], "Commands:"), (["data"], "Commands:")])
def test_a_group_without_its_command_shows_its_help_not_an_error(args, shows, capsys):
    code, out, err = invoke(args, capsys)
    assert code in (0, 2) and shows in out + err and "error" not in err and "(see --help)" not in err


@pytest.mark.parametrize("variable,value,flag", [("SPECCHAT_TEMPERATURE", "warm", "--temperature"),
                                                 ("SPECCHAT_METHOD", "fastest", "--method")])
def test_a_bad_environment_value_names_the_variable(variable, value, flag, capsys, monkeypatch):
    monkeypatch.setenv(variable, value)
    code, _, err = invoke(["run", "-"], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and f"environment variable {variable}: {value!r}" in err and flag not in err
    monkeypatch.delenv(variable)
    code, _, err = invoke(["run", "-", flag, value], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and f"'{flag}'" in err and variable not in err


def test_a_head_bundled_for_the_target_is_used_when_no_draft_is_given(qwen_dir, tmp_path, capsys, monkeypatch):
    from drafters import save_head

    save_head(random_head("eagle3", load_tiny_target(qwen_dir)), tmp_path / "tiny-eagle3")
    monkeypatch.setattr("specchat.heads.bundled_heads", lambda: {"tiny-eagle3": tmp_path / "tiny-eagle3"})
    monkeypatch.setitem(METHODS["eagle2"].bundled, str(qwen_dir), "tiny-eagle3")
    code, out, err = invoke(["run", "-", *tiny(qwen_dir), "--method", "eagle2"], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 0, err
    record = json.loads(out)
    assert record["draft"] == "tiny-eagle3" and record["method"] == "eagle2"
    assert record["turns"][0]["draft_seconds"] > 0  # the head really drafted
    code, _, err = invoke(["run", "-", *tiny(qwen_dir), "--method", "jakiro"], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and "--method jakiro needs --draft" in err  # no head bundled for jakiro


def test_a_missing_head_is_a_runtime_error(qwen_dir, capsys, monkeypatch):
    args = ["run", "-", *tiny(qwen_dir), "--method", "eagle2", "--draft", "/no/such/head"]
    code, _, err = invoke(args, capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 1 and "no draft head '/no/such/head'" in err and len(err.strip().splitlines()) == 1


def test_broken_and_empty_prompts_are_usage_errors(qwen_dir, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    code, out, err = invoke(["run", str(bad), *tiny(qwen_dir)], capsys)
    assert code == 2 and "bad.jsonl:2: broken JSON" in err and out == ""
    code, _, err = invoke(["chat", *tiny(qwen_dir)], capsys, stdin="  \n", monkeypatch=monkeypatch)
    assert code == 2 and "empty prompt" in err


def test_too_long_prompt_fails_but_keeps_the_other_records(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 2000}) + "\n"
                       + json.dumps({"prompt": "also short"}) + "\n")
    code, out, err = invoke(["run", str(prompts), *tiny(qwen_dir)], capsys)
    assert code == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3] and "error" in records[1] and records[1]["turns"] == []
    assert "p.jsonl:2:" in err and "context holds 512" in err


def test_speculative_run_records_and_trace(qwen_dir, tmp_path, capsys):
    from conftest import load_tiny_target, random_head
    from drafters import save_head

    save_head(random_head("eagle3", load_tiny_target(qwen_dir)), tmp_path / "head")
    prompts, trace = tmp_path / "q.jsonl", tmp_path / "trace.jsonl"
    prompts.write_text(json.dumps({"question_id": 7, "turns": ["a", "b"]}) + "\n")
    base = ["run", str(prompts), *tiny(qwen_dir)]
    plain = json.loads(invoke(base, capsys)[1])
    # (the default profile's plain_when_faster would soon stop a random head drafting: its cycles never pay)
    code, out, err = invoke([*base, "--method", "eagle2", "--draft", str(tmp_path / "head"), "--trace", str(trace),
                             "--no-plain-when-faster"], capsys)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["method"] == "eagle2" and spec["draft"] == str(tmp_path / "head")
    for plain_turn, turn in zip(plain["turns"], spec["turns"]):
        assert turn["response"] == plain_turn["response"]  # lossless
        assert sum(turn["accept_lengths"]) + 1 == turn["new_tokens"]  # cycles plus the prefill token
        assert turn["target_forwards"] == len(turn["accept_lengths"]) + 1
        assert 0 <= turn["acceptance_rate"] <= 1 and turn["draft_seconds"] > 0 and turn["verify_seconds"] > 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == sum(len(t["accept_lengths"]) for t in spec["turns"])
    first = lines[0]
    assert (first["id"], first["turn"], first["cycle"]) == (7, 0, 0) and "context_ids" in first
    assert "context_ids" not in lines[1]
    assert set(first) >= {"root", "tokens", "parents", "probs", "depths", "accepted", "bonus"}
    # each drafted cycle says what its tree was chosen from: the tree is the candidates it names, in its order
    offered = [line for line in lines if line["tokens"]]
    assert offered and all("candidates" in line for line in offered)
    for line in offered:
        candidates = line["candidates"]
        verified = candidates["verified"]
        assert [candidates["tokens"][i] for i in verified] == line["tokens"]
        assert [candidates["parents"][i] for i in verified] == [-1 if p < 0 else verified[p] for p in line["parents"]]
        assert len(candidates["tokens"]) >= len(verified) and len(candidates.get("values", verified)) == len(candidates["tokens"])
    assert all("values" in line["candidates"] for line in offered)  # chosen at this machine's verify cost


def test_verbose_says_when_every_start_compiles_specchat(tmp_path, monkeypatch):
    """Under PYTHONDONTWRITEBYTECODE (many container images set it) an editable install never gets
    compiled modules: each start compiled them again, 0.08-0.22 s of a 1.6 s warm start, unsaid."""
    import importlib.util

    from specchat.cli import compiles_at_each_start

    kept = tmp_path / "__init__.cpython.pyc"
    monkeypatch.setattr(importlib.util, "cache_from_source", lambda path: str(kept))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert "PYTHONDONTWRITEBYTECODE" in compiles_at_each_start()
    kept.touch()  # compiled copies kept from an earlier start (or a wheel's install)
    assert compiles_at_each_start() is None
    kept.unlink()
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes them on this start
    assert compiles_at_each_start() is None
