"""What a client may ask of `POST /v1/chat/completions` and `POST /v1/completions`, checked before it is queued.

A request becomes a `CompletionRequest` or an `ApiError` in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`), so that a bad request costs the server no
decoding and gets a 4xx it can show. specchat samples from the target's distribution exactly, so
what would change that distribution (penalties, logit biases) is refused rather than ignored, and
so is what it cannot give (several choices, log-probabilities, tools, structured output).

The values the command line also takes (temperature, top_p, top_k, seed) are checked by the same
rules (`specchat.settings.check_value`). vLLM's and SGLang's `ignore_eos` (the answer runs to
`max_tokens` through end-of-turn tokens, as serving benchmarks ask) is taken by both endpoints.
Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specchat import settings as settings_mod

MAX_BODY_BYTES = 8 << 20  # a request's body: 32k tokens of context is ~128 kB of text; a prediction as much again
MAX_STOP = 4  # stop sequences, as OpenAI allows
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when it gives none: OpenAI's legacy default, as vLLM's
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request of either endpoint; None: the server's own setting (its profile and flags).
    A chat completion's messages go through the model's chat template; a completion's `prompt` is
    continued as it is."""

    system: str | None = None
    history: list[dict] = field(default_factory=list)  # the messages before the last, {"role", "content"}
    user: str = ""  # the last message, which the reply answers
    prompt: str | tuple[int, ...] | None = None  # a completion's (`/v1/completions`): text or token ids
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    prediction: str | None = None  # OpenAI's predicted output: text the reply is expected to repeat
    ignore_eos: bool = False  # vLLM's and SGLang's: the answer goes on past end-of-turn tokens to max_tokens

    @property
    def param(self) -> str:
        """The field a refusal of the prompt names."""
        return "messages" if self.prompt is None else "prompt"


def parse_body(body: bytes) -> dict:
    """The JSON object a body holds, or a 400."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from error
    if not isinstance(request, dict):
        raise ApiError(400, "the body must be a JSON object")
    return request


def text_of(content, param: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts of type "text" (joined)."""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ApiError(400, f"{param}: only text content parts are supported (this model reads text)", param)
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param} must be a string or a list of text parts", param)
    if not content.strip():
        raise ApiError(400, f"{param} is empty", param)
    return content


def checked_messages(messages) -> tuple[str | None, list[dict], str]:
    """(system, history, last user message): system (or developer) messages only at the start, then
    user and assistant ones, the last the user's."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    system, history = [], []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object with a role and a content", param)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{param}.role {role!r} is not supported (roles: {', '.join(ROLES)}; "
                                "this server calls no tools)", f"{param}.role")
        text = text_of(message.get("content"), f"{param}.content")
        if role in ("system", "developer"):
            if history:
                raise ApiError(400, f"{param}: a {role} message may only come before the conversation", f"{param}.role")
            system.append(text)
        else:
            history.append({"role": role, "content": text})
    if not history or history[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's (the reply answers it)", "messages")
    return "\n\n".join(system) or None, history[:-1], history[-1]["content"]


def _number(request: dict, name: str, kind: type, setting: str | None = None):
    value = request.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    problem = settings_mod.check_value(setting or name, kind(value)) if (setting or name) in settings_mod.FIELDS else None
    if problem:
        raise ApiError(400, f"{name} {problem}", name)
    return kind(value)


def _refuse(request: dict) -> None:
    """Asks that specchat cannot meet without changing or leaving the target's distribution."""
    for name in ("n", "best_of"):
        if request.get(name) not in (None, 1):
            raise ApiError(400, f"{name} must be 1: one choice per request (got {request[name]!r})", name)
    if request.get("tools") or request.get("functions") or request.get("tool_choice") not in (None, "none"):
        raise ApiError(400, "this model is served without tools (no tool or function calls)", "tools")
    if request.get("logprobs") or request.get("top_logprobs"):
        raise ApiError(400, "log-probabilities are not returned by this server", "logprobs")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if request.get(name) not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise ApiError(400, f"{name} is not supported: specchat samples from the model's own distribution", name)
    if request.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported: specchat samples from the model's own distribution",
                       "logit_bias")
    response_format = request.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "only text responses are supported (response_format {\"type\": \"text\"})",
                       "response_format")


def _stop(value) -> tuple[str, ...]:
    stop = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
    return tuple(stop)


def _prediction(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise ApiError(400, "prediction must be {\"type\": \"content\", \"content\": ...}", "prediction")
    return text_of(value.get("content"), "prediction.content")


def _flag(request: dict, name: str) -> bool:
    value = request.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", name)
    return value


def _options(request: dict, model: str) -> dict:
    """What both endpoints take besides the prompt, checked: the model, the sampling, the stops, streaming."""
    if request.get("model") is None:
        raise ApiError(400, "model is required", "model")
    if request["model"] != model:
        raise ApiError(404, f"the model {request['model']!r} does not exist: this server serves {model!r}",
                       "model", "model_not_found")
    _refuse(request)
    max_tokens = _number(request, "max_completion_tokens", int, "max_new_tokens")
    if max_tokens is None:
        max_tokens = _number(request, "max_tokens", int, "max_new_tokens")
    stream_options = request.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return {"max_tokens": max_tokens, "temperature": _number(request, "temperature", float),
            "top_p": _number(request, "top_p", float), "top_k": _number(request, "top_k", int),
            "seed": _number(request, "seed", int), "stop": _stop(request.get("stop")),
            "stream": _flag(request, "stream"), "include_usage": bool(stream_options.get("include_usage")),
            "ignore_eos": _flag(request, "ignore_eos")}


def checked_request(request: dict, model: str) -> CompletionRequest:
    """A chat-completion request as the server takes it, or the ApiError that refuses it. `model`: the
    name the server serves under (`GET /v1/models`)."""
    options = _options(request, model)
    system, history, user = checked_messages(request.get("messages"))
    return CompletionRequest(system=system, history=history, user=user,
                             prediction=_prediction(request.get("prediction")), **options)


def _prompt(value) -> str | tuple[int, ...]:
    """A completion's one prompt: a string, or token ids (either alone in a list, as clients batch them)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "prompt is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(item, int) and not isinstance(item, bool)
                                                 for item in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1:
        raise ApiError(400, "one prompt per request: a string or a list of token ids", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")


def checked_completion(request: dict, model: str) -> CompletionRequest:
    """A completion request (`POST /v1/completions`: a prompt continued as it is, no chat template) as the
    server takes it, or the ApiError that refuses it."""
    options = _options(request, model)
    if options["max_tokens"] is None:
        options["max_tokens"] = COMPLETION_MAX_TOKENS
    if request.get("echo"):
        raise ApiError(400, "echo is not supported: the answer holds the completion only", "echo")
    if request.get("suffix"):
        raise ApiError(400, "suffix is not supported: write a fill-in-the-middle prompt with the model's own "
                            "tokens (Qwen2.5-Coder: <|fim_prefix|>...<|fim_suffix|>...<|fim_middle|>)", "suffix")
    return CompletionRequest(prompt=_prompt(request.get("prompt")), **options)
