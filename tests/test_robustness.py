"""Whatever a user feeds it: one clear line and the right exit status, per-record failures that let
the batch go on, nothing silently lost, and input readers that never raise anything else."""

import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import TINY_VOCAB, interrupt_the_prompt_with, invoke, load_tiny_target, random_head, tiny
from drafters import HeadLoadError, load_head, save_head
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.inputs import InputError, read_prompts


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- the input readers ---------------------------------------------------------------------------


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "b \\ud800"}\n', r"x\.jsonl:1: 'prompt' holds '\\ud800', a lone surrogate"),
    (b'{"prompt": "ok", "system": 3}\n', r"x\.jsonl:1: 'system' must be a string, got int"),
    (b'{"prompt": "ok", "id": [1]}\n', r"x\.jsonl:1: an id must be a string or a number"),
    (b'{"prompt": "ok", "id": NaN}\n', r"x\.jsonl:1: broken JSON \(NaN is not a JSON value\)"),
    (b'{"prompt": "caf\xe9"}\n', r"x\.jsonl: not UTF-8 text"),
])
def test_a_record_the_file_gets_wrong_is_named_before_anything_runs(tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_prompts([str(path)])


def test_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path, monkeypatch):
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_bytes("\ufeff".encode() + json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False).encode() + b"\r\n")
    assert read_prompts([str(jsonl)])[0].turns == ["a\u2028b"]
    text = tmp_path / "x.txt"
    text.write_bytes("\ufeffone\u2028still one\x85and one\r\ntwo\n".encode())
    assert [r.turns[0] for r in read_prompts([str(text)])] == ["one\u2028still one\x85and one", "two"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\ufeff{\"prompt\": \"j\"}\n".encode())))
    assert read_prompts(["-"])[0].turns == ["j"]  # answered as JSON, not as the text of a JSON line


def test_invalid_utf8_and_a_closed_stdin_are_usage_errors(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n")))
    with pytest.raises(InputError, match="<stdin>: not UTF-8 text"):
        read_prompts(["-"])
    monkeypatch.setattr("sys.stdin", None)
    with pytest.raises(InputError, match="standard input is closed"):
        read_prompts(["-"])


def random_json(rng: random.Random, depth: int = 0):
    choices = [lambda: rng.choice([None, True, False]), lambda: rng.randint(-5, 10**20), lambda: rng.random() * 1e6,
               lambda: "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x10FFFF)])) for _ in range(rng.randint(0, 8)))]
    if depth < 3:
        keys = ["prompt", "turns", "messages", "role", "content", "system", "id", "category", "question_id", "x"]
        choices += [lambda: [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    lambda: {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}]
    return rng.choice(choices)()


def test_fuzz_the_readers_give_records_or_one_clear_error(tmp_path, monkeypatch):
    """A few hundred random byte strings and JSON values: a valid record or an InputError, nothing else."""
    rng = random.Random(0)
    outcomes = {"records": 0, "errors": 0}
    for case in range(400):
        if case % 2:
            data = bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 60)))
        else:
            data = json.dumps(random_json(rng), ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        for suffix in ("jsonl", "txt"):
            path = tmp_path / f"f.{suffix}"
            path.write_bytes(data)
            try:
                records = read_prompts([str(path)])
            except InputError as error:
                assert str(error).startswith(str(path)) and "\n" not in str(error)
                outcomes["errors"] += 1
                continue
            for record in records:
                assert record.turns and all(isinstance(t, str) and t.strip() for t in record.turns)
                assert isinstance(record.id, (str, int, float)) and not isinstance(record.id, bool)
                json.dumps({"id": record.id, "turns": record.turns, "system": record.system}, allow_nan=False)
                for text in [*record.turns, record.system or "", *(m["content"] for m in record.history)]:
                    text.encode("utf-8")  # every string is real text
            outcomes["records"] += 1
    assert outcomes["records"] > 50 and outcomes["errors"] > 50


# --- run: per-record failures, output files --------------------------------------------------------


def test_a_record_that_fails_is_recorded_and_the_batch_goes_on(qwen_dir, tmp_path, capsys):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['content'] == 'refuse' %}{{ raise_exception('no refusing') }}"
                        "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "first"}, {"prompt": "refuse"}, {"turns": ["fine", "x" * 2000]}, {"prompt": "last"}]) + "\n")
    code, out, err = invoke(["run", str(prompts), *tiny(qwen_dir), "--chat-template", str(template)], capsys)
    assert code == 1, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3, 4]
    assert "error" not in records[0] and "error" not in records[3] and records[3]["turns"][0]["response"]
    assert records[1]["error"].startswith(f"{prompts}:2: ") and "no refusing" in records[1]["error"]
    assert records[1]["turns"] == []
    assert len(records[2]["turns"]) == 1 and "turn 2: " in records[2]["error"] and "context holds 512" in records[2]["error"]
    assert f"{prompts}:2:" in err and f"{prompts}:3:" in err and "2 of 4 prompt records failed" in err
    assert "Traceback" not in err


def test_a_huge_prompt_is_refused_by_its_size_before_it_is_tokenized(qwen_dir, tmp_path, capsys, monkeypatch):
    """A 50 MB line took 173 s and 12.5 GB to be found longer than the context: it was tokenized first."""
    from specchat.chat import ChatFormat

    tokenized = []
    prompt_ids = ChatFormat.prompt_ids

    def spy(self, conversation):
        tokenized.append(sum(len(m["content"]) for m in conversation.as_messages()))
        return prompt_ids(self, conversation)

    monkeypatch.setattr(ChatFormat, "prompt_ids", spy)
    huge = "word " * 1_000_000  # 5 MB; the tiny model's context is 512 tokens
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [{"prompt": "short"}, {"prompt": huge},
                                                        {"turns": ["fine", huge]}]) + "\n")
    code, out, err = invoke(["run", str(prompts), *tiny(qwen_dir)], capsys)
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [r["id"] for r in records] == [1, 2, 3] and "error" not in records[0]
    assert records[1]["error"].startswith(f"{prompts}:2: the prompt is 5,000,000 bytes, more than the model's "
                                          "context of 512 tokens can hold") and records[1]["turns"] == []
    assert f"{prompts}:3: turn 2: the prompt is 5,000,0" in records[2]["error"] and len(records[2]["turns"]) == 1
    assert f"{prompts}:2: the prompt is" in err and "2 of 3 prompt records failed" in err
    assert tokenized and max(tokenized) < 10_000  # the huge text never reached the tokenizer
    code, out, err = invoke(["chat", *tiny(qwen_dir, "--method", "vanilla")], capsys, monkeypatch, stdin=huge)
    assert code == 1 and "the prompt is 5,000,000 bytes" in err and one_line(err) and out == ""
    assert max(tokenized) < 10_000


def test_the_size_bound_never_refuses_a_prompt_that_fits(tokenizer):
    """B bytes make at least B / max_token_bytes tokens: the densest text a tokenizer has still passes."""
    from specchat.chat import ChatFormat, Conversation
    from specchat.errors import ContextLengthError

    chat_format = ChatFormat(tokenizer)
    special = "<|endoftext|>" * 60  # the most bytes per token this tokenizer has (13 bytes, one token each)
    conversation = Conversation(messages=[{"role": "user", "content": special}])
    chat_format.check_size(conversation.as_messages(), len(chat_format.prompt_ids(conversation)))
    with pytest.raises(ContextLengthError, match="the prompt is 780 bytes"):
        chat_format.check_size(conversation.as_messages(), 780 // chat_format.max_token_bytes - 1)


@pytest.mark.parametrize("output,trace,message", [
    ("same.jsonl", "same.jsonl", "--trace same.jsonl is also --output"),
    ("p.jsonl", None, "--output p.jsonl is also an input"),
    ("missing/out.jsonl", None, "does not exist"),
])
def test_outputs_that_would_lose_data_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch,
                                                                          output, trace, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "keep me"}\n')
    args = ["run", "p.jsonl", "-o", output, "--model", "/no/such/model"] + (["--trace", trace] if trace else [])
    code, _, err = invoke(args, capsys)
    assert code == 2 and message in err and one_line(err)
    assert (tmp_path / "p.jsonl").read_text() == '{"prompt": "keep me"}\n'


@pytest.mark.parametrize("link", [os.link, os.symlink], ids=["hard link", "symbolic link"])
@pytest.mark.parametrize("option", ["-o", "--trace"])
def test_an_output_that_is_the_input_through_a_link_is_refused(tmp_path, capsys, monkeypatch, link, option):
    """`ln in.txt out.jsonl; specchat run in.txt -o out.jsonl` overwrote the prompts: paths differ, the file is one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("Say hi\n")
    link("in.txt", "out.jsonl")
    code, _, err = invoke(["run", "in.txt", option, "out.jsonl", "--model", "/no/such/model"], capsys)
    assert code == 2 and "out.jsonl is also the input in.txt" in err and one_line(err), err
    assert (tmp_path / "in.txt").read_text() == "Say hi\n"


def test_two_outputs_on_one_file_and_an_output_that_is_standard_input_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out.jsonl").write_text("keep\n")
    os.link("out.jsonl", "trace.jsonl")
    code, _, err = invoke(["run", "-", "-o", "out.jsonl", "--trace", "trace.jsonl", "--model", "/no/such/model"],
                          capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and "--trace trace.jsonl is also --output" in err and one_line(err)
    (tmp_path / "in.txt").write_text("Say hi\n")
    with open(tmp_path / "in.txt") as stdin:  # `specchat run - -o in.txt < in.txt`
        monkeypatch.setattr("sys.stdin", stdin)
        code, _, err = invoke(["run", "-", "-o", "in.txt", "--model", "/no/such/model"], capsys)
    assert code == 2 and "--output in.txt is also standard input" in err and one_line(err)
    assert (tmp_path / "in.txt").read_text() == "Say hi\n" and (tmp_path / "out.jsonl").read_text() == "keep\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["-o", "/dev/full"], ["--trace", "/dev/full"], ["-o", "full.jsonl"],
                                  ["-o", "/dev/full", "--atomic"]])
def test_an_output_that_refuses_writes_fails_before_the_model_loads(tmp_path, capsys, monkeypatch, args):
    """`-o /dev/full` used to fail only once every answer was done."""
    monkeypatch.chdir(tmp_path)
    os.symlink("/dev/full", "full.jsonl")
    (tmp_path / "p.txt").write_text("Say hi\n")
    code, _, err = invoke(["run", "p.txt", *args, "--model", "/no/such/model"], capsys)  # a model would fail with 1
    assert code == 2 and f"{args[1]}: not writable (No space left on device)" in err and one_line(err), err
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # still the device


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_a_read_only_output_or_folder_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("Say hi\n")
    (tmp_path / "old.jsonl").write_text("old\n")
    (tmp_path / "old.jsonl").chmod(0o444)
    code, _, err = invoke(["run", "p.txt", "-o", "old.jsonl", "--model", "/no/such/model"], capsys)
    assert code == 2 and "old.jsonl: not writable (Permission denied)" in err and one_line(err)
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked").chmod(0o555)
    try:
        for args in (["-o", "locked/new.jsonl"], ["--trace", "locked/t.jsonl"]):
            code, _, err = invoke(["run", "p.txt", *args, "--model", "/no/such/model"], capsys)
            assert code == 2 and "not writable (Permission denied)" in err and one_line(err)
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert (tmp_path / "old.jsonl").read_text() == "old\n"


@pytest.mark.parametrize("atomic", [[], ["--atomic"]])
def test_probing_an_output_changes_nothing(tmp_path, capsys, monkeypatch, atomic):
    """The writability probe neither truncates an existing output nor leaves a file behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("Say hi\n")
    (tmp_path / "old.jsonl").write_text("old records\n")
    for output in ("old.jsonl", "new.jsonl"):
        code, _, err = invoke(["run", "p.txt", "-o", output, "--trace", "t.jsonl", *atomic, "--model",
                               "/no/such/model"], capsys)
        assert code == 1 and "/no/such/model" in err  # past the output checks, failing on the model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl", "p.txt"]
    assert (tmp_path / "old.jsonl").read_text() == "old records\n"


def test_bench_refuses_an_output_folder_holding_an_input_or_refusing_writes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "results.json").write_text('{"prompt": "keep me"}\n')
    os.link("results/results.json", "p.jsonl")  # the prompts, under another name, are where results.json goes
    code, _, err = invoke(["bench", "p.jsonl", "-o", "results", "--model", "/no/such/model"], capsys)
    assert code == 2 and "results.json there is also the input p.jsonl" in err and one_line(err), err
    assert (tmp_path / "p.jsonl").read_text() == '{"prompt": "keep me"}\n'
    (tmp_path / "q.jsonl").write_text('{"prompt": "x"}\n')
    if os.path.exists("/dev/full"):
        os.symlink("/dev/full", "results/results.csv")
        code, _, err = invoke(["bench", "q.jsonl", "-o", "results", "--model", "/no/such/model"], capsys)
        assert code == 2 and "results.csv: not writable (No space left on device)" in err and one_line(err), err
        code, _, err = invoke(["bench", "q.jsonl", "-o", "/dev/full", "--model", "/no/such/model"], capsys)
        assert code == 2 and "/dev/full: not a folder" in err and one_line(err), err
    code, _, err = invoke(["bench", "q.jsonl", "-o", "p.jsonl/sub", "--model", "/no/such/model"], capsys)
    assert code == 2 and "is not a folder" in err and one_line(err), err


def test_bench_output_files_are_the_ones_checked(tmp_path):
    from specchat.bench import measure
    from specchat.bench.run import OUTPUT_FILES

    results = [measure.TurnResult(method=method, question=1, category="c", turn=0, repeat=0, response="r", new_tokens=4,
                                seconds=1.0, target_forwards=2, draft_tokens=4, accepted_tokens=2,
                                cycles=[{"depths": [1, 2], "parents": [-1, 0], "probs": [0.5, 0.4], "accepted": [0],
                                         "stop_depth": 2}])
               for method in ("vanilla", "eagle2")]
    folder = tmp_path / "out"
    measure.write_outputs(folder, results, measure.summarize(results, greedy=True), {"vanilla": 1.0, "eagle2": 2.0}, {})
    assert {p.name for p in folder.iterdir()} <= set(OUTPUT_FILES)


def test_atomic_output_appears_whole_and_trace_lines_are_written_per_record(qwen_dir, tmp_path, capsys):
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    out.write_text("old\n")
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    code, _, err = invoke(["run", str(prompts), *tiny(qwen_dir), "--method", "pld", "-o", str(out), "--atomic",
                           "--trace", str(trace)], capsys)
    assert code == 0, err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".__atomic")]


def run_cli(args: list[str], redirect: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = " ".join([sys.executable, "-m", "specchat", *args]) + " " + redirect
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,redirect,message", [
    (["run"], "<&-", "standard input is closed"),
    (["run", "-", "--model", "/nope"], ">&- < /dev/null", "standard output is closed"),
    (["chat", "--model", "/nope"], "<&- 2>&2", "standard input is closed"),
    (["chat", "--model", "/nope"], ">&- < /dev/null", "standard output is closed"),
])
def test_closed_standard_streams_are_one_line_usage_errors(args, redirect, message):
    done = run_cli(args, redirect)
    assert done.returncode == 2 and message in done.stderr and one_line(done.stderr), done.stderr


def test_specchat_debug_takes_words(tmp_path):
    done = run_cli(["run", str(tmp_path / "p.csv")], "", env={"SPECCHAT_DEBUG": "0"})
    assert done.returncode == 2 and one_line(done.stderr)
    done = run_cli(["run", "-"], "< /dev/null", env={"SPECCHAT_DEBUG": "maybe"})
    assert done.returncode == 2 and "SPECCHAT_DEBUG" in done.stderr


# --- values, profiles and paths the user gave --------------------------------------------------------


@pytest.mark.parametrize("args,env,message", [
    (["--temperature", "nan"], {}, "temperature must be a finite number"),
    (["--temperature", "1e-45"], {}, "temperature must be 0 (greedy) or at least 1e-05"),
    (["--seed", str(2**64)], {}, "seed must be <= 18446744073709551615"),
    (["--total-tokens", "0"], {}, "total_tokens must be >= 2"),
    (["--depth", "100000"], {}, "depth must be <= 1024"),
    ([], {"SPECCHAT_MAX_NEW_TOKENS": "-1"}, "environment variable SPECCHAT_MAX_NEW_TOKENS"),
    (["--pld-min-ngram", "3", "--pld-max-ngram", "2"], {}, "pld_min_ngram (3) is above pld_max_ngram (2)"),
])
def test_bad_values_are_caught_before_the_model_loads(args, env, message, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = invoke(["run", "-", "--model", "/no/such/model", *args], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and message in err and one_line(err), err


def test_a_profile_with_a_bad_value_or_bytes_names_the_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "somedir.toml").mkdir()
    code, _, err = invoke(["run", "-", "--profile", str(tmp_path / "somedir.toml")], capsys, stdin="q\n",
                          monkeypatch=monkeypatch)
    assert code == 2 and "somedir.toml is a folder" in err
    profile = tmp_path / "p.toml"
    profile.write_text("[generation]\ntemperature = 1e-45\n")
    code, _, err = invoke(["run", "-", "--profile", str(profile)], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and f"{profile}: generation.temperature must be 0 (greedy)" in err
    profile.write_bytes(b"[generation]\nsystem = \"caf\xe9\"\n")
    code, _, err = invoke(["run", "-", "--profile", str(profile)], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and f"{profile}: not UTF-8 text" in err


def test_a_template_file_that_is_not_jinja_is_a_usage_error(tmp_path, capsys, monkeypatch):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }")
    code, _, err = invoke(["run", "-", "--model", "/no/such/model", "--chat-template", str(template)], capsys,
                          stdin="q\n", monkeypatch=monkeypatch)
    assert code == 2 and f"{template}:1: not a valid Jinja template" in err and one_line(err)


def test_a_relative_draft_typo_says_it_is_not_a_folder_here(qwen_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = invoke(["run", "-", *tiny(qwen_dir), "--method", "eagle2", "--draft", "heads/mine"], capsys,
                          stdin="q\n", monkeypatch=monkeypatch)
    assert code == 1 and "no such folder here" in err and one_line(err)


def test_a_tiny_fake_gguf_is_one_line(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    code, _, err = invoke(["run", "-", "--model", str(fake)], capsys, stdin="q\n", monkeypatch=monkeypatch)
    assert code == 1 and "cannot load GGUF file" in err and one_line(err.split("about a minute)...\n")[-1])


# --- heads ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(qwen_dir):
    return load_tiny_target(qwen_dir)


@pytest.mark.parametrize("break_it,message", [
    (lambda f: (f / "draft_vocab.safetensors").write_bytes((f / "draft_vocab.safetensors").read_bytes()[:40]),
     "draft_vocab.safetensors: cannot read"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json: expected a JSON object, got list"),
    (lambda f: (f / "config.json").write_text(json.dumps({**json.loads((f / "config.json").read_text()),
                                                          "num_attention_heads": 0})),
     "num_attention_heads must be a positive whole number"),
    (lambda f: ((f / "model.safetensors").unlink(), torch.save([torch.zeros(1)], f / "pytorch_model.bin")),
     "pytorch_model.bin: holds a list, not a state dict"),
])
def test_malformed_heads_are_named_in_one_line(tiny_target, tmp_path, break_it, message):
    folder = tmp_path / "head"
    head = random_head("eagle", tiny_target)
    head.restrict_vocab(torch.arange(0, TINY_VOCAB, 2))
    save_head(head, folder)
    break_it(folder)
    with pytest.raises(HeadLoadError, match=message) as caught:
        load_head(str(folder), tiny_target)
    assert "\n" not in str(caught.value)


def test_a_pickle_that_is_not_plain_tensors_is_one_line(tiny_target, tmp_path):
    folder = tmp_path / "head"
    save_head(random_head("eagle", tiny_target), folder)
    (folder / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(1), "x": threading.Lock}, folder / "pytorch_model.bin")
    with pytest.raises(HeadLoadError, match="weights_only=True") as caught:
        load_head(str(folder), tiny_target)
    assert "\n" not in str(caught.value)


def test_deagle_with_a_head_that_outputs_nan_still_answers_exactly(bigram_dir, layout):
    from specchat.decode.drafting.deagle import DeagleParams
    from specchat.decode.drafting import heads
    from specchat.decode.drafting.shapes import DeagleTree, DynamicTreeParams

    bigram = load_tiny_target(bigram_dir, layout=layout)
    head = random_head("eagle3", bigram)
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))
    settings = GenerationSettings(max_new_tokens=16)
    plain = [t for s in Engine(bigram).generate([258, 10, 20, 30], settings) for t in s.tokens]
    proposer = heads.for_target(head, bigram, DeagleTree(DynamicTreeParams(16, 5, 4), DeagleParams()))
    drafted = [t for s in Engine(bigram, proposer).generate([258, 10, 20, 30], settings) for t in s.tokens]
    assert drafted == plain


# --- SIGTERM: handled like Ctrl-C ---------------------------------------------------------------------------


@pytest.fixture
def start_specchat():
    """`start(args)`: specchat in a child process, killed at the end of the test if it is still running
    (a test that fails before its signal must not leave a run of 5,000 prompts behind)."""
    started = []

    def start(args: list[str]) -> subprocess.Popen:
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        process = subprocess.Popen([sys.executable, "-m", "specchat", *args], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env=environment)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"ended before {what}: {process.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_while_a_record_is_written_lands_after_it_is_counted(monkeypatch, signum):
    """Python runs a handler between any two calls: one that came as the sink flushed made the
    second record written but not counted ("kept the 1 finished records" beside two), as CI saw."""
    from specchat import batch
    from specchat.cli import sigterm_raises_terminated
    from specchat.errors import Terminated

    monkeypatch.setattr(batch, "preflight", lambda chat, record: None)
    monkeypatch.setattr(batch, "answer_record", lambda chat, record, trace, ui: {"id": record})

    class SignalledSink(io.StringIO):
        def flush(self):
            super().flush()
            if self.getvalue().count("\n") == 2:
                os.kill(os.getpid(), signum)

    sink, warnings = SignalledSink(), []
    with sigterm_raises_terminated(), pytest.raises((Terminated, KeyboardInterrupt)) as stop:
        batch.answer_records(None, [1, 2, 3, 4], sink, warn=warnings.append)
    assert [json.loads(line)["id"] for line in sink.getvalue().splitlines()] == [1, 2]
    said = stop.value.message if signum == signal.SIGTERM else warnings[-1]
    assert "kept the 2 finished records" in said
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the held handlers are put back


@pytest.mark.parametrize("atomic", [False, True], ids=["plain", "atomic"])
def test_sigterm_during_run_keeps_finished_records_leaves_no_temporary_and_exits_143(qwen_dir, tmp_path, atomic,
                                                                                   start_specchat):
    prompts, folder = tmp_path / "p.txt", tmp_path / "out"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(5000)))
    folder.mkdir()
    output = folder / "records.jsonl"
    if atomic:
        output.write_text("old\n")
    process = start_specchat(["run", str(prompts), "-o", str(output), *tiny(qwen_dir, "--method", "vanilla"),
                              *(["--atomic"] if atomic else [])])

    def first_record_written():
        files = [p for p in folder.iterdir() if p.name.startswith(".__atomic-write")] if atomic else [output]
        return any(f.exists() and f.stat().st_size > 0 for f in files)

    wait_for(first_record_written, process, "record")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and one_line(err), err
    assert [p.name for p in folder.iterdir()] == ["records.jsonl"]  # no temporary file left
    if atomic:
        assert output.read_text() == "old\n"
        assert "specchat: terminated; the" in err and "not written (--atomic leaves the output as it was)" in err
        return
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]  # whole JSON lines only
    assert 1 <= len(ids) < 5000 and ids == list(range(1, len(ids) + 1))
    assert f"specchat: terminated; kept the {len(ids)} finished records" in err


def test_sigterm_during_bench_writes_what_finished_and_exits_143(qwen_dir, tmp_path, start_specchat):
    prompts, folder = tmp_path / "q.txt", tmp_path / "results"
    prompts.write_text("".join(f"question {i}\n" for i in range(2000)))
    process = start_specchat(["bench", str(prompts), "--methods", "vanilla", "--warmup", "0", "-o", str(folder),
                              *tiny(qwen_dir)])
    line = ""
    deadline = time.monotonic() + 180
    while not line.startswith("vanilla 2/"):  # off a terminal, bench says a line per answered turn
        line = process.stderr.readline()
        assert line and time.monotonic() < deadline, "no progress line"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and err.strip().splitlines()[-1] == "specchat: terminated", err
    results = json.loads((folder / "results.json").read_text())
    assert results["meta"]["interrupted"] is True and 1 <= len(results["turns"]) < 2000  # (the 2nd may be cut short)


def test_ctrl_c_during_an_atomic_run_leaves_the_old_output_as_it_was(qwen_dir, tmp_path, capsys, monkeypatch):
    """click's atomic file renamed the partial output over the old one even on Ctrl-C."""
    interrupt_the_prompt_with(monkeypatch, "third")
    prompts, output = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("first\nsecond\nthird\nfourth\n")
    output.write_text("old\n")
    code, _, err = invoke(["run", str(prompts), "-o", str(output), "--atomic", *tiny(qwen_dir)], capsys, monkeypatch)
    assert code == 130 and "the 2 finished records are not written (--atomic leaves the output as it was)" in err
    assert output.read_text() == "old\n" and not [p for p in tmp_path.iterdir() if p.name.startswith(".__atomic")]


def test_a_kernel_build_lock_left_by_a_killed_process_does_not_block_the_next_load(tmp_path, monkeypatch):
    """torch's build lock is a plain file: a chat quit (or killed) while its model loaded left it, and
    every later start waited on it forever in "loading the model..."."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    from specchat.decode.runtime import woq_kernel

    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()  # what a process that died holding it leaves
    monkeypatch.setattr(woq_kernel, "missing_cpu_features", lambda: [])
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose=False: str(build))

    loads = []

    def load(**options):  # torch's: take the lock or wait for it (here not forever)
        baton = FileBaton(str(build / "lock"))
        assert baton.try_acquire(), "waits on the stale lock"
        baton.release()
        loads.append(options["name"])
        return str(build / f"{options['name']}.so")  # the library's path, as torch returns it

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(torch.library, "register_fake", lambda name: lambda function: function)
    woq_kernel._built_kernel.__wrapped__()
    assert loads == [woq_kernel.EXTENSION]


def test_train_refuses_an_output_folder_that_would_overwrite_its_data(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "head"
    folder.mkdir()
    data = folder / "training.json"  # what train writes last into its folder
    data.write_text('{"prompt": "hi"}\n')
    code, _, err = invoke(["train", "--kind", "eagle3", "--data", str(data), "-o", str(folder)], capsys, monkeypatch)
    assert code == 2 and "training.json there is also the input" in err and len(err.strip().splitlines()) == 1
    assert data.read_text() == '{"prompt": "hi"}\n'
