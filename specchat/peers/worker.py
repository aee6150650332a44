"""A bench peer's worker: OpenVINO GenAI or vLLM decoding, in that runtime's own Python environment.

`specchat.peers.process` starts it as `PYTHON -I worker.py` (isolated: it imports nothing of
specchat, only the standard library, numpy and the runtime, whose pinned versions need a virtual
environment of their own; its own folder, whose vllm.py and openvino.py are specchat's peers and not
the runtimes, is not on its path) and talks to it in JSON lines: one request per line on its standard
input, one reply per line on its standard output, in order.

    {"op": "load", "runtime": "OpenVINO GenAI" | "vLLM", "model": DIR, "draft": DIR | null,
     "lookup": N (prompt lookup of n-grams up to N; 0: none), "draft_tokens": K, "threads": N,
     "max_context": N, "eager": bool (vLLM: no torch.compile warm-up, minutes on 2 cores)}
      -> {"ok": true, "about": {what runs: versions, precision, ...}}
    {"op": "generate", "prompt": [token ids], "max_new_tokens": N, "temperature": T, "top_p": P,
     "top_k": K, "seed": S, "stop": [token ids]}
      -> {"ok": true, "tokens": [ids], "seconds": S, "first_token_seconds": S,
          "forwards": N, "draft_tokens": N, "accepted_tokens": N}
    a request that fails -> {"ok": false, "error": "one line"}; the end of the input ends the worker.

`tokens` end with the stop token where one ended the answer, as specchat's own runs count them;
`seconds` is the generation's wall time and `first_token_seconds` the time to its first token (the
prefill). `forwards`: the target's forwards (the prefill, then one per plain or speculative
step), `draft_tokens` the draft tokens they verified (0 where the runtime does not count them:
OpenVINO's prompt lookup), `accepted_tokens` those accepted (0 without speculation).
Temperature 0 is greedy. The runtimes' own output (logs, progress bars) goes to standard error,
so that standard output carries the protocol alone.
"""

import json
import os
import sys
import time
import traceback


class OpenVINO:
    """OpenVINO GenAI's LLMPipeline on an IR folder that optimum-intel exported: plain decoding, its
    prompt lookup (`lookup`), or EAGLE-3 speculation with a draft IR (`draft`)."""

    def __init__(self, request: dict):
        import openvino
        import openvino_genai

        self.genai, self.openvino = openvino_genai, openvino
        device = "CPU"
        precision = openvino.Core().get_property(device, "INFERENCE_PRECISION_HINT")
        # Its defaults as a user gets them (bf16 where the CPU has it), with two settings: the threads,
        # and a KV cache of the inference precision (its default u8 cache under bf16 inference fails
        # with a speculative pipeline).
        self.properties = {"INFERENCE_NUM_THREADS": request["threads"], "KV_CACHE_PRECISION": precision}
        extra = {}
        if request.get("draft"):
            extra["draft_model"] = openvino_genai.draft_model(request["draft"], device, **self.properties)
        if request.get("lookup"):
            extra["prompt_lookup"] = True
        self.lookup_ngram = request.get("lookup") or 0  # the longest n-gram it matches
        self.speculative = bool(extra)
        self.draft_tokens = request.get("draft_tokens") or 0
        self.pipe = openvino_genai.LLMPipeline(request["model"], device, **self.properties, **extra)
        self.about = {"runtime": "OpenVINO GenAI", "version": openvino_genai.__version__,
                      "inference_precision": precision.get_type_name(), "threads": request["threads"]}

    def generate(self, request: dict) -> dict:
        import numpy

        config = self.pipe.get_generation_config()
        config.max_new_tokens = request["max_new_tokens"]
        config.stop_token_ids = set(request["stop"])
        config.eos_token_id = request["stop"][0]
        config.ignore_eos = False
        config.do_sample = request["temperature"] > 0
        if config.do_sample:
            config.temperature = request["temperature"]
            config.top_p = request["top_p"]
            config.top_k = request["top_k"] or 0
            config.rng_seed = request["seed"]
        if self.speculative:
            config.num_assistant_tokens = self.draft_tokens
        if self.lookup_ngram:
            config.max_ngram_size = self.lookup_ngram
        start = time.perf_counter()
        # No streamer (its EAGLE-3 path streams greedy decoding only): the time to the first token is its own metric.
        result = self.pipe.generate(self.openvino.Tensor(numpy.array([request["prompt"]], dtype=numpy.int64)), config)
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in result.tokens[0]]
        # One entry per generation step (the prefill's included); prompt lookup gives no extended metrics.
        forwards = len(result.perf_metrics.raw_metrics.m_batch_sizes)
        accepted = len(tokens) - forwards  # each step gives its accepted draft tokens and one more
        # A chain drafts its length at each step after the prefill; prompt lookup only where it matches, uncounted.
        drafted = (forwards - 1) * self.draft_tokens if self.speculative and not self.lookup_ngram else 0
        stats = {"forwards": forwards, "draft_tokens": drafted, "accepted_tokens": accepted}
        return {"tokens": with_stop(tokens, request), "seconds": seconds,
                "first_token_seconds": result.perf_metrics.get_ttft().mean / 1000, **stats}


class VLLM:
    """vLLM's offline engine on the CPU, stepped one request at a time: plain decoding, or EAGLE-3
    speculation with a head in the speculators layout (`draft`)."""

    def __init__(self, request: dict):
        import torch
        import vllm
        from vllm import LLM

        speculative = None
        if request.get("draft"):
            speculative = {"method": "eagle3", "model": request["draft"],
                           "num_speculative_tokens": request["draft_tokens"]}
        # Its default dtype is the checkpoint's (bf16 here); without AVX512-BF16 its oneDNN bf16 linear
        # fails and torch's bf16 fallback decoded 0.4 tok/s (2 AVX2 cores): float32 there.
        dtype = "auto" if torch.cpu._is_avx512_bf16_supported() else "float32"
        self.llm = LLM(model=request["model"], speculative_config=speculative, max_model_len=request["max_context"],
                       max_num_seqs=1, seed=0, dtype=dtype, enforce_eager=request.get("eager", False),
                       disable_log_stats=False, enable_prefix_caching=False)
        self.engine = self.llm.llm_engine
        self.requests = 0
        self.about = {"runtime": "vLLM", "version": vllm.__version__,
                      "dtype": str(self.llm.llm_engine.model_config.dtype).removeprefix("torch."),
                      "threads": request["threads"]}

    def counters(self) -> dict:
        """vLLM's speculative-decoding counters so far (its Prometheus metrics, as `LLM.get_metrics` gives them)."""
        names = {"vllm:spec_decode_num_drafts": "forwards", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
        found = dict.fromkeys(names.values(), 0)
        for metric in self.llm.get_metrics():
            if metric.name in names:
                found[names[metric.name]] = int(metric.value)
        return found

    def generate(self, request: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = request["temperature"] == 0
        params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=request["temperature"],
                                top_p=1.0 if greedy else request["top_p"],
                                top_k=0 if greedy or not request["top_k"] else request["top_k"],
                                seed=None if greedy else request["seed"], stop_token_ids=request["stop"],
                                detokenize=False)
        before = self.counters()
        self.requests += 1
        clock = FirstToken()
        self.engine.add_request(str(self.requests), TokensPrompt(prompt_token_ids=request["prompt"]), params)
        tokens = []
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                tokens = list(output.outputs[0].token_ids)
                if tokens:
                    clock.tick()
        seconds = time.perf_counter() - clock.start
        spent = {name: count - before[name] for name, count in self.counters().items()}
        # The prefill, then a step per draft (speculative) or per token (plain).
        spent["forwards"] = 1 + spent["forwards"] if spent["forwards"] else len(tokens)
        return {"tokens": with_stop(tokens, request), "seconds": seconds,
                "first_token_seconds": clock.first or seconds, **spent}


class FirstToken:
    """The wall time from its making to the first `tick`."""

    def __init__(self):
        self.start, self.first = time.perf_counter(), None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start


def with_stop(tokens: list[int], request: dict) -> list[int]:
    """The answer's tokens as specchat counts them: at most max_new_tokens, up to and with the first
    stop token (a runtime that leaves the stop token out cannot tell which one ended the answer:
    those that do not say are given no stop token, and a shorter answer is then simply shorter)."""
    tokens = tokens[: request["max_new_tokens"]]
    for index, token in enumerate(tokens):
        if token in request["stop"]:
            return tokens[: index + 1]
    return tokens


RUNTIMES = {"OpenVINO GenAI": OpenVINO, "vLLM": VLLM}


def serve(requests, replies) -> None:
    runtime = None
    for line in requests:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                runtime = RUNTIMES[request["runtime"]](request)
                reply = {"about": runtime.about}
            elif runtime is None:
                raise RuntimeError("no model loaded (the first request must be a load)")
            else:
                reply = runtime.generate(request)
            reply["ok"] = True
        except Exception as error:  # any failure of the runtime is the reply, in one line; the log has the trace
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": " ".join(f"{type(error).__name__}: {error}".split())}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the protocol's own copy of standard output
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else prints goes to standard error
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
