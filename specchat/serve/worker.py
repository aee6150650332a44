"""The decoding thread: requests answered one at a time by the one loaded chat, as a CPU wants them.

The server's event loop takes requests, checks them (`requests`) and queues a `Job`; this thread
answers each in a fresh conversation of the `LiveChat` the command line would use (the same
profile, method, pace and statistics), a completion's prompt as it is (`LiveChat.complete`), and
hands each piece of text back to the loop as it comes.
A job is cancelled when its client goes away: the answer stops within the cycle under way (the
engine rewinds its caches as on Ctrl-C) and the next job starts.

Stop sequences are OpenAI's: the text ends before the first one, which is never sent; text that
might be the start of one is held back until it is known not to be.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specchat.chat import Conversation, Turn
from specchat.decode import GenerationSettings, SamplingParams, make_generator
from specchat.errors import SpecchatError
from specchat.live import LiveChat
from specchat.serve.metrics import Metrics
from specchat.serve.requests import ApiError, CompletionRequest
from specchat.speedup import decoding_rate
from specchat.stats import rounded
from specchat.ui import stats_line

log = logging.getLogger(__name__)

NOT_IN_USAGE = ("finish_reason", "accept_lengths")  # the choice says the first; the second grows with the answer


class StopText:
    """Text pieces cut at the first of some stop sequences, holding back what might begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        """The part of the text so far that is sure to be sent (`stopped` once a stop sequence came)."""
        if self.stopped:
            return ""
        self.pending += text
        found = [index for stop in self.stops if (index := self.pending.find(stop)) >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        held = max((size for stop in self.stops for size in range(1, len(stop))
                    if self.pending.endswith(stop[:size])), default=0)
        out, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held:]
        return out

    def flush(self) -> str:
        """What was held back, once the reply ended without a stop sequence."""
        out, self.pending = self.pending, ""
        return out


@dataclass
class Done:
    """How an answer ended: OpenAI's finish reason and usage."""

    finish_reason: str
    usage: dict


@dataclass
class Job:
    """One request on its way through the decoding thread; `send(item)` hands an item (a text piece, a
    `Done` or an `ApiError`) to the request's consumer."""

    request: CompletionRequest
    prompt: list[int]  # its token ids, as checked before it was queued (a completion's are answered as they are)
    send: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)  # (what the metrics' latencies count from)
    first_token: float | None = None  # when its reply's first token came

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @classmethod
    def on_loop(cls, request: CompletionRequest, prompt: list[int]) -> tuple[Job, asyncio.Queue]:
        """A job whose items arrive on an asyncio queue of the running event loop."""
        loop, items = asyncio.get_running_loop(), asyncio.Queue()
        return cls(request, prompt, lambda item: loop.call_soon_threadsafe(items.put_nowait, item)), items


class Decoder:
    """The thread that answers queued jobs one at a time with `chat`."""

    def __init__(self, chat: LiveChat, max_waiting: int, model: str):
        """`model`: the name the server serves under, which the metrics carry."""
        self.chat, self.max_waiting = chat, max_waiting
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running = 0  # jobs being answered: 0 or 1
        self.metrics = Metrics(model, lambda: self.waiting, lambda: self.running)
        self.thread = threading.Thread(target=self._run, name="specchat-decoder", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)

    def submit(self, job: Job) -> None:
        if self.jobs.qsize() >= self.max_waiting:
            raise ApiError(429, f"{self.max_waiting} requests are already waiting; try again shortly",
                           kind="rate_limit_error", code="server_busy")
        self.jobs.put(job)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self.count(job, "abort", None)
                continue
            self.running, before = 1, self.chat.last_turn
            try:
                done = self.answer(job)
            except ApiError as error:
                ending = error
            except (SpecchatError, ValueError) as error:  # the template refused it, it does not fit, ...
                ending = ApiError(400, str(error))
            except Exception as error:  # one failed answer must not end the thread that serves them all
                log.error(f"an answer failed: {type(error).__name__}: {error}")  # (the engine rolled its caches back)
                ending = ApiError(500, f"the answer failed: {type(error).__name__}: {error}", kind="server_error")
            else:
                ending = done
            self.running = 0
            turn = self.chat.last_turn if self.chat.last_turn is not before else None  # (None: nothing decoded)
            finish = "error" if isinstance(ending, ApiError) else "abort" if ending is None else ending.finish_reason
            self.count(job, finish, turn)  # before the client hears the end: a scrape after it sees this answer
            if ending is not None:
                job.send(ending)

    def count(self, job: Job, finish_reason: str, turn: Turn | None) -> None:
        """The job's end in the metrics (`turn`: its reply, None where nothing was decoded)."""
        first_token = None if job.first_token is None else job.first_token - job.arrived
        self.metrics.answered(turn, job.prompt_tokens, finish_reason, first_token, time.monotonic() - job.arrived)

    def generation(self, request: CompletionRequest) -> GenerationSettings:
        settings, session = self.chat.settings, self.chat.session
        sampling = SamplingParams(settings.temperature if request.temperature is None else request.temperature,
                                  settings.top_p if request.top_p is None else request.top_p,
                                  settings.top_k if request.top_k is None else request.top_k)
        return GenerationSettings(max_new_tokens=request.max_tokens or settings.max_new_tokens, sampling=sampling,
                                  stop_ids=frozenset() if request.ignore_eos else session.chat_format.stop_ids)

    def answer(self, job: Job) -> Done | None:
        """Answer `job`, sending its text as it comes; its end (None: cancelled, nothing more to send)."""
        request, chat = job.request, self.chat
        # A seed gives the request a random stream of its own; without one it continues the server's.
        rng = make_generator(request.seed, chat.engine.target.device) if request.seed is not None else None
        stops, finish = StopText(request.stop), None
        if request.prompt is not None:  # a completion: the prompt continued as it is
            events = chat.complete(job.prompt, generation=self.generation(request), rng=rng)
        else:
            chat.session.conversation = Conversation.opening(request, chat.settings.system)
            events = chat.reply(request.user, generation=self.generation(request), rng=rng,
                                prediction=request.prediction)
        try:
            for event in events:
                job.first_token = job.first_token or time.monotonic()
                if job.cancelled.is_set():
                    return None
                text = stops.push(event.text)
                if text:
                    job.send(text)
                if stops.stopped:
                    finish = "stop"
                    break
                finish = event.step.finish_reason
        finally:
            events.close()  # a stop sequence or a client gone: the engine rewinds its caches
        if not stops.stopped and (rest := stops.flush()):
            job.send(rest)
        return Done(finish or "stop", self.usage(job))

    def usage(self, job: Job) -> dict:
        """OpenAI's usage of the latest answer, specchat's numbers under "specchat" (with --compare, the
        plain decoding's too); logs the chat's statistics line."""
        chat, turn = self.chat, self.chat.last_turn
        stats, report = turn.stats, chat.report()
        accepted, size = report.prediction or (0, 0)  # (counted once, by the report)
        comparison = chat.compare_last_turn() if chat.settings.compare else None  # (None for a reply cut short)
        log.info(stats_line(stats, report.estimated_speedup, comparison, report.prediction))
        rate = decoding_rate(stats.new_tokens, stats.seconds, stats.prefill_seconds)
        predicted = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": size - accepted}
        return {
            "prompt_tokens": job.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": job.prompt_tokens + stats.new_tokens,
            **({"completion_tokens_details": predicted} if job.request.prompt is None else {}),
            "specchat": {  # `run`'s record of a turn, but for what OpenAI's answer says already or is per cycle
                "method": chat.settings.method,
                **{key: value for key, value in stats.record().items() if key not in NOT_IN_USAGE},
                "decode_tokens_per_s": rounded(rate), "estimated_speedup": rounded(report.estimated_speedup),
                **(comparison.record() if comparison is not None else {}),
            },
        }
