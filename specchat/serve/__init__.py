"""`specchat serve`: the chat's engine behind an OpenAI-compatible endpoint (the `serve` extra).

    requests.py  what a client may ask, checked before it is queued; OpenAI's error shape
    worker.py    the decoding thread: one request at a time, stop sequences, usage
    metrics.py   the counters at /metrics, named as vLLM's (drafts, draft and accepted tokens by position)
    app.py       the routes on starlette (chat completions and completions, whole or streamed; models;
                 metrics; health), the server

The model loads once (`specchat.app.open_chat`, as `chat` and `run` load it: the same profiles,
methods and flags); uvicorn serves the routes on the event loop while one thread decodes. Bound
to 127.0.0.1 unless told otherwise; beyond this machine an API key is required (the command line
checks that). This face holds the defaults the command line declares, and nothing heavy: the
server's stack loads with `app`.
"""

from __future__ import annotations

import importlib.util
import ipaddress

from specchat.errors import SpecchatError

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# Requests queued behind the one being answered; past it a 429. ollama's default queue (OLLAMA_MAX_QUEUE);
# vLLM's and llama.cpp's servers queue without a bound. A serving benchmark sends its whole set at
# once (`vllm bench serve` at an infinite request rate), which 16 turned into 429s.
MAX_WAITING = 512


def is_local(host: str) -> bool:
    """Whether `host` binds this machine only (a loopback address or localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_installed() -> None:
    """The one-line error where the serve extra is missing."""
    missing = [name for name in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecchatError(f"specchat serve needs {', '.join(missing)}: pip install 'specchat[serve]'")
