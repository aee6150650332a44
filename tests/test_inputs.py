"""Prompt files: every accepted shape, and a clear error naming file and line for bad ones."""

import io
import json

import pytest

from specchat.inputs import InputError, read_prompts


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_all_jsonl_shapes(tmp_path):
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["one", "two"]},
        {"prompt": "hello", "id": "p1", "system": "be kind"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]},
    ]
    records = read_prompts([write(tmp_path, "x.jsonl", "\n".join(map(json.dumps, lines)) + "\n\n")])
    assert [r.id for r in records] == [81, "p1", 3]
    assert records[0].turns == ["one", "two"] and records[0].category == "writing"
    assert records[1].system == "be kind"
    assert records[2].system == "s" and records[2].turns == ["c"]
    assert records[2].history == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_text_file_one_prompt_per_line_blank_lines_skipped(tmp_path):
    records = read_prompts([write(tmp_path, "p.txt", "first\n\nsecond\n")])
    assert [(r.id, r.turns) for r in records] == [(1, ["first"]), (3, ["second"])]


def test_stdin_is_sniffed(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "from json"}\n'))
    assert read_prompts(["-"])[0].turns == ["from json"]
    monkeypatch.setattr("sys.stdin", io.StringIO("plain text\n"))
    assert read_prompts(["-"])[0].turns == ["plain text"]


@pytest.mark.parametrize("text,message", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', r"bad\.jsonl:2: broken JSON"),
    ('{"prompt": "   "}\n', r"bad\.jsonl:1: empty prompt"),
    ('{"turns": []}\n', r"bad\.jsonl:1: 'turns' must be a non-empty list"),
    ('{"question": "x"}\n', r"bad\.jsonl:1: a JSON line needs"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     r"bad\.jsonl:1: the last message must be the user's"),
    ('[1, 2]\n', r"bad\.jsonl:1: expected a JSON object"),
])
def test_bad_lines_name_file_and_line(tmp_path, text, message):
    with pytest.raises(InputError, match=message):
        read_prompts([write(tmp_path, "bad.jsonl", text)])


def test_unsupported_and_missing_and_empty_inputs(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="unsupported input"):
        read_prompts([write(tmp_path, "p.csv", "a,b")])
    with pytest.raises(InputError, match="No such file"):
        read_prompts([str(tmp_path / "missing.txt")])
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    with pytest.raises(InputError, match="empty prompt"):
        read_prompts(["-"])
