"""Other tools' implementations, run by `specchat bench` on the same model, prompts and settings.

    hf.py        `hf-assisted`: transformers' assisted generation, with a smaller model of the same
                 tokenizer as the assistant; `hf-pld`: its prompt lookup decoding; both on the loaded target
    llamacpp.py  `llamacpp`, `llamacpp-lookup`: llama.cpp's plain and prompt lookup decoding through
                 its binding; `llamacpp-eagle3`: its own EAGLE-3 speculation in llama-server, with
                 specchat's head (and `export-head --format llamacpp`)
    openvino.py  OpenVINO GenAI: plain (int4, int8), prompt lookup, EAGLE-3 with specchat's head
    vllm.py      vLLM's CPU build: plain, EAGLE-3 with specchat's head in the speculators layout
    process.py   a peer in a process of its own: another environment's Python, the worker, its runner
    worker.py    that worker, run by the other environment's Python (no specchat there): JSON lines

llama.cpp is what most CPU users run (ollama wraps it), so it is the number to beat. Its binding
is the optional extra `peers`; OpenVINO GenAI and vLLM pin versions of their own and live in
environments of their own (`process.py`).

Each module's builders (its `RUNNERS`, by entry of `specchat.methods`; all of them joined in
`specchat.bench.run.RUNNERS`) return a runner (a `ConversationRunner`: the interface of
`specchat.bench.measure.SessionRunner`) and whatever it loaded, to be let go when the method is
done. Prompts are the same token ids (the model's own chat template) and sampling the plain
distribution. Target forwards are counted (a forward hook, llama.cpp's evaluation calls, the
runtime's own counters), so τ means the same as for specchat's methods; the time to the first
token is the prefill.

This face holds what every peer shares: the runner's base and the one error that skips a peer.
"""

from __future__ import annotations

from specchat.chat import ChatFormat, Conversation, Turn
from specchat.errors import SpecchatError
from specchat.inputs import PromptRecord
from specchat.stats import Stats

# The context a peer allocates (llama.cpp allocates it whole; with its lookup, logits too: 2.5 GB): what
# the bench's prompts and answers need.
PEER_CONTEXT = 4096


class PeerUnavailable(SpecchatError):
    """A peer cannot run here (its package is not installed, or the model has no GGUF file)."""


class ConversationRunner:
    """What every peer's bench runner shares (the interface of `specchat.bench.measure.SessionRunner`):
    one conversation per question, whose turns it answers with token ids of the model's own chat template."""

    chat_format: ChatFormat

    def __init__(self):
        self.conversation: Conversation | None = None

    def close(self) -> None:
        pass

    def start(self, record: PromptRecord, system: str | None) -> None:
        self.conversation = Conversation.opening(record, system)

    def answered(self, tokens: list[int], stats: Stats) -> Turn:
        """The turn that answered with `tokens`, added to the conversation."""
        decoder = self.chat_format.decoder()
        decoder.push(tokens)
        decoder.flush()
        self.conversation.add_assistant(decoder.text)
        return Turn(text=decoder.text, tokens=tokens, stats=stats, finished=True)
