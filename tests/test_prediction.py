"""Predicted outputs (OpenAI's): text a reply will mostly repeat, found by lookup like the conversation,
ranked after it and before the chat's history; lossless on both of the engine's layouts, and counted
as OpenAI counts it."""

import pytest
import torch

from conftest import FLAT_COSTS, GivenCurve, load_tiny_target, random_head
from specchat.chat import ChatFormat, prediction_usage
from specchat.decode.drafting import heads, prompt_lookup
from specchat.decode.drafting.lookup import LookupSource
from specchat.decode.drafting.shapes import DeagleTree, DynamicTreeParams
from specchat.decode.drafting.deagle import DeagleParams
from specchat.decode.engine.engine import Engine, GenerationSettings

PROMPT = [258, 10, 20, 30, 40, 50, 198]


# -- the lookup source -------------------------------------------------------------------------


def test_a_prediction_is_found_like_the_conversation():
    source = LookupSource(max_ngram=2)
    source.predict([7, 8, 1, 2, 3, 4, 5])
    source.observe([9, 1])
    found = source.matches(root=2, limit=3)
    assert found and found[0].tokens == [3, 4, 5] and found[0].evidence == 2  # "1 2" agreed
    assert source.matches(root=5, limit=3) == []  # the prediction's end: nothing follows it


def test_a_prediction_ranks_after_the_conversation_and_before_the_history():
    source = LookupSource(max_ngram=1)
    source.observe([6, 1, 2])
    source.rewind(0)  # [6, 1, 2] is the chat's history now
    source.predict([5, 1, 3])
    source.observe([4, 1, 4, 9])
    # "1" follows "6", "5" and "4" in the three places: one token of evidence each
    assert [match.tokens for match in source.matches(root=1, limit=1, count=3)] == [[4], [3], [2]]
    assert [match.tokens for match in source.matches(root=1, limit=1, count=3, tree=True)] == [[4], [3], [2]]


def test_more_evidence_outranks_the_place():
    source = LookupSource(max_ngram=2)
    source.observe([8, 1, 6])
    source.rewind(0)
    source.predict([5, 1, 7])
    source.observe([8])
    assert [match.tokens for match in source.matches(root=1, limit=1, count=2)] == [[6], [7]]  # "8 1" in the history


def test_an_empty_prediction_and_forgetting_clear_it():
    source = LookupSource(max_ngram=2)
    source.predict([1, 2, 3])
    source.observe([1])
    assert source.matches(root=2, limit=1)[0].tokens == [3]
    source.predict([])
    assert source.matches(root=2, limit=1) == []
    source.predict([1, 2, 3])
    source.predict([1, 2, 5])  # a new prediction replaces the old one
    assert [match.tokens for match in source.matches(root=2, limit=1, count=2)] == [[5]]
    source.forget()
    source.observe([1])
    assert source.matches(root=2, limit=1) == [] and source.prediction.tokens == []


# -- lossless, and faster where it is right ----------------------------------------------------


@pytest.fixture(scope="module")
def target(qwen_dir, layout):
    return load_tiny_target(qwen_dir, layout=layout)


def hybrid(target):
    """The default method's drafting: DEAGLE with lookup branches (the growing layout's paced by what it measures)."""
    head = random_head("eagle3", target)
    shape = DeagleTree(DynamicTreeParams(total_tokens=8, depth=3, top_k=3), DeagleParams())
    growing = target.envelope is None
    return heads.for_target(head, target, shape, lookup=LookupSource(),
                            curve=GivenCurve(FLAT_COSTS) if growing else None, pace=growing)


def reply(engine, prediction=None):
    """The tokens of one greedy reply and the target forwards it took."""
    steps = list(engine.generate(PROMPT, GenerationSettings(max_new_tokens=40), prediction=prediction))
    return [token for step in steps for token in step.tokens], sum(step.target_forwards for step in steps)


@pytest.mark.parametrize("method", ["pld", "hybrid"])
def test_greedy_replies_are_plain_decodings_whatever_the_prediction(target, method):
    plain, _ = reply(Engine(target))
    unrelated = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(target, prompt_lookup.for_target(target) if method == "pld" else hybrid(target))
    for prediction in (plain, unrelated, plain[5:] + unrelated[:20], None):
        assert reply(engine, prediction)[0] == plain


def test_a_right_prediction_takes_fewer_target_forwards(target):
    """pld with the plain answer as the prediction drafts it whole (deterministic: it cannot fail by chance)."""
    plain, plain_forwards = reply(Engine(target))
    engine = Engine(target, prompt_lookup.for_target(target))
    tokens, without = reply(engine)
    assert engine.proposer.source.prediction.tokens == []
    tokens_predicted, predicted = reply(engine, plain)
    assert tokens == tokens_predicted == plain
    assert predicted < without <= plain_forwards and predicted <= plain_forwards // 3
    reply(engine)  # a reply without one clears it
    assert engine.proposer.source.prediction.tokens == []


# -- counting and tokenizing -------------------------------------------------------------------


@pytest.mark.parametrize("prediction,completion,usage", [
    ([1, 2, 3, 4], [1, 2, 3, 4], (4, 0)),
    ([1, 2, 3, 4], [1, 2, 9, 3, 4, 5], (4, 0)),  # inserted tokens reject nothing
    ([1, 2, 3, 4], [1, 3], (2, 2)),
    ([1, 2, 3, 4], [4, 3, 2, 1], (1, 3)),  # in order only
    ([5, 5, 5], [5], (1, 2)),
    ([1, 2], [], (0, 2)),
    ([], [1, 2], (0, 0)),
])
def test_prediction_usage_is_openais(prediction, completion, usage):
    assert prediction_usage(prediction, completion) == usage


def test_prediction_usage_does_not_junk_common_tokens():
    """difflib's autojunk would drop a token that is over 1% of a long completion from the matches."""
    prediction = [7, 1] * 150
    assert prediction_usage(prediction, prediction) == (300, 0)


def test_prediction_ids_are_the_text_without_special_tokens(tokenizer):
    from specchat.decode.runtime.tokenizer import SnapshotTokenizer, snapshot

    text = "def f(x):\n    return x  # café"
    ours = SnapshotTokenizer(snapshot(tokenizer))
    ids = ChatFormat(tokenizer).prediction_ids(text)
    assert ids == ChatFormat(ours).prediction_ids(text) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and ChatFormat(tokenizer).prediction_ids("") == []
