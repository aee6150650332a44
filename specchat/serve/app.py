"""The HTTP face of `specchat serve`: OpenAI's chat completions and completions on starlette, served by uvicorn.

Routes: `POST /v1/chat/completions` (a JSON answer, or server-sent events with `"stream": true`), `POST
/v1/completions` (the same for a prompt continued as it is: what serving benchmarks and editors' code
completion send), `GET /v1/models` (the one model served), `GET /metrics` (the counters, in Prometheus'
format: `metrics`), `GET /health`. A request is checked and its prompt tokenized on the event loop's side
(`requests`, in a worker thread of the loop), so that a bad one is refused before it waits; then the
decoding thread answers it (`worker.Decoder`). A client that goes away cancels its job: a stream notices
at once (starlette listens for the disconnect), a plain request between the answer's pieces. Every
refusal is a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specchat.chat import Conversation
from specchat.errors import ContextLengthError, SpecchatError
from specchat.live import LiveChat
from specchat.serve import DEFAULT_HOST, DEFAULT_PORT, MAX_WAITING
from specchat.serve.requests import (MAX_BODY_BYTES, ApiError, CompletionRequest, checked_completion, checked_request,
                                    parse_body)
from specchat.serve.worker import Decoder, Done, Job

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.25  # how often a plain (not streamed) request looks for its client between pieces


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def prompt_ids(chat: LiveChat, request: CompletionRequest) -> list[int]:
    """The prompt as the decoding thread will answer it: a chat completion's messages through the chat
    template (a huge one refused before), a completion's prompt as it is (`ChatFormat.completion_ids`)."""
    chat_format, context = chat.session.chat_format, chat.engine.max_context
    if request.prompt is not None:
        return chat_format.completion_ids(request.prompt, context)
    conversation = Conversation.opening(request, chat.settings.system)
    conversation.add_user(request.user)
    chat_format.check_size(conversation.as_messages(), context)
    return chat_format.prompt_ids(conversation)


def checked_prompt(chat: LiveChat, request: CompletionRequest) -> list[int]:
    """The prompt's token ids, or the ApiError saying why it cannot be answered (it or the prediction does
    not fit, the template refuses it). Runs beside the decoding thread: it only reads the tokenizer."""
    chat_format, context = chat.session.chat_format, chat.engine.max_context
    try:
        prompt = prompt_ids(chat, request)
    except ContextLengthError as error:
        raise ApiError(400, str(error), request.param, "context_length_exceeded") from error
    except SpecchatError as error:
        raise ApiError(400, str(error), request.param) from error
    if request.prediction is not None and (size := len(chat_format.prediction_ids(request.prediction))) > context:
        raise ApiError(400, f"the prediction has {size} tokens, more than the model's context of {context} holds "
                            "(no answer could repeat it)", "prediction.content", "context_length_exceeded")
    asked = request.max_tokens or 0
    if len(prompt) + max(asked, 1) > context:
        taking = "the messages take" if request.prompt is None else "the prompt takes"
        raise ApiError(400, f"the model's context holds {context} tokens; {taking} {len(prompt)}"
                            + (f" and max_tokens asks for {asked} more" if asked else ", leaving no room for a reply"),
                       "max_tokens" if asked and len(prompt) < context else request.param, "context_length_exceeded")
    return prompt


class Routes:
    """The routes around one loaded chat and its decoding thread."""

    def __init__(self, chat: LiveChat, decoder: Decoder, model: str, api_key: str | None):
        self.chat, self.decoder, self.model, self.api_key = chat, decoder, model, api_key
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        """The decoding thread runs while the application does."""
        self.decoder.start()
        try:
            yield
        finally:
            self.decoder.stop()

    def application(self) -> Starlette:
        return Starlette(lifespan=self.lifespan, routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ], exception_handlers={ApiError: lambda request, error: error_response(error)})

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "waiting": self.decoder.waiting})

    async def metrics(self, request: Request) -> Response:
        """The counters in Prometheus' text format (`specchat.serve.metrics`); behind the API key where one is set."""
        self.authorize(request)
        metrics = self.decoder.metrics
        return Response(metrics.text(), media_type=metrics.content_type)

    async def models(self, request: Request) -> JSONResponse:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "specchat"}]})

    async def chat_completions(self, request: Request):
        self.authorize(request)
        return await self.answered(request, checked_request(parse_body(await body_of(request)), self.model))

    async def completions(self, request: Request):
        self.authorize(request)
        return await self.answered(request, checked_completion(parse_body(await body_of(request)), self.model))

    async def answered(self, request: Request, checked: CompletionRequest):
        prompt = await run_in_threadpool(checked_prompt, self.chat, checked)
        job, items = Job.on_loop(checked, prompt)
        self.decoder.submit(job)
        answer = (Answer if checked.prompt is None else TextAnswer)(self.model)
        if checked.stream:
            return StreamingResponse(self.events(job, items, answer), media_type="text/event-stream")
        return await self.whole(request, job, items, answer)

    async def whole(self, request: Request, job: Job, items: asyncio.Queue, answer: Answer) -> JSONResponse:
        text = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)  # nobody reads it
                    continue
                if isinstance(item, ApiError):
                    return error_response(item)
                if isinstance(item, Done):
                    return JSONResponse(answer.whole("".join(text), item))
                text.append(item)
        finally:
            job.cancelled.set()  # (after the end, a no-op)

    async def events(self, job: Job, items: asyncio.Queue, answer: Answer) -> AsyncIterator[str]:
        """The answer as server-sent events, OpenAI's chunks; cancelled with the job when the client goes."""
        try:
            if opening := answer.opening():
                yield sse(opening)
            while True:
                item = await items.get()
                if isinstance(item, ApiError):  # the answer failed after the response began: said in the stream
                    yield sse(item.body())
                    break
                if isinstance(item, Done):
                    yield sse(answer.closing(item.finish_reason))
                    if job.request.include_usage:
                        yield sse(answer.usage(item.usage))
                    break
                yield sse(answer.piece(item))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()


class Answer:
    """The shapes of one chat answer in OpenAI's API: the whole completion, or its chunks."""

    PREFIX, OBJECT, CHUNK = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str):
        self.id, self.model, self.created = f"{self.PREFIX}{uuid.uuid4().hex}", model, int(time.time())

    def whole(self, text: str, done: Done) -> dict:
        return {**self._head(self.OBJECT), "choices": [self._choice(text, done.finish_reason, whole=True)],
                "usage": done.usage}

    def opening(self) -> dict | None:
        """The chunk a stream begins with, before any text (the assistant's role)."""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                            "logprobs": None})

    def piece(self, text: str) -> dict:
        return self._chunk(self._choice(text, None))

    def closing(self, finish_reason: str) -> dict:
        return self._chunk(self._choice(None, finish_reason))

    def usage(self, usage: dict) -> dict:
        """The chunk with the usage and no choices, as `stream_options.include_usage` asks."""
        return {**self._chunk(None), "usage": usage}

    def _choice(self, text: str | None, finish_reason: str | None, whole: bool = False) -> dict:
        if whole:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"delta": {} if text is None else {"content": text}}
        return {"index": 0, **content, "finish_reason": finish_reason, "logprobs": None}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict | None) -> dict:
        return {**self._head(self.CHUNK), "choices": [] if choice is None else [choice]}


class TextAnswer(Answer):
    """The shapes of one completion's answer (`/v1/completions`): a choice's text, whole or in chunks
    (every one a "text_completion", as OpenAI's and vLLM's are)."""

    PREFIX, OBJECT, CHUNK = "cmpl-", "text_completion", "text_completion"

    def opening(self) -> None:
        return None  # (a completion's stream has no role to announce)

    def _choice(self, text: str | None, finish_reason: str | None, whole: bool = False) -> dict:
        return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def body_of(request: Request) -> bytes:
    """The request's body, refused with a 413 past MAX_BODY_BYTES (before it is all read, where it says its size)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is {int(declared):,} bytes; at most {MAX_BODY_BYTES:,} are taken")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES:,} bytes")
    return bytes(body)


def server(chat: LiveChat, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
           model: str | None = None, max_waiting: int = MAX_WAITING) -> uvicorn.Server:
    """The server of `chat` (not yet running): `model` is the name clients ask for (default: the
    settings' model). Its decoding thread runs while the server does (the application's lifespan)."""
    model = model or chat.settings.model
    routes = Routes(chat, Decoder(chat, max_waiting, model), model, api_key)
    return uvicorn.Server(uvicorn.Config(routes.application(), host=host, port=port, log_level="warning",
                                         access_log=False, timeout_graceful_shutdown=1))


def serve(chat: LiveChat, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          model: str | None = None, max_waiting: int = MAX_WAITING) -> None:
    """Serve `chat` until interrupted (Ctrl-C, SIGTERM: uvicorn ends the requests under way first)."""
    log.info(f"serving {model or chat.settings.model} ({chat.settings.method}) at http://{host}:{port}/v1")
    server(chat, host, port, api_key, model, max_waiting).run()
