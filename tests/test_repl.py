"""The chat as a user drives it: the REPL through prompt-toolkit's pipe input, and piped use.

Every REPL test types into a real `PromptSession` (pipe input, dummy output) and reads what the
chat printed from a rich console on a string buffer.
"""

import dataclasses
import io
import json
import logging
import os
import re
import time
from contextlib import closing
from types import SimpleNamespace

import pytest
import torch
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from conftest import interrupt_the_prompt_with, invoke, load_tiny_target, oracle_head, random_head, tiny
from specchat.cli import open_chat, resolve_settings
from specchat.methods import drafted_for_model
from specchat.settings import LiveChatError, parse_value
from specchat.speedup import OWN_PLAIN_STEPS
from specchat.repl import PROMPT, block_is_open, history_path, run_repl, unwrap_block
from specchat.ui import ChatUI

ESC_ENTER, CTRL_C, CTRL_D = "\x1b\r", "\x03", "\x04"


def new_chat(model_dir, **overrides):
    options = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "max_new_tokens": 8, **overrides}
    settings, profile = resolve_settings(options)
    settings, note = drafted_for_model(settings, options)  # as `specchat chat` does
    return open_chat(settings, profile, note)


def drive(chat, keys: str, terminal: bool = False) -> str:
    """Type `keys` into the REPL, then end the input (Ctrl-D); return what the chat printed."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, soft_wrap=True, force_terminal=terminal,
                      color_system="standard" if terminal else None)
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        pipe.close()
        run_repl(lambda: chat, "tiny", ui=ChatUI(console), input=pipe, output=DummyOutput())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def head_dirs(qwen_dir, bigram_dir, tmp_path_factory):
    from drafters import save_head

    folder = tmp_path_factory.mktemp("heads")
    save_head(random_head("eagle3", load_tiny_target(qwen_dir)), folder / "random")
    save_head(oracle_head(load_tiny_target(bigram_dir)), folder / "oracle")
    return folder


def plain_answer(model_dir, messages, **settings):
    """The greedy answer a fresh plain session gives to the conversation `messages` (last one the user's)."""
    chat = new_chat(model_dir, **settings)
    chat.session.conversation.messages.extend(messages[:-1])
    return "".join(event.text for event in chat.reply(messages[-1]["content"]))


# -- commands ----------------------------------------------------------------------------------


def test_commands_answer_in_one_line_and_never_a_traceback(qwen_dir):
    chat = new_chat(qwen_dir)
    out = drive(chat, "/help\n/bogus\n/set temperature -1\n/set top_k many\n/set model x\n/set depth\n"
                      "/method medusa\n/method eagle2\n/load /no/such.json\n/save\n/tree\n/set top_k 5\n/show\n")
    assert "/method [NAME [DRAFT]]" in out and "Alt-Enter" in out
    lines = out.splitlines()
    for expected in ("Unknown command /bogus. Type /help", "error: temperature must be >= 0",
                     "error: top_k takes a whole number, got 'many'", "error: cannot set 'model' here",
                     "error: usage: /set KEY VALUE", "error: unknown method 'medusa'",
                     "error: eagle2 needs a draft head", "error: /no/such.json: cannot read",
                     "error: usage: /save FILE", "No draft tree yet", "top_k = 5"):
        assert sum(expected in line for line in lines) == 1, expected
    assert "Traceback" not in out
    assert chat.settings.top_k == 5 and chat.session.settings.sampling.top_k == 5
    assert chat.settings.temperature == 0.0 and chat.settings.method == "pld"  # no head for this model: lookup alone


def test_answers_stream_with_a_statistics_line_and_history_is_kept(qwen_dir):
    chat = new_chat(qwen_dir, method="vanilla")
    out = drive(chat, "hello there\n/stats\n")
    answer = chat.session.conversation.messages[-1]["content"]
    assert answer and answer in out
    assert "8 tokens" in out and "tok/s" in out and "τ 1.00" in out
    assert "est." not in out  # plain decoding has no speedup to estimate
    assert history_path().read_text().count("hello there") == 1


def test_multi_line_messages_with_quotes_and_alt_enter(qwen_dir):
    chat = new_chat(qwen_dir, max_new_tokens=2)
    drive(chat, '"""\nfirst line\n  second line\n"""\n' + f"one{ESC_ENTER}two\n")
    users = [m["content"] for m in chat.session.conversation.messages if m["role"] == "user"]
    assert users == ["first line\n  second line", "one\ntwo"]


def test_the_prompt_comes_up_without_importing_torch():
    # torch and the model load in a background thread; the prompt must not wait for them.
    import subprocess
    import sys

    code = "import sys, specchat.cli, specchat.repl; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_helpers():
    assert block_is_open('"""start') and not block_is_open('"""start\nend"""') and not block_is_open("plain")
    assert unwrap_block('"""\na\nb\n"""') == "a\nb" and unwrap_block('"""x"""') == "x" and unwrap_block("y") == "y"


def test_ctrl_c_and_ctrl_d_at_the_prompt_and_exit(qwen_dir):
    chat = new_chat(qwen_dir)
    out = drive(chat, f"half typed{CTRL_C}{CTRL_C}/exit\nnever sent\n")
    assert out.count("Use Ctrl-D or /exit to quit.") == 1  # the first Ctrl-C only discards the line
    assert chat.session.conversation.messages == []
    drive(chat, CTRL_D + "never sent\n")
    assert chat.session.conversation.messages == []


@pytest.mark.parametrize("method", ["vanilla", "pld", "eagle2"])
def test_ctrl_c_mid_answer_keeps_a_consistent_conversation(qwen_dir, head_dirs, method):
    draft = str(head_dirs / "random") if method == "eagle2" else None
    chat = new_chat(qwen_dir, method=method, draft=draft, max_new_tokens=12)
    engine, generate = chat.engine, chat.engine.generate
    calls = []

    def interrupted_once(prompt, settings, rng=None, prediction=None):
        # The first reply is stopped after three steps, as if Ctrl-C arrived mid-answer.
        calls.append(prompt)
        with closing(generate(prompt, settings, rng, prediction)) as steps:
            for index, step in enumerate(steps):
                if len(calls) == 1 and index == 3:
                    raise KeyboardInterrupt
                yield step

    engine.generate = interrupted_once
    out = drive(chat, "first question\nsecond question\n/stats\n")
    messages = chat.session.conversation.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1].get("interrupted") is True and messages[1]["content"]
    assert "interrupted" not in messages[3]
    assert "(interrupted; the partial answer stays in the conversation)" in out
    assert engine.cache.length == len(engine.context_ids)
    # The answer after the interruption is exactly what a fresh session says to the same conversation.
    assert messages[3]["content"] == plain_answer(qwen_dir, messages[:3], max_new_tokens=12)


def test_save_then_load_restores_messages_and_settings(qwen_dir, tmp_path):
    chat = new_chat(qwen_dir)
    transcript = tmp_path / "chat.json"
    drive(chat, f"/system be brief\n/set temperature 0.5\n/set seed 3\n/method pld\nhello\n/save {transcript}\n")
    saved = json.loads(transcript.read_text())
    assert saved["format"] == "specchat-transcript" and saved["settings"]["temperature"] == 0.5
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert not list(tmp_path.glob(".chat.json.*"))  # no temporary left behind

    other = new_chat(qwen_dir)
    out = drive(other, f"/load {transcript}\n/show\n")
    assert "loaded 2 messages" in out
    assert other.session.conversation.messages == chat.session.conversation.messages
    assert other.session.conversation.system == "be brief"
    assert (other.settings.temperature, other.settings.seed, other.settings.method) == (0.5, 3, "pld")
    assert other.session.settings.sampling.temperature == 0.5 and other.engine.proposer is not None


def test_load_keeps_the_method_when_its_draft_is_missing(qwen_dir, tmp_path):
    transcript = tmp_path / "t.json"
    chat = new_chat(qwen_dir)
    chat.save(transcript)
    document = json.loads(transcript.read_text())
    document["settings"].update(method="eagle2", draft=str(tmp_path / "gone"), model="org/other")
    transcript.write_text(json.dumps(document))
    out = drive(chat, f"/load {transcript}\n")
    assert "kept method pld" in out and "saved with model org/other" in out
    assert chat.settings.method == "pld"


def test_method_switch_tree_compare_and_stats(bigram_dir, head_dirs):
    chat = new_chat(bigram_dir, max_new_tokens=10, lookup=False)  # the oracle head's every cycle (no lookup arm)
    out = drive(chat, f"one two\n/method eagle2 {head_dirs / 'oracle'}\n/compare on\nthree four\n/tree\n/stats\n"
                      f"/method vanilla\n/method eagle2\n")
    assert "method eagle2: EAGLE-2 dynamic tree" in out
    assert "vs plain, measured (same answer)" in out
    assert "✓" in out and "+ " in out and "root" in out  # accepted path and the target's bonus token
    assert "eagle2 acceptance by tree depth" in out and "1: 100%" in out
    stats = chat.totals["eagle2"]
    assert stats.tau > 1 and stats.measured_speedup is not None
    assert chat.settings.method == "eagle2"  # switched back without reloading (same settings, same draft)


def test_estimated_speedup_is_marked_as_an_estimate(qwen_dir):
    chat = new_chat(qwen_dir, method="pld")
    out = drive(chat, "abc abc abc abc\n")
    assert "x est." in out and "measured" not in out
    # plain decoding's step: the reply's own plain steps, kept for this context length (with timed ones where too few)
    (kept,) = chat.clock.steps_by_bucket.values()
    assert len(kept) >= min(chat.last_turn.stats.plain_steps, OWN_PLAIN_STEPS)


def test_show_accept_colours_drafted_and_target_tokens_on_a_terminal_only(bigram_dir, head_dirs):
    keys = f"/method eagle2 {head_dirs / 'oracle'}\n/set show_accept on\nhello\n"
    chat = new_chat(bigram_dir)
    coloured = drive(chat, keys, terminal=True)
    assert "\x1b[32m" in coloured and "\x1b[33m" in coloured  # green: from the draft; yellow: the target's own
    assert chat.last_turn.text in re.sub(r"\x1b\[[0-9;]*m", "", coloured)  # the colours hold the answer's text
    for event in chat.reply("hello again"):  # each token's text made once, with its source, in the session
        assert "".join(piece for piece, _ in event.pieces) == event.text
        assert [drafted for _, drafted in event.pieces][: len(event.step.tokens)] == event.step.drafted
    plain = drive(new_chat(bigram_dir), keys)
    assert "\x1b[" not in plain and "colours show only on a terminal" in plain


def predicted_text(model_dir, message: str, **settings) -> str:
    """A prediction of the plain answer to `message` that it repeats whole: its text up to the first
    character the tiny random model's bytes do not make."""
    return plain_answer(model_dir, [{"role": "user", "content": message}], **settings).split("\ufffd")[0]


def test_predict_sets_shows_and_clears_the_prediction_of_every_answer(qwen_dir, tmp_path):
    prediction = predicted_text(qwen_dir, "hi", max_new_tokens=20)
    (tmp_path / "draft.py").write_text(prediction, encoding="utf-8")
    answer = plain_answer(qwen_dir, [{"role": "user", "content": "hi"}], max_new_tokens=20)
    chat = new_chat(qwen_dir, method="pld", max_new_tokens=20)
    out = drive(chat, f"/predict\n/predict {tmp_path / 'draft.py'}\n/predict\nhi\n/predict /no/such.py\n")
    ids = chat.session.chat_format.prediction_ids(prediction)
    lines = out.splitlines()
    assert lines.count("no prediction") == 1 and "error: /no/such.py: cannot read the prediction" in out
    assert sum(f"prediction {tmp_path / 'draft.py'}: {len(ids)} tokens" in line for line in lines) == 2
    assert len(ids) > 5 and f"prediction {len(ids)}/{len(ids)} accepted" in out  # the answer repeated it whole
    assert chat.last_turn.prediction_ids == chat.engine.proposer.source.prediction.tokens == ids  # pld drafted from it
    assert chat.session.conversation.messages[-1]["content"] == answer  # and the answer is the plain one
    out = drive(chat, "/predict off\n/predict\nagain\n")
    assert out.count("no prediction") == 2 and "prediction 0/" not in out and " accepted ·" not in out
    assert chat.prediction is None
    assert chat.last_turn.prediction_ids == chat.engine.proposer.source.prediction.tokens == []


def test_a_reply_can_have_its_own_settings_random_stream_and_prediction(qwen_dir):
    chat = new_chat(qwen_dir, method="pld")
    chat.set_prediction("a b c", "abc.txt")
    short = dataclasses.replace(chat.session.settings, max_new_tokens=2)
    rng = torch.Generator().manual_seed(3)
    list(chat.reply("hi", generation=short, rng=rng))
    turn = chat.last_turn
    assert turn.generation is short and turn.stats.new_tokens <= 2 and chat.session.settings.max_new_tokens == 8
    assert turn.prediction_ids == chat.session.chat_format.prediction_ids("a b c")
    list(chat.reply("again", prediction=""))  # an empty prediction gives none, the chat's stays
    assert chat.last_turn.prediction_ids == [] and chat.prediction == "a b c"
    assert chat.report().prediction is None


def test_parse_value():
    assert parse_value("temperature", "0.7") == 0.7 and parse_value("temperature", 1) == 1.0
    assert parse_value("seed", "none") is None and parse_value("show_accept", "on") is True
    with pytest.raises(LiveChatError, match="top_k takes a whole number"):
        parse_value("top_k", True)
    with pytest.raises(LiveChatError, match="method must be one of"):
        parse_value("method", "medusa")


# -- piping and exit codes -----------------------------------------------------------------------


def test_piped_chat_keeps_stdout_plain_and_compares_on_request(qwen_dir, capsys, monkeypatch):
    code, out, err = invoke(["chat", *tiny(qwen_dir, "--method", "pld", "--show-accept", "--compare")],
                            capsys, monkeypatch, stdin="say something\n")
    assert code == 0 and "\x1b[" not in out + err
    curve = ("specchat: measuring what verifying", "specchat: the verify-cost curve")  # (its measurement, said if busy)
    lines = [line for line in err.splitlines() if not line.startswith(curve)]
    assert len(lines) == 1 and "vs plain, measured (same answer)" in lines[0]  # (pld sizes chains by the verify cost)
    code, _, err = invoke(["chat", *tiny(qwen_dir, "--method", "pld")], capsys, monkeypatch, stdin="again\n")
    assert code == 0 and "x est." in err


def test_piped_chat_drafts_from_the_predicted_file(qwen_dir, tmp_path, capsys, monkeypatch):
    prediction = predicted_text(qwen_dir, "hi", max_new_tokens=20)
    predicted = tmp_path / "predicted.txt"
    predicted.write_text(prediction, encoding="utf-8")
    options = tiny(qwen_dir, "--method", "pld", "--max-new-tokens", "20")
    code, out, err = invoke(["chat", *options, "--predict", str(predicted)], capsys, monkeypatch, stdin="hi")
    assert code == 0 and out.startswith(prediction)
    size = len(prediction.encode())  # the tiny tokenizer's tokens are bytes
    assert size > 5 and f"prediction {size}/{size} accepted" in err  # the answer repeated it whole
    code, _, err = invoke(["chat", *options, "--predict", str(tmp_path / "missing.txt")], capsys, monkeypatch,
                          stdin="hi\n")
    assert code == 2 and err.strip().splitlines() == [
        f"specchat: error: {tmp_path / 'missing.txt'}: cannot read the prediction (No such file or directory)"]
    predicted.write_bytes(b"caf\xe9")
    code, _, err = invoke(["chat", *options, "--predict", str(predicted)], capsys, monkeypatch, stdin="hi\n")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not UTF-8 text" in err


def test_run_text_format_prints_only_the_answers(qwen_dir, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["a", "b"]}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    code, records, _ = invoke(["run", str(prompts), *tiny(qwen_dir)], capsys, monkeypatch)
    code, out, err = invoke(["run", str(prompts), "--format", "text", *tiny(qwen_dir)], capsys, monkeypatch)
    assert code == 0
    responses = [turn["response"] for line in records.splitlines() for turn in json.loads(line)["turns"]]
    assert out == "".join(response + "\n" for response in responses)
    assert err.count("tok/s") == 3


def test_run_compare_adds_the_measured_speedup_beside_the_estimate(qwen_dir, capsys, monkeypatch):
    code, out, _ = invoke(["run", "-", "--compare", *tiny(qwen_dir, "--method", "pld")], capsys, monkeypatch,
                          stdin="x y x y\n")
    turn = json.loads(out)["turns"][0]
    assert code == 0 and turn["identical"] is True and turn["speedup"] > 0 and turn["plain_seconds"] > 0
    assert turn["estimated_speedup"] > 0  # what the chat shows as "~Nx est.", to be checked against the speedup
    code, out, _ = invoke(["run", "-", *tiny(qwen_dir, "--method", "pld")], capsys, monkeypatch, stdin="x y x y\n")
    assert code == 0 and "estimated_speedup" not in json.loads(out)["turns"][0]  # no plain steps timed unasked


def test_ctrl_c_during_run_exits_130_and_keeps_finished_records(qwen_dir, tmp_path, capsys, monkeypatch):
    interrupt_the_prompt_with(monkeypatch, "third")
    prompts, output = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("first\nsecond\nthird\nfourth\n")
    code, _, err = invoke(["run", str(prompts), "-o", str(output), *tiny(qwen_dir)], capsys, monkeypatch)
    assert code == 130 and "kept the 2 finished records" in err
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == [1, 2]


def test_save_writes_through_a_link_and_never_replaces_a_pipe_or_a_folder(qwen_dir, tmp_path):
    import os

    chat = new_chat(qwen_dir)
    real, link, pipe = tmp_path / "real.json", tmp_path / "link.json", tmp_path / "pipe.json"
    real.write_text("{}")
    link.symlink_to(real)
    os.mkfifo(pipe)
    out = drive(chat, f"hello\n/save {link}\n/save {pipe}\n/save {tmp_path}\n")
    assert link.is_symlink() and json.loads(real.read_text())["format"] == "specchat-transcript"
    assert f"error: {pipe}: cannot write (not a regular file)" in out and pipe.is_fifo()
    assert f"error: {tmp_path}: cannot write (not a regular file)" in out
    assert not list(tmp_path.glob(".*.tmp"))


def test_ctrl_c_while_waiting_for_the_model_leaves_the_load_running():
    """A Ctrl-C that interrupts Thread.join() makes Python 3.11 take the thread for finished: the chat
    then answered the next messages with nothing while the model went on loading."""
    import signal
    import threading

    from specchat.repl import BackgroundLoad

    release = threading.Event()
    loading = BackgroundLoad(lambda: release.wait() and "the chat")
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        loading.result()
    assert not loading.ready
    release.set()
    assert loading.result() == "the chat" and loading.ready


# -- leaving the terminal chat at any moment (a real pseudo-terminal, a child process) ---------------------

# The child runs `specchat chat`, with the terminal as its controlling one (so that Ctrl-C while an
# answer streams is a SIGINT, as in a real terminal) and, on request, a load that works the way
# transformers loads weights (a thread pool with queued work, which Python's shutdown waits for
# before it exits), a slow shutdown (clearing torch's modules took seconds to tens of seconds on a
# busy 2-core machine), or answers that take a while per step.
CHILD = """
import atexit, os, sys, time
from contextlib import closing
os.close(os.open(os.ttyname(0), os.O_RDWR))
import specchat.cli as cli
if os.environ.get("SLOW_EXIT"):
    atexit.register(time.sleep, 60)
if float(os.environ.get("SLOW_LOAD", "0")):
    from concurrent.futures import ThreadPoolExecutor
    open_chat = cli.open_chat
    def load_like_transformers(*args, **kwargs):
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(time.sleep, float(os.environ["SLOW_LOAD"])).result()
        return open_chat(*args, **kwargs)
    cli.open_chat = load_like_transformers
if os.environ.get("SLOW_STEPS"):
    from specchat.decode.engine.engine import Engine
    generate = Engine.generate
    def slow_generate(self, *args, **kwargs):
        with closing(generate(self, *args, **kwargs)) as steps:
            for step in steps:
                time.sleep(0.5)
                yield step
    Engine.generate = slow_generate
cli.main(sys.argv[1:])
"""


class Terminal:
    """`specchat chat` on a pseudo-terminal: type keys, read the screen, time the exit."""

    def __init__(self, model_dir, **env):
        import pty
        import subprocess
        import sys
        from pathlib import Path

        master, slave = pty.openpty()
        root = str(Path(__file__).resolve().parent.parent)
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path]), "TERM": "xterm",
                       "PROMPT_TOOLKIT_NO_CPR": "1", "SPECCHAT_NOHISTORY": "1", **env}
        self.process = subprocess.Popen([sys.executable, "-c", CHILD, "chat", *tiny(model_dir, "--method", "vanilla")],
                                        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                        env=environment)
        os.close(slave)
        self.master, self.screen, self.seen = master, b"", 0

    def read(self, seconds: float) -> None:
        import select

        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.master], [], [], min(left, 0.05))[0]:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:  # the child is gone
                    return

    def wait_for(self, text: bytes, timeout: float = 120) -> None:
        """Wait until `text` shows after what the previous wait found."""
        deadline = time.monotonic() + timeout
        while (found := self.screen.find(text, self.seen)) < 0:
            assert time.monotonic() < deadline and self.process.poll() is None, (text, self.screen[-2000:])
            self.read(0.05)
        self.seen = found + len(text)

    def type(self, keys: bytes) -> None:
        """Type `keys` a moment after the screen last changed, as a person would: a key typed while the
        terminal is still in line mode (the prompt is drawn just before it leaves it) is the line
        discipline's, and a Ctrl-D there is an end of file that never reaches the prompt."""
        self.read(0.3)
        os.write(self.master, keys)

    def exit_after(self, timeout: float = 10) -> tuple[int, float]:
        """(exit status, seconds it took), reading the screen meanwhile (a full pty would block the child)."""
        start = time.monotonic()
        while self.process.poll() is None and time.monotonic() - start < timeout:
            self.read(0.05)
        took = time.monotonic() - start
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
            os.close(self.master)
            raise AssertionError(f"still running {timeout} s later: {self.screen[-2000:]!r}")
        self.read(0.2)
        os.close(self.master)
        return self.process.returncode, took


LOADING = {"SLOW_LOAD": "300"}  # the model is still loading whenever the test acts


@pytest.mark.parametrize("env,steps", [
    (LOADING, [CTRL_D]),  # at once: the load has work queued in a thread pool
    ({}, [CTRL_D]),  # at once: the real load is importing torch
    (LOADING, ["/exit\r"]),
    (LOADING, [CTRL_C, b"Use Ctrl-D or /exit to quit.", CTRL_D]),  # Ctrl-C at the prompt reminds, at once
    (LOADING, ["hello\r", b"loading the model", CTRL_C, b"Stopped waiting", CTRL_D]),
], ids=["ctrl-d", "ctrl-d-importing", "exit", "ctrl-c-then-ctrl-d", "stop-waiting-then-ctrl-d"])
def test_the_chat_ends_at_once_while_the_model_loads(qwen_dir, env, steps):
    """Ctrl-D 2.5 s after the start did not end the chat in 3 of 18 trials (25 s, 45 s, > 120 s)."""
    terminal = Terminal(qwen_dir, **env)
    terminal.wait_for(PROMPT.encode())
    for step in steps:  # keys to type, or what the screen must then show
        if isinstance(step, bytes):
            terminal.wait_for(step, timeout=10)
        else:
            terminal.type(step.encode())
    assert terminal.exit_after(5)[0] == 0, terminal.screen[-2000:]


def test_the_chat_ends_at_once_after_an_answer_and_after_a_stopped_one(qwen_dir):
    terminal = Terminal(qwen_dir, SLOW_STEPS="1", SLOW_EXIT="1")
    terminal.wait_for(PROMPT.encode())
    terminal.type(b"hello\r")
    terminal.wait_for(b"tok/s")  # the statistics line: answered
    terminal.wait_for(PROMPT.encode(), timeout=10)
    terminal.type(b"hello again\r")
    terminal.wait_for(b"hello again")
    terminal.read(1.5)  # a step or two into the answer
    terminal.type(CTRL_C.encode())
    terminal.wait_for(PROMPT.encode(), timeout=10)  # stopped, and the chat goes on
    terminal.type(CTRL_D.encode())
    assert terminal.exit_after(5)[0] == 0, terminal.screen[-2000:]


@pytest.mark.parametrize("env", [LOADING, {"SLOW_EXIT": "1"}], ids=["loading", "loaded"])
def test_sigterm_ends_the_chat_with_143(qwen_dir, env):
    import signal

    terminal = Terminal(qwen_dir, **env)
    terminal.wait_for(PROMPT.encode())
    if env is not LOADING:
        terminal.type(b"hello\r")
        terminal.wait_for(b"tok/s")
        terminal.wait_for(PROMPT.encode(), timeout=10)
    terminal.read(0.3)
    terminal.process.send_signal(signal.SIGTERM)
    status, _ = terminal.exit_after(5)
    assert status == 143 and b"specchat: terminated" in terminal.screen, terminal.screen[-2000:]


class SharedScreen(io.StringIO):
    """stdout and stderr on one terminal."""

    def isatty(self):
        return True


def test_a_core_message_mid_answer_starts_a_line_of_its_own_on_a_shared_terminal(monkeypatch):
    """`--verbose`'s healed-curve line came inside the answer's words ("Naturespecchat: 3.36s live
    verify ..."): on one terminal, a core message mid-line goes below the answer's unfinished line."""
    screen = SharedScreen()
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", screen)
    ui = ChatUI(Console(file=screen, soft_wrap=True, highlight=False))
    writer = ui.answer()
    core = logging.getLogger("specchat.decode")
    writer.write(SimpleNamespace(text="Whispers of the sea,\n"))
    core.warning("at a line's start")
    writer.write(SimpleNamespace(text="Nature"))
    core.warning("mid-line")
    writer.write(SimpleNamespace(text="'s beauty."))
    ui.end_answer()
    core.warning("after the answer")
    assert screen.getvalue() == ("Whispers of the sea,\nspecchat: at a line's start\nNature\nspecchat: mid-line\n"
                                 "'s beauty.\nspecchat: after the answer\n")
