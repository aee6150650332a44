"""A chat whose method and settings change while it runs, and what it reports about itself.

`LiveChat` wraps a `ChatSession` together with the resolved `Settings` it was built from and
keeps the two in step when something changes mid-conversation (`/method`, `/set`, `/load`).
It also keeps what the chat reports: session totals per method (`/stats`), the last draft tree
(`/tree`), the plain-decoding clock behind speedup estimates and, on request, a plain engine for
exact comparisons; and the prediction every reply is given (`--predict`, `/predict`). It prints
nothing; `specchat.ui` decides how things look.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specchat.chat import ChatSession, Conversation, Turn, TurnEvent, prediction_usage
from specchat.decode import Engine, GenerationSettings, SamplingParams, make_generator
from specchat.errors import SpecchatError
from specchat.settings import (FIELDS, LIVE_KEYS, METHOD_SECTIONS, LiveChatError, Settings, method_key, parse_value,
                               show_value, with_method_of)
from specchat.methods import CHAT_METHODS, METHODS, PLAIN, MissingDraft, checked_draft, effective_draft
from specchat.proposers import build_proposer
from specchat.speedup import Comparison, PlainStepClock, compare_plainly, estimated_speedup
from specchat.stats import Stats
from specchat.transcript import load_transcript, save_transcript


@dataclass
class MethodTotals(Stats):
    """What one method did over the session (all its replies, interrupted ones included)."""

    turns: int = 0
    drafted_at_depth: list[int] = field(default_factory=list)  # [d-1]: cycles whose tree reached depth d
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: ... and had d tokens accepted
    # Decoding time (prefill left out, see `specchat.speedup`) of the replies with an estimate,
    # and plain decoding's estimated time for them; then the replies that were compared.
    estimate_seconds: float = 0.0
    estimate_plain_seconds: float = 0.0
    compared_seconds: float = 0.0
    compared_plain_seconds: float = 0.0

    def add_turn(self, stats: Stats) -> None:
        self.turns += 1
        Stats.__iadd__(self, stats)

    def add_cycle(self, depths: list[int], accepted: int) -> None:
        reached = max(depths, default=0)
        for table in (self.drafted_at_depth, self.accepted_at_depth):
            table.extend([0] * (reached - len(table)))
        for depth in range(1, reached + 1):
            self.drafted_at_depth[depth - 1] += 1
            self.accepted_at_depth[depth - 1] += accepted >= depth

    @property
    def acceptance_by_depth(self) -> list[tuple[int, int, int]]:
        """(depth, cycles with that many tokens accepted, cycles that drafted that deep)."""
        return [(d + 1, hit, reached) for d, (hit, reached) in enumerate(zip(self.accepted_at_depth,
                                                                             self.drafted_at_depth))]

    @property
    def estimated_speedup(self) -> float | None:
        return self.estimate_plain_seconds / self.estimate_seconds if self.estimate_seconds > 0 else None

    @property
    def measured_speedup(self) -> float | None:
        return self.compared_plain_seconds / self.compared_seconds if self.compared_seconds > 0 else None

    def add_estimate(self, stats: Stats, speedup: float) -> None:
        self.estimate_seconds += stats.decoding_seconds
        self.estimate_plain_seconds += stats.decoding_seconds * speedup

    def add_comparison(self, stats: Stats, speedup: float) -> None:
        self.compared_seconds += stats.decoding_seconds
        self.compared_plain_seconds += stats.decoding_seconds * speedup


@dataclass
class TurnReport:
    """What the statistics line says about one reply."""

    stats: Stats
    estimated_speedup: float | None = None
    comparison: Comparison | None = None
    prediction: tuple[int, int] | None = None  # the prediction's tokens the reply repeated, of how many


class LiveChat:
    """A `ChatSession` plus its settings, changeable mid-conversation, with session totals."""

    def __init__(self, session: ChatSession, settings: Settings, profile: str | None, load_model):
        """`load_model(name)` loads a draft model (for sps) the way the target was loaded."""
        self.session = session
        self.settings = settings
        self.profile = profile
        self.load_model = load_model
        self.totals: dict[str, MethodTotals] = {}
        self.last_turn: Turn | None = None  # the latest reply, and the method that gave it
        self.last_method: str | None = None
        self.last_cycle = None  # the newest `specchat.decode.drafting.tree.Cycle`, for /tree
        self.clock = PlainStepClock(session.engine)
        self._plain_engine: Engine | None = None
        self._proposers = {method_key(settings): session.engine.proposer}  # loaded once, reused on switching back
        self.prediction: str | None = None  # text every reply is given as its prediction (`ChatSession.reply`)
        self.prediction_name: str | None = None  # where it came from (a file), for /predict

    @property
    def engine(self) -> Engine:
        return self.session.engine

    @property
    def tokenizer(self):
        return self.engine.target.tokenizer

    # -- replies ---------------------------------------------------------------------------

    def reply(self, text: str, *, generation: GenerationSettings | None = None, rng: torch.Generator | None = None,
              prediction: str | None = None) -> Iterator[TurnEvent]:
        """Stream the reply to `text` (the session's own stream, with `ChatSession.reply`'s arguments;
        stopping early keeps the partial reply); the session totals count it once it ends. Without a
        `prediction` the chat's own is given (`set_prediction`); an empty one gives none."""
        return self.session.reply(text, on_end=functools.partial(self._count, self.settings.method),
                                  generation=generation, rng=rng,
                                  prediction=self.prediction if prediction is None else prediction)

    def complete(self, prompt: list[int], *, generation: GenerationSettings | None = None,
                 rng: torch.Generator | None = None) -> Iterator[TurnEvent]:
        """Stream the continuation of the token ids `prompt` as they are (`ChatSession.complete`: no
        template, the conversation untouched); the session totals count it as a reply."""
        return self.session.complete(prompt, on_end=functools.partial(self._count, self.settings.method),
                                     generation=generation, rng=rng)

    def _count(self, method: str, turn: Turn) -> None:
        totals = self.totals.setdefault(method, MethodTotals())
        for cycle in turn.cycles:
            totals.add_cycle(cycle.tree.depths, len(cycle.accepted))
            if len(cycle.tree):  # the last cycle of a reply may have had no room to draft
                self.last_cycle = cycle
        if turn.stats.new_tokens:
            totals.add_turn(turn.stats)
        self.last_turn, self.last_method = turn, method

    def report(self) -> TurnReport:
        """The latest reply's statistics with its estimated speedup (plain decoding has none)."""
        turn = self.last_turn
        assert turn is not None, "report() follows a reply"
        report = TurnReport(turn.stats)
        if turn.prediction_ids:
            report.prediction = (prediction_usage(turn.prediction_ids, turn.tokens)[0], len(turn.prediction_ids))
        room = self.engine.max_context - self.engine.cache.length
        if self.last_method == PLAIN or turn.stats.new_tokens < 2 or room < 8:
            return report  # nothing was decoded after the prefill, or no room to time plain steps
        stats = turn.stats
        report.estimated_speedup = estimated_speedup(stats.new_tokens, stats.seconds, stats.prefill_seconds,
                                                     self.clock.seconds_per_step(stats))
        if report.estimated_speedup is not None:
            self.totals[self.last_method].add_estimate(stats, report.estimated_speedup)
        return report

    def compare_last_turn(self) -> Comparison | None:
        """Decode the latest prompt plainly (same settings and random state) and compare; None if unfinished."""
        turn = self.last_turn
        if turn is None or not turn.finished:
            return None
        if self._plain_engine is None:
            self._plain_engine = Engine(self.engine.target)
        rng = None
        if turn.rng_state is not None:
            rng = torch.Generator(device=self.engine.target.device)
            rng.set_state(turn.rng_state)
        comparison = compare_plainly(self._plain_engine, turn.prompt_ids, turn.generation, rng, turn.tokens,
                                     turn.stats.seconds, turn.stats.prefill_seconds)
        if comparison.speedup is not None:
            self.totals[self.last_method].add_comparison(turn.stats, comparison.speedup)
        return comparison

    # -- changes ---------------------------------------------------------------------------

    def clear(self) -> None:
        """A new conversation (the system prompt stays)."""
        self.session.clear()
        self.last_turn = self.last_cycle = None

    def set_prediction(self, text: str | None, name: str | None = None) -> None:
        """Give every reply from now on `text` as its prediction (None: none); `name` says where it came from."""
        self.prediction, self.prediction_name = text or None, name if text else None

    def set_system(self, text: str | None) -> None:
        self.session.conversation.system = text
        self.settings = dataclasses.replace(self.settings, system=text)

    def switch_method(self, name: str, draft: str | None = None) -> None:
        """Decode with another method from now on; its draft is loaded on first use."""
        if name not in CHAT_METHODS:
            raise LiveChatError(f"unknown method {name!r} (known: {', '.join(CHAT_METHODS)})")
        changes = {"method": name}
        if draft is not None:
            changes.update(draft=draft, draft_kind=None)
        self._apply(dataclasses.replace(self.settings, **changes))

    def set_value(self, key: str, value) -> None:
        """`/set KEY VALUE`: check the value, then apply it (or change nothing)."""
        if key not in LIVE_KEYS:
            raise LiveChatError(f"cannot set {key!r} here; /set takes {', '.join(LIVE_KEYS)}")
        self._apply(dataclasses.replace(self.settings, **{key: parse_value(key, value)}), reseed=key == "seed")

    def _apply(self, candidate: Settings, reseed: bool = False) -> None:
        """Make `candidate` the settings: check everything first, then change the session.

        `reseed` restarts the random stream from the seed even if the seed did not change.
        """
        generation = self._generation(candidate)
        if method_key(candidate) != method_key(self.settings):
            self._install_proposer(candidate)
        if reseed or candidate.seed != self.settings.seed:
            self.session.rng = make_generator(candidate.seed, self.engine.target.device)
        if not candidate.compare:
            self._plain_engine = None  # its cache is as large as the conversation's
        self.session.settings = generation
        self.settings = candidate

    def _generation(self, candidate: Settings) -> GenerationSettings:
        """The generation settings `candidate` gives (its values were checked where they were parsed,
        `settings.parse_value`, so this cannot fail)."""
        sampling = SamplingParams(candidate.temperature, candidate.top_p, candidate.top_k)
        return GenerationSettings(candidate.max_new_tokens, sampling, self.session.settings.stop_ids)

    def _install_proposer(self, candidate: Settings) -> None:
        key = method_key(candidate)
        if key in self._proposers:
            proposer = self._proposers[key]
            if proposer is not None:
                proposer.rewind(0)  # it may have followed another conversation while set aside
        else:
            proposer = self._build_proposer(candidate)
        self.engine.set_proposer(proposer)
        self._proposers[key] = proposer

    def _build_proposer(self, candidate: Settings):
        try:
            checked_draft(candidate)
            return build_proposer(candidate, self.engine.target, self.load_model, self.session.answers)
        except MissingDraft as missing:
            raise LiveChatError(f"{missing.method} needs {missing.draft}: /method {missing.method} DRAFT") from missing
        except SpecchatError as error:  # a method that cannot run, a head or model that cannot load
            raise LiveChatError(str(error)) from error

    # -- transcripts -----------------------------------------------------------------------

    def save(self, path: str):
        """Write the conversation and settings as a JSON transcript (atomically); returns the path."""
        return save_transcript(path, self.session.conversation.messages, dataclasses.asdict(self.settings),
                               self.profile)

    def load(self, path: str) -> list[str]:
        """Restore a transcript's messages and settings; returns notes on what could not be restored."""
        document = load_transcript(path)
        saved = document.get("settings", {})
        notes = []
        try:
            candidate = dataclasses.replace(self.settings, **{key: parse_value(key, saved[key])
                                                              for key in (*LIVE_KEYS, "system") if key in saved})
        except LiveChatError as error:
            raise LiveChatError(f"{path}: {error}") from error
        if saved.get("model") not in (None, self.settings.model):
            notes.append(f"saved with model {saved['model']}; continuing with {self.settings.model}")
        try:
            method_settings = {name: parse_value(name, saved[name]) for name, f in FIELDS.items()
                               if f.metadata["section"] in METHOD_SECTIONS and name in saved}
            self._apply(dataclasses.replace(candidate, **method_settings), reseed="seed" in saved)
        except LiveChatError as error:
            notes.append(f"kept method {self.settings.method}: {error}")
            self._apply(with_method_of(candidate, self.settings), reseed="seed" in saved)
        self.session.conversation = Conversation(system=candidate.system,
                                                 messages=[dict(message) for message in document["messages"]])
        self.last_turn = self.last_cycle = None
        return notes

    # -- what it runs with -----------------------------------------------------------------

    def describe(self) -> list[tuple[str, str]]:
        """/show: model, draft, method, drafting, settings and conversation, as (name, value) rows."""
        settings, target, proposer = self.settings, self.engine.target, self.engine.proposer
        rows = [
            ("model", f"{settings.model}  (context {target.max_context})"),
            ("runtime", target.runtime),
            ("draft", effective_draft(settings) or "-"),
            ("method", f"{settings.method}  ({METHODS[settings.method].summary})"),
        ]
        if proposer is not None:  # what the proposer really drafts: the settings, or this device's defaults
            rows.append(("drafting", proposer.describe()))
        return rows + [
            ("profile", self.profile or "-"),
            ("sampling", f"temperature {settings.temperature}, top_p {settings.top_p}, top_k {settings.top_k}, "
                         f"seed {show_value(settings.seed)}"),
            ("max_new_tokens", str(settings.max_new_tokens)),
            ("show_accept", show_value(settings.show_accept)),
            ("compare", show_value(settings.compare)),
            ("system", repr(settings.system) if settings.system else "-"),
            ("conversation", f"{len(self.session.conversation.messages)} messages, "
                             f"{len(self.engine.context_ids)} tokens cached"),
        ]
