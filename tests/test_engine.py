"""Plain decoding on the engine, on both of its layouts: identical to a cache-free reference, and the
caches stay right."""

import pytest
import torch

from conftest import load_tiny_target
from specchat.chat import ChatFormat, Conversation
from specchat.decode.engine.engine import ContextLengthError, Engine, GenerationSettings
from specchat.decode.acceptance.sampling import SamplingParams, make_generator


def reference_greedy(model, prompt, n):
    """Greedy decoding with no cache at all: the whole sequence through the model every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def collect(engine, prompt, settings, rng=None):
    steps = list(engine.generate(prompt, settings, rng))
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def target(tiny_model_dir, layout):
    return load_tiny_target(tiny_model_dir, layout=layout)


def test_greedy_equals_cache_free_decoding(target):
    prompt = [258, 10, 20, 30, 40, 50, 198]
    tokens, steps = collect(Engine(target), prompt, GenerationSettings(max_new_tokens=25))
    assert tokens == reference_greedy(target.model, prompt, 25)
    assert steps[0].prefill and steps[-1].finish_reason == "length"
    assert all(s.target_forwards == 1 for s in steps)


def test_stop_token_ends_the_reply_and_is_counted(target):
    prompt = [258, 1, 2, 3]
    free, _ = collect(Engine(target), prompt, GenerationSettings(max_new_tokens=12))
    stop = free[5]
    tokens, steps = collect(Engine(target), prompt, GenerationSettings(max_new_tokens=12, stop_ids=frozenset({stop})))
    assert tokens == free[: free.index(stop) + 1]
    assert steps[-1].finish_reason == "stop"


def test_multi_turn_reuses_the_cache_and_matches_a_fresh_engine(target):
    chat = ChatFormat(target.tokenizer)
    settings = GenerationSettings(max_new_tokens=8, stop_ids=chat.stop_ids)
    conversation = Conversation(system="sys")
    engine = Engine(target)
    for turn in ["first question", "second one", "third"]:
        conversation.add_user(turn)
        prompt = chat.prompt_ids(conversation)
        tokens, steps = collect(engine, prompt, settings)
        assert tokens == collect(Engine(target), prompt, settings)[0]
        conversation.add_assistant(target.tokenizer.decode(tokens, skip_special_tokens=True))
        assert engine.cache.length == len(engine.context_ids)


def test_an_abandoned_reply_leaves_consistent_caches(target):
    settings = GenerationSettings(max_new_tokens=20)
    engine = Engine(target)
    stream = engine.generate([258, 5, 6, 7], settings)
    for _ in range(4):
        next(stream)
    stream.close()  # what Ctrl-C does to the consumer's loop
    assert engine.cache.length == len(engine.context_ids)
    prompt = [258, 5, 6, 7, 9, 9]
    assert collect(engine, prompt, settings)[0] == collect(Engine(target), prompt, settings)[0]


def test_seeded_sampling_is_reproducible_and_varies_across_prompts_of_a_run(target):
    settings = GenerationSettings(max_new_tokens=15, sampling=SamplingParams(temperature=1.0))
    prompt = [258, 40, 41, 42]
    run_a = make_generator(3)
    first = collect(Engine(target), prompt, settings, run_a)[0]
    second = collect(Engine(target), prompt, settings, run_a)[0]
    again = collect(Engine(target), prompt, settings, make_generator(3))[0]
    assert first == again
    assert first != second  # one stream per run: a repeated prompt gets an independent sample


def test_prompt_longer_than_context_is_refused(target):
    with pytest.raises(ContextLengthError, match="context holds 512"):
        next(Engine(target).generate([1] * 600, GenerationSettings()))


def test_reply_is_capped_by_the_context(target):
    tokens, steps = collect(Engine(target), [1] * 505, GenerationSettings(max_new_tokens=50))
    assert len(tokens) == 7 and steps[-1].finish_reason == "length"
