"""The server's counters at `GET /metrics`, in Prometheus' text format (prometheus_client).

Named as vLLM names its own, `specchat:` for `vllm:`, where they count the same thing, so that the
scripts and dashboards people keep for vLLM's speculative decoding read specchat's with one word
changed. Per drafting cycle (a draft the target verified; plain steps draft nothing):

    spec_decode_num_drafts_total              cycles that verified a draft
    spec_decode_num_draft_tokens_total        draft tokens verified (a tree's nodes, a chain's tokens)
    spec_decode_num_accepted_tokens_total     of those, accepted
    spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at depth `position` (0: first)

so that mean acceptance length = 1 + accepted / drafts (vLLM's definition, over drafting cycles) and
acceptance rate = accepted / draft tokens. specchat's τ, which counts plain steps as well, is
generation tokens / `target_forwards_total`. A reply cut short by an end of turn inside an accepted
path counts what the target accepted, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from specchat.chat import Turn

PREFIX = "specchat:"
# vLLM's buckets for the time to a first token and for a request's whole time (seconds)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """The counters of one server (a registry of its own: a process may run several, as the tests do)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, waiting: Callable[[], int], running: Callable[[], int]):
        disable_created_metrics()  # (each counter's creation time, a sample per series: vLLM leaves them out too)
        self.registry = registry = CollectorRegistry()
        self.model = model
        label = ["model_name"]

        def counter(name: str, description: str, labels=()):
            return Counter(PREFIX + name, description, [*label, *labels], registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests answered.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.target_forwards = counter("target_forwards", "Target forward passes (the prefill's included): "
                                                          "generation tokens / this = τ.")
        self.requests = counter("request_success", "Requests ended, by finish reason (abort: the client left).",
                                ["finished_reason"])
        self.drafts = counter("spec_decode_num_drafts", "Drafting cycles: drafts the target verified.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens the target verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.accepted_per_position = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each depth of a draft (0: the first).",
                                             ["position"])
        self.first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                     "From a request's arrival (its wait included) to its first token.", label,
                                     buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                 "From a request's arrival (its wait included) to its end.", label,
                                 buckets=LATENCY_BUCKETS, registry=registry)
        gauges = (("num_requests_waiting", "Requests queued behind the one being answered.", waiting),
                  ("num_requests_running", "Requests being answered (one at a time).", running))
        for name, description, value in gauges:
            Gauge(PREFIX + name, description, label, registry=registry).labels(model).set_function(value)

    def answered(self, turn: Turn | None, prompt_tokens: int, finish_reason: str, first_token_seconds: float | None,
                 seconds: float) -> None:
        """Count one request's end: `turn` is what its reply did (None: nothing was decoded)."""
        model = self.model
        self.requests.labels(model, finish_reason).inc()
        self.latency.labels(model).observe(seconds)
        if first_token_seconds is not None:
            self.first_token.labels(model).observe(first_token_seconds)
        if turn is None:
            return
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(turn.stats.new_tokens)
        self.target_forwards.labels(model).inc(turn.stats.target_forwards)
        for cycle in turn.cycles:
            if not len(cycle.tree):
                continue  # a plain step: no draft
            self.drafts.labels(model).inc()
            self.draft_tokens.labels(model).inc(len(cycle.tree))
            self.accepted_tokens.labels(model).inc(len(cycle.accepted))
            for position in range(len(cycle.accepted)):
                self.accepted_per_position.labels(model, str(position)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
