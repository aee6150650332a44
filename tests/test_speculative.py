"""Speculative decoding end to end on tiny models, on both of the engine's layouts: greedy output is
exactly plain greedy output, sampled output follows the target distribution, and the caches stay consistent."""

from types import SimpleNamespace

import pytest
import torch

from conftest import (assert_samples_follow_the_target, exact_two_token_distribution, load_tiny_target, oracle_head,
                      random_head)
from specchat.chat import ChatFormat, Conversation
from specchat.decode.drafting import heads
from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams, StaticTree
from specchat.decode.engine import engine as engine_module
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.drafting.tree import MC_SIM_7B_63

PROMPTS = [[258, 10, 20, 30, 40, 50, 198], [258, 99], [258] + list(range(60, 110))]


def tokens_of(engine, prompt, settings, rng=None):
    return [t for step in engine.generate(prompt, settings, rng) for t in step.tokens]


def proposer(head, target, tree):
    if tree == "static":
        return heads.for_target(head, target, StaticTree(MC_SIM_7B_63))
    return heads.for_target(head, target, DynamicTree(DynamicTreeParams(total_tokens=16, depth=5, top_k=4)))


@pytest.fixture(scope="module")
def target(tiny_model_dir, layout):
    return load_tiny_target(tiny_model_dir, layout=layout)


@pytest.fixture(scope="module")
def bigram(bigram_dir, layout):
    return load_tiny_target(bigram_dir, layout=layout)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("max_new", [1, 2, 17, 40])
def test_greedy_equals_plain_decoding_with_random_heads(target, kind, tree, max_new):
    settings = GenerationSettings(max_new_tokens=max_new)
    engine = Engine(target, proposer(random_head(kind, target, seed=max_new), target, tree))
    for prompt in PROMPTS:
        assert tokens_of(engine, prompt, settings) == tokens_of(Engine(target), prompt, settings)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_equals_plain_decoding_with_a_head_that_is_always_right(bigram, tree):
    settings = GenerationSettings(max_new_tokens=40)
    engine = Engine(bigram, proposer(oracle_head(bigram), bigram, tree))
    for prompt in PROMPTS:
        steps = list(engine.generate(prompt, settings))
        assert [t for s in steps for t in s.tokens] == tokens_of(Engine(bigram), prompt, settings)
        # Deep acceptance really happened: full-depth paths and far fewer target forwards.
        assert max(len(s.tokens) for s in steps) == 6
        assert sum(s.target_forwards for s in steps) <= 40 / 4


@pytest.mark.parametrize("siblings", [0, 2])
def test_deep_acceptance_on_a_target_that_attends(target, siblings):
    """Drafts that are the true continuation (with wrong branches beside it) are accepted deep and
    the output stays exact: this is where wrong tree masks, positions or compaction show."""
    from conftest import ScriptedProposer

    settings = GenerationSettings(max_new_tokens=40)
    for prompt in PROMPTS:
        plain = tokens_of(Engine(target), prompt, settings)
        device = target.device if target.envelope is not None else None  # the fixed layout's trees are tensors
        engine = Engine(target, ScriptedProposer(prompt, plain, depth=5, siblings=siblings, device=device))
        steps = list(engine.generate(prompt, settings))
        assert [t for s in steps for t in s.tokens] == plain
        assert sum(s.target_forwards for s in steps) <= 1 + 40 / 6 + 1  # five drafts plus the bonus per cycle
        assert engine.cache.length == len(engine.context_ids)


def test_end_of_turn_inside_an_accepted_path_ends_the_reply_there(bigram):
    plain = tokens_of(Engine(bigram), PROMPTS[0], GenerationSettings(max_new_tokens=30))
    stop = plain[9]
    settings = GenerationSettings(max_new_tokens=30, stop_ids=frozenset({stop}))
    engine = Engine(bigram, proposer(oracle_head(bigram), bigram, "dynamic"))
    steps = list(engine.generate(PROMPTS[0], settings))
    assert [t for s in steps for t in s.tokens] == plain[: plain.index(stop) + 1]
    assert steps[-1].finish_reason == "stop"


def test_multi_turn_and_interruptions_keep_draft_and_target_caches_consistent(bigram):
    chat = ChatFormat(bigram.tokenizer)
    settings = GenerationSettings(max_new_tokens=12, stop_ids=chat.stop_ids)
    head = oracle_head(bigram)
    engine = Engine(bigram, proposer(head, bigram, "dynamic"))
    conversation = Conversation()
    for turn, interrupt_after in [("first", None), ("second", 2), ("third", None), ("fourth", 1)]:
        conversation.add_user(turn)
        prompt = chat.prompt_ids(conversation)
        stream = engine.generate(prompt, settings)
        produced = []
        for index, step in enumerate(stream):
            produced += step.tokens
            if interrupt_after is not None and index == interrupt_after:
                stream.close()
                break
        assert engine.cache.length == len(engine.context_ids)
        head = engine.proposer
        assert bigram.envelope is not None or head.cache.length == head.consumed  # the growing cache holds no scratch
        fresh = tokens_of(Engine(bigram), prompt, settings)
        assert produced == fresh[: len(produced)]
        conversation.add_assistant(bigram.tokenizer.decode(produced, skip_special_tokens=True))


@pytest.mark.parametrize("chunk", [16, 512])
def test_the_head_reads_the_prompt_with_the_prefill_and_the_reply_equals_plain_decoding(bigram, chunk, monkeypatch):
    """The growing layout feeds a prompt's positions through the head while the prompt is read (chunk
    by chunk), all but the newest, which the first cycle's context pass pairs with the root."""
    if bigram.envelope is not None:
        pytest.skip("the fixed layout feeds the prompt at its first cycle")
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    settings = GenerationSettings(max_new_tokens=20)
    engine = Engine(bigram, proposer(oracle_head(bigram), bigram, "dynamic"))
    prompt = PROMPTS[2]
    stream = engine.generate(prompt, settings)
    produced = next(stream).tokens  # the prefill's
    head = engine.proposer
    assert head.consumed == head.cache.length == len(prompt) - 1 and head.pending_tokens == prompt[-1:]
    produced += [token for step in stream for token in step.tokens]
    assert produced == tokens_of(Engine(bigram), prompt, settings)


def test_greedy_cycles_report_what_was_drafted_and_accepted(bigram):
    engine = Engine(bigram, proposer(oracle_head(bigram), bigram, "dynamic"))
    steps = list(engine.generate(PROMPTS[1], GenerationSettings(max_new_tokens=20)))
    for step in steps[1:]:
        cycle = step.cycle
        assert step.draft_tokens == len(cycle.tree) <= 15
        assert step.drafted == [True] * len(cycle.accepted) + [False]
        assert step.tokens[:-1] == [cycle.tree.tokens[i] for i in cycle.accepted]
        assert step.tokens[-1] == cycle.bonus
        record = cycle.record()
        assert set(record) >= {"root", "tokens", "parents", "probs", "depths", "accepted", "bonus"}


@pytest.mark.parametrize("case", ["eagle-often-right", "eagle3-random"])
def test_sampled_first_two_tokens_follow_the_target_distribution(case, bigram, qwen_dir, layout):
    """Exact p(x1, x2) of the target against the speculative engine's samples (chi-square)."""
    if case == "eagle-often-right":
        model, head = bigram, oracle_head(bigram)
    else:
        model = load_tiny_target(qwen_dir, layout=layout)
        head = random_head("eagle3", model, seed=3)
    runs, drafted = 1500, []
    engine = Engine(model, proposer(head, model, "dynamic"))  # one engine: every run reuses the cached prompt
    assert_samples_follow_the_target(engine, model, [258, 40, 41], top_k=4, runs=runs, seed=0, drafted=drafted)
    if case == "eagle-often-right":
        assert drafted[0] > runs / 4  # the second token really came from accepted drafts often


class SamplesFrom:
    """An 'engine' whose replies' first two tokens follow `joint` (exactly, by construction)."""

    def __init__(self, joint: dict):
        self.pairs, self.probs = list(joint), torch.tensor(list(joint.values()))

    def generate(self, prompt, settings, rng):
        yield SimpleNamespace(tokens=list(self.pairs[int(torch.multinomial(self.probs, 1, generator=rng))]))


def test_the_sampling_check_catches_a_biased_sampler_at_the_engine_tests_sample_size(bigram):
    """The power of the check above, two samples and pooled rare pairs included, at the fewest runs
    an engine test uses (600, test_hybrid): replies at temperature 1.5 instead of 1 are rejected
    (statistic ~150 against a bound of 26), replies at temperature 1 are not."""
    prompt = [258, 40, 41]
    assert_samples_follow_the_target(SamplesFrom(exact_two_token_distribution(bigram, prompt, 4)), bigram, prompt,
                                     top_k=4, runs=600)
    biased = SamplesFrom(exact_two_token_distribution(bigram, prompt, 4, temperature=1.5))
    with pytest.raises(AssertionError, match="do not follow the distribution"):
        assert_samples_follow_the_target(biased, bigram, prompt, top_k=4, runs=600)
