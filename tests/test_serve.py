"""`specchat serve`: OpenAI's chat completions over a real uvicorn server on the tiny model.

The server runs in a thread on a socket bound here; requests go over HTTP as a client's would.
Greedy answers are compared with `specchat run`'s for the same prompt and settings (lossless), a
stream's pieces with the whole answer, and every refusal is checked for its status and that the
server answers the next request.
"""

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from conftest import invoke, tiny  # noqa: E402
import specchat.serve as serving  # noqa: E402
from specchat.serve import app as serve_app  # noqa: E402
from specchat.cli import open_chat, resolve_settings  # noqa: E402
from specchat.decode import GenerationSettings  # noqa: E402
from specchat.serve.requests import COMPLETION_MAX_TOKENS, MAX_BODY_BYTES, ApiError, checked_request  # noqa: E402
from specchat.serve.worker import Decoder, Job, StopText  # noqa: E402

MODEL = "tiny"
PROMPT = "Say something about the sea."


def new_chat(model_dir, **overrides):
    options = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "method": "pld", "max_new_tokens": 24,
               **overrides}
    settings, profile = resolve_settings(options)
    return open_chat(settings, profile)


@contextlib.contextmanager
def running(chat, **options):
    """A server of `chat` in a thread; yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = serve_app.server(chat, model=MODEL, **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def request(port, method, path, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON body or the raw text) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def ask(port, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **fields}
    return request(port, "POST", "/v1/chat/completions", body)


def events(port, **fields) -> list:
    """The data of each server-sent event of a streamed answer ("[DONE]" as the string)."""
    status, text = ask(port, stream=True, **fields)
    assert status == 200, text
    return [line[len("data: "):] if line.endswith("[DONE]") else json.loads(line[len("data: "):])
            for line in text.split("\n\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def chat(qwen_dir):
    return new_chat(qwen_dir)


@pytest.fixture(scope="module")
def port(chat):
    with running(chat) as port:
        yield port


def run_answer(qwen_dir, capsys, prompt=PROMPT, *extra) -> str:
    """`specchat run`'s answer to `prompt` with the same settings."""
    status, out, err = invoke(["run", "-", *tiny(qwen_dir, "--method", "pld", "--max-new-tokens", "24", *extra)],
                              capsys, pytest.MonkeyPatch(), stdin=json.dumps({"turns": [prompt]}) + "\n")
    assert status == 0, err
    return json.loads(out)["turns"][0]["response"]


def test_a_greedy_answer_is_run_s_answer_and_a_stream_carries_the_same_text(port, qwen_dir, capsys):
    status, answer = ask(port)
    assert status == 200, answer
    expected = run_answer(qwen_dir, capsys)
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    usage = answer["usage"]
    assert usage["completion_tokens"] == 24 and choice["finish_reason"] == "length"
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["specchat"]["method"] == "pld" and usage["specchat"]["target_forwards"] >= 1
    chunks = events(port, stream_options={"include_usage": True})
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[:-1] if chunk["choices"])
    assert text == expected
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-2]][-1] == "length"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 24


def test_max_tokens_system_and_history_are_the_run_record_s(port, qwen_dir, capsys):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": PROMPT}]
    status, answer = ask(port, max_tokens=5, messages=messages)
    assert status == 200, answer
    record = {"messages": messages}
    status, out, err = invoke(["run", "-", *tiny(qwen_dir, "--method", "pld", "--max-new-tokens", "5")], capsys,
                              pytest.MonkeyPatch(), stdin=json.dumps(record) + "\n")
    assert status == 0, err
    assert answer["choices"][0]["message"]["content"] == json.loads(out)["turns"][0]["response"]
    assert answer["usage"]["completion_tokens"] == 5


def test_a_stop_sequence_ends_the_answer_before_it(port):
    _, whole = ask(port)
    text = whole["choices"][0]["message"]["content"]
    at = next(i for i in range(1, len(text) - 1) if text.find(text[i:i + 2]) == i)  # two characters' first time
    stop = text[at:at + 2]
    _, stopped = ask(port, stop=[stop, "\x00never"])
    assert stopped["choices"][0]["message"]["content"] == text[:at]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    streamed = events(port, stop=stop)
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in streamed[:-1]) == text[:at]


def test_a_prediction_reaches_the_drafts_and_its_usage_is_openai_s(port, chat):
    """(That a prediction drafts, and saves forwards, is tests/test_prediction.py's: the tiny model's
    answers are bytes that are not UTF-8, which no text given back as a prediction spells.)"""
    _, plain = ask(port)
    text = plain["choices"][0]["message"]["content"]
    prediction = "The sea is " + text
    status, predicted = ask(port, prediction={"type": "content", "content": prediction})
    assert status == 200, predicted
    assert predicted["choices"][0]["message"]["content"] == text  # lossless: the prediction only drafts
    assert chat.last_turn.prediction_ids == chat.session.chat_format.prediction_ids(prediction)
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == len(prediction.encode())
    assert plain["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                          "rejected_prediction_tokens": 0}


def test_models_and_health(port):
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and [model["id"] for model in models["data"]] == [MODEL]
    assert request(port, "GET", "/health") == (200, {"status": "ok", "waiting": 0})


BAD_REQUESTS = [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": "Hi."}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                   {"role": "user", "content": "c"}]}, 400, "messages[1].role"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10_000}, 400, "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"n": 2}, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prediction": {"type": "content", "content": ""}}, 400, "prediction.content"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ({"prediction": {"type": "content", "content": "x" * 2000}}, 400, "prediction.content"),
]


@pytest.mark.parametrize("fields, status, param", BAD_REQUESTS)
def test_a_bad_request_gets_openai_s_error_and_the_server_goes_on(port, fields, status, param):
    got, body = ask(port, **fields)
    assert got == status, body
    assert body["error"]["param"] == param and body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert ask(port, max_tokens=2)[0] == 200


def test_malformed_json_and_an_oversized_body_are_refused(port):
    status, body = request(port, "POST", "/v1/chat/completions", raw=b'{"model": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = request(port, "POST", "/v1/chat/completions", raw=b" " * (MAX_BODY_BYTES + 1))
    assert status == 413, body
    assert ask(port, max_tokens=2)[0] == 200


def test_an_api_key_is_asked_of_every_client_but_health(chat):
    with running(chat, api_key="s3cret") as port:
        assert ask(port)[0] == 401
        assert request(port, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        status, body = request(port, "POST", "/v1/chat/completions", headers={"Authorization": "Bearer s3cret"},
                               body={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
        assert status == 200, body
        assert request(port, "GET", "/health")[0] == 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_answer_within_a_cycle(qwen_dir, monkeypatch, stream):
    chat = new_chat(qwen_dir, max_new_tokens=400)
    generate = chat.engine.generate

    def slowly(*args, **kwargs):  # 20 ms a step: 400 steps would take 8 s
        for step in generate(*args, **kwargs):
            time.sleep(0.02)
            yield step

    monkeypatch.setattr(chat.engine, "generate", slowly)
    with running(chat) as port:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "stream": stream,
                "max_tokens": 400}
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body))
        if stream:
            connection.getresponse().readline()  # the first event: the answer is under way
        else:
            time.sleep(0.5)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        status, answer = ask(port, max_tokens=2)  # answered once the first one ends
        assert status == 200, answer
        reasons = {dict(labels)["finished_reason"]: value for (name, labels), value in scraped(port).items()
                   if name == "specchat:request_success_total"}
        assert reasons == {"abort": 1, "length": 1}
    turns = chat.totals["pld"].turns
    assert turns == 2 and chat.totals["pld"].new_tokens < 200, "the first answer ran on after its client left"


def test_checked_request_takes_text_parts_and_joins_leading_system_messages():
    request = checked_request({"model": MODEL, "messages": [
        {"role": "system", "content": "A."}, {"role": "developer", "content": [{"type": "text", "text": "B."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there."}]}],
        "stop": "x", "seed": 3, "max_completion_tokens": 9, "stream": True,
        "stream_options": {"include_usage": True}}, MODEL)
    assert (request.system, request.history, request.user) == ("A.\n\nB.", [], "Hi there.")
    assert (request.stop, request.seed, request.max_tokens, request.stream, request.include_usage) == (
        ("x",), 3, 9, True, True)
    with pytest.raises(ApiError) as refused:
        checked_request({"messages": [{"role": "user", "content": "x"}]}, MODEL)
    assert refused.value.status == 400 and refused.value.param == "model"


def test_stop_text_holds_back_what_may_begin_a_stop_sequence():
    stops = StopText(("END", "\n\n"))
    assert stops.push("abc E") == "abc "
    assert stops.push("N") == ""
    assert stops.push("x\n") == "ENx"
    assert stops.push("\nmore") == "" and stops.stopped
    assert stops.push("after") == ""
    rest = StopText(("END",))
    assert rest.push("the EN") == "the " and rest.flush() == "EN"


def test_a_full_queue_is_a_429():
    decoder = Decoder(chat=None, max_waiting=1, model=MODEL)
    job = Job(checked_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, MODEL), [0], print)
    decoder.submit(job)
    with pytest.raises(ApiError) as refused:
        decoder.submit(job)
    assert refused.value.status == 429 and refused.value.kind == "rate_limit_error"


def test_the_command_line_asks_a_key_beyond_this_machine_and_names_the_extra(qwen_dir, capsys, monkeypatch):
    assert serving.is_local("127.0.0.1") and serving.is_local("::1") and serving.is_local("localhost")
    assert not serving.is_local("0.0.0.0") and not serving.is_local("192.168.1.2")
    status, _, err = invoke(["serve", "--host", "0.0.0.0", *tiny(qwen_dir)], capsys)
    assert status == 2 and "--api-key" in err and "SPECCHAT_API_KEY" in err
    real = serving.importlib.util.find_spec
    monkeypatch.setattr(serving.importlib.util, "find_spec", lambda name: None if name == "uvicorn" else real(name))
    status, _, err = invoke(["serve", *tiny(qwen_dir)], capsys)
    assert status == 1 and "pip install 'specchat[serve]'" in err


def test_the_command_line_hands_its_settings_to_the_server(qwen_dir, capsys, monkeypatch):
    """`specchat serve` as a user starts it: the model loads with the settings given, and the server
    gets its address and name (the routes themselves are the tests above)."""
    served = {}

    def serve(chat, host, port, api_key, model, max_waiting):
        served.update(host=host, port=port, model=model, method=chat.settings.method, max_new=chat.settings.max_new_tokens)

    monkeypatch.setattr(serve_app, "serve", serve)
    status, _, err = invoke(["serve", "--port", "8123", "--served-model-name", "mine", *tiny(qwen_dir, "--method", "pld")],
                            capsys)
    assert status == 0, err
    assert served == {"host": "127.0.0.1", "port": 8123, "model": "mine", "method": "pld", "max_new": 6}


def test_openai_s_own_client_gets_whole_and_streamed_answers(port):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                           prediction={"type": "content", "content": "The sea is wide."})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len("The sea is wide.")
    assert whole.usage.model_extra["specchat"]["method"] == "pld"
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, n=3)


def complete(port, **fields):
    return request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0, **fields})


def plain_continuation(qwen_dir, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """What plain greedy decoding continues `prompt_ids` with (text and tokens), no template."""
    chat = new_chat(qwen_dir, method="vanilla")
    generation = GenerationSettings(max_new_tokens=max_tokens, stop_ids=chat.session.chat_format.stop_ids)
    for _ in chat.complete(prompt_ids, generation=generation):
        pass
    return chat.last_turn.text, chat.last_turn.tokens


def test_a_completion_continues_the_prompt_as_it_is_as_plain_decoding_would(port, chat, qwen_dir):
    """`POST /v1/completions` (what vLLM's and SGLang's serving benchmarks and editors' code completion
    send): the prompt's own tokens, no chat template, continued losslessly; whole, streamed, or as ids."""
    ids = chat.session.chat_format.tokenizer.encode(PROMPT)
    expected, tokens = plain_continuation(qwen_dir, ids, 20)
    status, answer = complete(port, max_tokens=20)
    assert status == 200, answer
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-") and answer["model"] == MODEL
    assert answer["choices"] == [{"index": 0, "text": expected, "finish_reason": "length" if len(tokens) == 20
                                  else "stop", "logprobs": None}]
    assert chat.last_turn.prompt_ids == ids  # (no template around it)
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), len(tokens))
    assert usage["specchat"]["method"] == "pld" and "completion_tokens_details" not in usage
    assert complete(port, prompt=ids, max_tokens=20)[1]["choices"] == answer["choices"]  # the same prompt as ids
    assert complete(port, prompt=[PROMPT], max_tokens=20)[1]["choices"] == answer["choices"]
    status, text = complete(port, max_tokens=20, stream=True, stream_options={"include_usage": True})
    assert status == 200, text
    chunks = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    chunks = [json.loads(chunk) for chunk in chunks[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]) == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == answer["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(tokens)
    assert complete(port)[1]["usage"]["completion_tokens"] <= COMPLETION_MAX_TOKENS  # OpenAI's default max_tokens


def test_ignore_eos_runs_an_answer_through_its_end_of_turn_to_max_tokens(qwen_dir):
    """vLLM's and SGLang's `ignore_eos` (serving benchmarks ask a fixed length): an answer that would end
    at an end-of-turn token goes on, in both endpoints; its tokens are plain decoding's still."""
    chat = new_chat(qwen_dir)
    chat_format = chat.session.chat_format
    ids = chat_format.tokenizer.encode(PROMPT)
    _, tokens = plain_continuation(qwen_dir, ids, 12)
    ending = tokens[3]  # made an end-of-turn token: the answer would end there
    chat_format.stop_ids = frozenset({ending})
    with running(chat) as port:
        status, ended = complete(port, max_tokens=12)
        assert status == 200, ended
        assert ended["choices"][0]["finish_reason"] == "stop"
        assert ended["usage"]["completion_tokens"] == tokens.index(ending) + 1
        status, through = complete(port, max_tokens=12, ignore_eos=True)
        assert through["choices"][0]["finish_reason"] == "length" and through["usage"]["completion_tokens"] == 12
        assert chat.last_turn.tokens == tokens
        status, answer = ask(port, max_tokens=12, ignore_eos=True)
        assert status == 200 and answer["usage"]["completion_tokens"] == 12


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "prompt"),
    ({"prompt": "x" * 2000}, "prompt"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"echo": True}, "echo"),
    ({"suffix": "return x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"n": 2}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize("fields, param", BAD_COMPLETIONS)
def test_a_bad_completion_gets_openai_s_error_and_the_server_goes_on(port, fields, param):
    got, body = complete(port, **fields)
    assert got == 400, body
    assert body["error"]["param"] == param and body["error"]["message"]
    assert complete(port, max_tokens=2)[0] == 200


def test_openai_s_own_client_gets_whole_and_streamed_completions(port):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 12
    stream = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, echo=True)


def scraped(port) -> dict:
    """GET /metrics as {(sample name, labels without the model's): value}, each sample's labels naming the model."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = request(port, "GET", "/metrics")
    assert status == 200, text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == MODEL
            values[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return values


def test_metrics_count_what_the_answers_did_as_vllm_names_it(chat):
    """`GET /metrics`: vLLM's counters (`specchat:` for `vllm:`) summed over the answers: the tokens, the
    forwards, and per drafting cycle the drafts, draft tokens and accepted tokens by depth."""
    ids = chat.session.chat_format.tokenizer.encode(PROMPT)
    with running(chat) as port:
        turns, answers = [], []
        for answer in (lambda: ask(port, max_tokens=16), lambda: complete(port, prompt=ids, max_tokens=12)):
            answers.append(answer()[1])
            turns.append(chat.last_turn)
        # the prompt, its answer and the prompt again: lookup drafts the answer after its second time
        answers.append(complete(port, prompt=ids + turns[-1].tokens + ids, max_tokens=12)[1])
        turns.append(chat.last_turn)
        values = scraped(port)
    cycles = [cycle for turn in turns for cycle in turn.cycles if len(cycle.tree)]
    assert cycles, "no draft was verified: the metrics' drafting counters went untested"
    expected = {"generation_tokens_total": sum(answer["usage"]["completion_tokens"] for answer in answers),
                "prompt_tokens_total": sum(answer["usage"]["prompt_tokens"] for answer in answers),
                "target_forwards_total": sum(turn.stats.target_forwards for turn in turns),
                "spec_decode_num_drafts_total": len(cycles),
                "spec_decode_num_draft_tokens_total": sum(len(cycle.tree) for cycle in cycles),
                "spec_decode_num_accepted_tokens_total": sum(len(cycle.accepted) for cycle in cycles)}
    assert {name: values["specchat:" + name, ()] for name in expected} == expected
    by_position = {int(dict(labels)["position"]): value for (name, labels), value in values.items()
                   if name == "specchat:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sum(by_position.values()) == expected["spec_decode_num_accepted_tokens_total"]
    assert all(by_position[p] >= by_position[p + 1] for p in range(len(by_position) - 1))  # a path's depths
    reasons = {dict(labels)["finished_reason"]: value for (name, labels), value in values.items()
               if name == "specchat:request_success_total"}
    assert sum(reasons.values()) == 3 and set(reasons) <= {"length", "stop"}
    assert values["specchat:e2e_request_latency_seconds_count", ()] == 3
    assert values["specchat:time_to_first_token_seconds_count", ()] == 3
    assert values["specchat:num_requests_waiting", ()] == 0 and values["specchat:num_requests_running", ()] == 0


def test_sixteen_concurrent_requests_get_their_sequential_answers(port):
    prompts = [f"Tell me about the number {n}." for n in range(16)]
    sequential = [ask(port, messages=[{"role": "user", "content": prompt}], max_tokens=10)[1] for prompt in prompts]
    answers = [None] * len(prompts)

    def one(index):
        answers[index] = ask(port, messages=[{"role": "user", "content": prompts[index]}], max_tokens=10,
                             stream=index % 2 == 1)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for index, (status, answer) in enumerate(answers):
        assert status == 200, answer
        expected = sequential[index]["choices"][0]["message"]["content"]
        if index % 2:  # streamed: the events' pieces
            answer = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                             for line in answer.split("\n\n") if line.startswith("data: {") and '"choices": [{' in line)
            assert answer == expected
        else:
            assert answer["choices"][0]["message"]["content"] == expected


def test_an_answer_that_fails_is_a_500_and_the_next_is_answered(qwen_dir, monkeypatch):
    chat = new_chat(qwen_dir)
    generate, calls = chat.engine.generate, []

    def failing_once(*args, **kwargs):  # the first answer fails after its first two steps
        calls.append(1)
        for number, step in enumerate(generate(*args, **kwargs)):
            if len(calls) == 1 and number == 2:
                raise KeyError("a bug")
            yield step

    monkeypatch.setattr(chat.engine, "generate", failing_once)
    with running(chat) as port:
        status, body = ask(port)
        assert status == 500 and body["error"]["type"] == "server_error" and "KeyError" in body["error"]["message"]
        failed = chat.last_turn.stats.new_tokens
        assert ask(port, max_tokens=2)[0] == 200
        values = scraped(port)
    reasons = {dict(labels)["finished_reason"]: value for (name, labels), value in values.items()
               if name == "specchat:request_success_total"}
    assert reasons == {"error": 1, "length": 1}
    assert failed >= 2 and values["specchat:generation_tokens_total", ()] == failed + 2  # what it made counts
