"""DEAGLE, Jakiro, SpS and PLD on both of the engine's layouts: lossless greedy output, exact sampling,
and their own mechanics."""

from types import SimpleNamespace

import pytest
import torch

from conftest import (STOPPED_AT, GivenCurve, assert_samples_follow_the_target, load_tiny_target, oracle_head,
                      random_head, stop_the_clock, tokens_of)
from specchat.decode.drafting.deagle import DeagleParams, DepthVote
from specchat.decode.drafting import draft_model, heads, prompt_lookup
from specchat.decode.drafting.draft_model import TokenizerMismatch, check_tokenizers
from specchat.decode.drafting.lookup import LookupSource
from specchat.decode.drafting.pace import Arm
from specchat.decode.drafting.tree import Cycle, Source
from specchat.decode.acceptance.sampling import SamplingParams
from specchat.decode.drafting.shapes import DeagleTree, DynamicTreeParams, JakiroTree
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.engine.staged import StagedDraftModel

PROMPTS = [[258, 10, 20, 30, 40, 50, 198], [258, 99], [258] + list(range(60, 110)) + list(range(60, 80))]
TREE = DynamicTreeParams(total_tokens=16, depth=5, top_k=4)


@pytest.fixture(scope="module")
def target(qwen_dir, layout):
    return load_tiny_target(qwen_dir, layout=layout)


@pytest.fixture(scope="module")
def bigram(bigram_dir, layout):
    return load_tiny_target(bigram_dir, layout=layout)


def make(method, model, head=None, draft=None):
    if method == "deagle":
        return heads.for_target(head or random_head("eagle3", model), model, DeagleTree(TREE, DeagleParams()))
    if method == "jakiro":
        return heads.for_target(head or random_head("jakiro", model), model, JakiroTree(TREE))
    if method == "jakiro-reference":
        return heads.for_target(head or random_head("jakiro", model), model,
                                JakiroTree(TREE, reference_attach=True))
    if method == "sps":
        return draft_model.for_target(draft or model, model, draft_tokens=4)
    if method == "staged":  # sps whose draft model drafts its chains itself, with a head of its own
        if model.envelope is not None:
            pytest.skip("staged sps runs on the growing layout")
        draft = draft or model
        own = heads.for_target(head or random_head("eagle3", draft), draft, DeagleTree(TREE, DeagleParams()))
        return StagedDraftModel(Engine(draft, own), model, draft_tokens=4)
    return prompt_lookup.for_target(model, draft_tokens=6)


@pytest.mark.parametrize("method", ["deagle", "jakiro", "jakiro-reference", "sps", "staged", "pld"])
@pytest.mark.parametrize("max_new", [1, 3, 30])
def test_greedy_equals_plain_decoding(method, max_new, target, tiny_model_dir, layout):
    draft = load_tiny_target(tiny_model_dir, layout=layout)  # a different tiny model as the sps draft
    settings = GenerationSettings(max_new_tokens=max_new)
    engine = Engine(target, make(method, target, draft=draft))
    for prompt in PROMPTS:
        assert tokens_of(engine, prompt, settings) == tokens_of(Engine(target), prompt, settings)


@pytest.mark.parametrize("method", ["deagle", "sps", "staged", "pld"])
def test_drafts_that_are_right_get_accepted(method, bigram):
    """With a perfect drafter (the oracle head, the target itself, the target drafting itself with the
    oracle head, a repeating text) cycles go deep."""
    head = oracle_head(bigram) if method in ("deagle", "staged") else None
    settings = GenerationSettings(max_new_tokens=30)
    prompt = PROMPTS[0]
    if method == "pld":  # the reply to come is already in the prompt, after the same tokens
        prompt = prompt + tokens_of(Engine(bigram), prompt, settings) + prompt
    engine = Engine(bigram, make(method, bigram, head=head))
    steps = list(engine.generate(prompt, settings))
    assert [t for s in steps for t in s.tokens] == tokens_of(Engine(bigram), prompt, settings)
    assert max(len(s.tokens) for s in steps[1:]) >= 4


@pytest.mark.parametrize("method", ["deagle", "jakiro", "sps", "staged"])
def test_sampling_follows_the_target_distribution(method, bigram, target):
    """First two tokens of sampled replies against the exact target distribution (chi-square)."""
    head = oracle_head(bigram) if method == "deagle" else None
    draft = target  # for sps: a different model, so q and p really differ
    engine = Engine(bigram, make(method, bigram, head=head, draft=draft))
    assert_samples_follow_the_target(engine, bigram, [258, 40, 41], top_k=4, runs=800)


# --- DEAGLE's vote on hand-made confidence sequences ------------------------------------------------


def run_vote(beam_probs_per_depth, verified=15, params=DeagleParams(), on_host=False):
    """Feed per-depth beam survival probabilities; return the depth and votes at which it stops."""
    vote = DepthVote(params, on_host=on_host)
    history = []
    for depth, probs in enumerate(beam_probs_per_depth, start=1):
        scores = torch.tensor(probs).log()
        history.append(scores)
        everything = torch.cat(history)
        if vote.decide(depth, scores, scores, everything, everything, verified):
            return depth, vote.history()[-1].votes
    return None, vote.history()


# Both readings of the rules: on 0-d tensors (the fixed layout: no host read) and on numbers (the
# growing layout reads each vote).
on_host = pytest.mark.parametrize("on_host", [False, True], ids=["tensors", "numbers"])


@on_host
def test_a_dying_tree_stops_early(on_host):
    # S_1 = 0.5 (rho 0.5: first decay), S_2 = 0.2 (rho 0.4: second decay -> momentum);
    # E_2 = 0.3 + 0.2 + 0.1 + 0.1 = 0.7, so depth 2 >= ceil(0.7) -> saturation. Two votes at depth 2.
    depth, votes = run_vote([[0.3, 0.2], [0.1, 0.1], [0.03, 0.02], [0.01, 0.001]], on_host=on_host)
    assert depth == 2 and set(votes) == {"momentum", "saturation"}


@on_host
def test_a_confident_tree_runs_to_the_maximum_depth(on_host):
    depth, history = run_vote([[0.99], [0.98], [0.97], [0.96], [0.95], [0.94]], on_host=on_host)
    assert depth is None and len(history) == 6
    # E_d grows along with d here, so saturation may vote, but alone it never stops the tree.
    assert all("mass" not in h.votes and "momentum" not in h.votes for h in history)


@on_host
def test_saturation_and_mass_can_stop_a_tree_without_momentum(on_host):
    # S = 0.3, 0.18, 0.11: one decay (depth 1), then rho = 0.6 and 0.61 (no second one); S_3 < 0.15
    # is the mass vote, and E_3 (best 4 nodes: 0.2 + 0.12 + 0.1 + 0.08 = 0.5) is saturated.
    depth, votes = run_vote([[0.2, 0.1], [0.12, 0.06], [0.08, 0.03]], verified=4, on_host=on_host)
    assert depth == 3 and set(votes) == {"mass", "saturation"}


@on_host
def test_momentum_readings_differ_as_documented(on_host):
    # rho = 0.9, 0.56, 0.9, 0.44, 0.9: decays (rho < 0.6) at depths 2 and 4, not consecutive.
    sequence = [[0.9], [0.5], [0.45], [0.2], [0.18]]
    lenient = DepthVote(DeagleParams(), on_host=on_host)
    strict = DepthVote(DeagleParams(consecutive=True), on_host=on_host)
    for depth, probs in enumerate(sequence, start=1):
        scores = torch.tensor(probs).log()
        lenient.decide(depth, scores, scores, scores, scores, 100)
        strict.decide(depth, scores, scores, scores, scores, 100)
    assert "momentum" in lenient.history()[3].votes and "momentum" not in strict.history()[3].votes


def test_the_two_readings_vote_alike_on_random_trees():
    """The rules on numbers and on tensors: the same stop depth and votes at every depth."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        depths = int(torch.randint(2, 7, (), generator=generator))
        width = int(torch.randint(1, 5, (), generator=generator))
        survival = torch.rand(depths, width, generator=generator).cumprod(0) * 0.9 + 1e-6
        params = DeagleParams(consecutive=bool(torch.rand((), generator=generator) < 0.5))
        verified = int(torch.randint(1, 20, (), generator=generator))
        readings = [run_vote(survival.tolist(), verified=verified, params=params, on_host=host) for host in (False, True)]
        tensors, numbers = [(depth, [h.record() for h in history] if depth is None else history)
                            for depth, history in readings]
        assert tensors == numbers


def test_deagle_trace_records_the_stop_depth_and_votes(bigram_dir):
    bigram = load_tiny_target(bigram_dir)  # the growing layout's drafter reads the votes (the fixed one reads once)
    engine = Engine(bigram, make("deagle", bigram))  # a random head: low confidence, early stops
    steps = list(engine.generate(PROMPTS[0], GenerationSettings(max_new_tokens=12)))
    records = [s.cycle.record() for s in steps[1:] if s.cycle is not None and len(s.cycle.tree)]
    assert records and all("stop_depth" in record and "depth_votes" in record for record in records)
    assert any(record.get("votes") for record in records)


# --- Jakiro's parallel last level --------------------------------------------------------------


def test_jakiro_drafts_its_last_level_without_a_forward(bigram_dir):
    """Depth D costs D - 1 draft forwards; the last level hangs under the nodes expanded last (the
    growing layout; like the fixed one, it feeds the prompt through the head in a forward of its own)."""
    bigram = load_tiny_target(bigram_dir)
    head = random_head("jakiro", bigram)
    calls = []
    original = head.forward

    def counting(*args, **kwargs):
        calls.append("forward")
        return original(*args, **kwargs)

    head.forward = counting
    both = head.forward_both
    head.forward_both = lambda *a, **k: (calls.append("both"), both(*a, **k))[1]
    proposer = heads.for_target(head, bigram, JakiroTree(DynamicTreeParams(total_tokens=40, depth=5, top_k=3)))
    engine = Engine(bigram, proposer)
    steps = list(engine.generate(PROMPTS[0], GenerationSettings(max_new_tokens=20)))
    tree = steps[1].cycle.tree
    # The prompt (read with it), then the context pass, expansions of levels 1 and 2, expansion of
    # level 3 with the two-ahead output: 4 forwards for 5 levels; the sixth call is the next cycle's.
    assert calls[:6] == ["forward", "forward", "forward", "forward", "both", "forward"]
    assert max(tree.depths) == 5


def test_parent_correct_and_reference_attachment():
    """Beam nodes whose parents sit in other rows get their own parent's row only when parent-correct."""
    from specchat.decode.drafting.growth import Growth

    # The two-ahead predictions were made at the fed beam's rows 0, 1, 2; the last beam's parents
    # sit in rows 2, 0, 1 of it.
    logp = torch.tensor([[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]])
    ids = torch.tensor([[50, 51], [60, 61], [70, 71]])
    growth = Growth(table=None, beam=torch.tensor([10, 11, 12]), beam_hidden=None, beam_entries=torch.zeros(3, 0),
                    beam_scores=[], parent_rows=torch.tensor([2, 0, 1]), two_ahead=(logp, ids))
    for reference, expected in ((False, [[70, 71], [50, 51], [60, 61]]), (True, [[50, 51], [60, 61], [70, 71]])):
        _, got = JakiroTree(reference_attach=reference)._attach_two_ahead(growth)
        assert got.tolist() == expected


# --- SpS and PLD mechanics -------------------------------------------------------------------------


def test_sps_refuses_a_draft_with_another_tokenizer(target, tmp_path):
    from conftest import build_model, build_tokenizer

    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    path = tmp_path / "draft"
    build_model("qwen2").save_pretrained(path)
    other.save_pretrained(path)
    with pytest.raises(TokenizerMismatch, match="is not the target's"):
        check_tokenizers(target, load_tiny_target(path))


def test_sps_keeps_the_draft_cache_in_step(qwen_dir, tiny_model_dir):
    """The growing layout's draft cache holds the entries it knows right (`fed`) and no more."""
    proposer = draft_model.for_target(load_tiny_target(tiny_model_dir), load_tiny_target(qwen_dir), draft_tokens=3)
    engine = Engine(load_tiny_target(qwen_dir), proposer)
    for prompt in PROMPTS:
        for step in engine.generate(prompt, GenerationSettings(max_new_tokens=10)):
            if not step.prefill:
                assert proposer.cache.length == proposer.fed <= len(proposer.context)
        assert proposer.context == engine.context_ids


FLAT = {1: 20.0, 2: 20.5, 4: 21.0, 8: 22.0, 16: 24.0}  # verifying a row more costs next to nothing
DEAR = {1: 20.0, 2: 25.0, 4: 35.0, 8: 55.0, 16: 95.0}  # ~5 ms a row, as on two AVX2 cores (docs/bench-cpu-peers)


def test_paced_sps_keeps_the_draft_cache_right_and_the_output_plain(qwen_dir, tiny_model_dir):
    """With lookup and the pace (the growing layout's), cycles are plain steps, lookup's alone (which do
    not feed the draft) and the draft's chain with lookup's branches (where the target may take a
    branch the chain did not): the draft's cache keeps only entries that a fresh prefill of the same
    context gives, and the output is plain decoding's."""
    target, draft = load_tiny_target(qwen_dir), load_tiny_target(tiny_model_dir)
    settings = GenerationSettings(max_new_tokens=24)
    proposer = draft_model.for_target(draft, target, draft_tokens=6, lookup=LookupSource(), curve=GivenCurve(FLAT),
                                      pace=True)
    engine = Engine(target, proposer)
    arms, branched = set(), 0
    for prompt in PROMPTS:
        tokens = []
        for step in engine.generate(prompt, settings):
            tokens += step.tokens
            if not step.prefill:
                arms.add(step.cycle.arm)
                branched += step.cycle.arm is Arm.MODEL and Source.LOOKUP in step.cycle.tree.sources
                assert proposer.cache.length == proposer.fed <= len(proposer.context)
        assert tokens == tokens_of(Engine(target), prompt, settings)
        assert proposer.context == engine.context_ids
        kept, rest = proposer.context[: proposer.fed], proposer.context[proposer.fed :]
        fresh = draft.new_cache()
        expected = draft.forward(torch.tensor([kept + rest]), fresh, logits_for="last").logits
        assert torch.allclose(draft.forward(torch.tensor([rest]), proposer.cache, logits_for="last").logits, expected,
                              atol=1e-5)
        proposer.rewind_cache()
    assert {Arm.PLAIN, Arm.LOOKUP, Arm.MODEL} <= arms and branched


def test_sps_keeps_only_the_draft_entries_of_the_path_the_target_took(qwen_dir, tiny_model_dir):
    """A cycle whose target took lookup's branch where the draft's chain said another token keeps the
    draft's entry of the root alone (the chain's next entries follow a token never committed); along
    the chain, the entries of the drafts it fed too."""
    target, draft = load_tiny_target(qwen_dir), load_tiny_target(tiny_model_dir)
    prompt, root = [258] + list(range(60, 80)), 90

    def cycle(prediction):
        proposer = draft_model.for_target(draft, target, draft_tokens=3, lookup=LookupSource(), curve=GivenCurve(FLAT))
        proposer.enough = lambda probs: False  # the chain at its longest
        proposer.observe(prompt, None)
        proposer.predict(prediction)  # what lookup will continue the root with
        proposer.prepare(root, 10, 10)
        return proposer, proposer.draft(root, len(prompt), None, SamplingParams(), None)

    chained, tree = cycle([])
    first = chained.drafted[0]
    chained.committed([root, first], Cycle(root, tree, [tree.tokens.index(first)], bonus=7))
    assert chained.fed == len(prompt) + 2
    other = 5 if first != 5 else 6
    branched, tree = cycle([root, other, 9])
    assert branched.drafted[0] == first and tree.sources[tree.tokens.index(other)] == Source.LOOKUP
    branched.committed([root, other], Cycle(root, tree, [tree.tokens.index(other)], bonus=7))
    assert branched.fed == len(prompt) + 1
    for proposer in (chained, branched):  # the next cycle feeds the draft what it lacks and the bonus
        kept, rest = proposer.context[: proposer.fed], proposer.context[proposer.fed :] + [7]
        expected = draft.forward(torch.tensor([kept + rest]), draft.new_cache(), logits_for="last").logits
        assert torch.allclose(draft.forward(torch.tensor([rest]), proposer.cache, logits_for="last").logits, expected,
                              atol=1e-5)


def test_staged_sps_chains_are_the_drafts_own_greedy_continuation(qwen_dir, tiny_model_dir):
    """Staged sps (the draft model drafting its chains with its own head and lookup, the target's
    lookup and the pace beside it): every chain is what the draft model's plain greedy decoding
    continues the context and the root with, whether the draft's engine caught up on the context
    first (a prefill) or went on from the root with its own cycles; the output is plain decoding's."""
    target, draft = load_tiny_target(qwen_dir), load_tiny_target(tiny_model_dir)
    own = Engine(draft, heads.for_target(random_head("eagle3", draft), draft, DeagleTree(TREE, DeagleParams()),
                                         lookup=LookupSource(), curve=GivenCurve(FLAT)))
    proposer = StagedDraftModel(own, target, draft_tokens=6, lookup=LookupSource(), curve=GivenCurve(FLAT), pace=True)
    catch_ups, prefill = [], own.prefill
    own.prefill = lambda *args: catch_ups.append(args) or prefill(*args)
    engine, settings = Engine(target, proposer), GenerationSettings(max_new_tokens=24)
    chains = went_on = 0
    for prompt in PROMPTS:
        tokens = []
        for step in engine.generate(prompt, settings):
            tokens += step.tokens
            if not step.prefill and step.cycle.arm is Arm.MODEL:
                chains += 1
                went_on += not catch_ups
                cycle_start = engine.context_ids[: len(engine.context_ids) - len(step.tokens)] + [step.cycle.root]
                assert proposer.drafted == tokens_of(Engine(draft), cycle_start,
                                                     GenerationSettings(max_new_tokens=len(proposer.drafted)))
            catch_ups.clear()
        assert tokens == tokens_of(Engine(target), prompt, settings)
    assert chains > 5 and 0 < went_on < chains


def test_a_rewind_into_the_heads_last_pass_keeps_the_newest_kept_position_pending(bigram):
    """A rewind into the positions the head's last context pass fed (staged drafting's, whenever the
    target takes part of a chain) leaves the newest kept position's feature pending, as a fresh
    prefill would compute it: the engine holds the whole kept context, and needs no catch-up forward."""
    if bigram.envelope is not None:
        pytest.skip("the fixed layout's head keeps no pending features (its cycles feed a fixed window)")
    target = bigram
    proposer = heads.for_target(oracle_head(target), target, DeagleTree(TREE, DeagleParams()))
    engine = Engine(target, proposer)
    list(engine.generate(PROMPTS[0], GenerationSettings(max_new_tokens=12)))  # cycles that take whole trees
    first, _, _ = proposer.last_fed
    assert first + 1 < proposer.consumed  # the last pass fed at least two positions
    context = engine.context_ids[: first + 2]  # the newest kept position: the pass's second
    assert engine.keep_cached_prefix(context + [7]) == len(context) and proposer.consumed == first + 1
    fresh = target.forward(torch.tensor([context]), target.new_cache(), logits_for="none",
                           feature_layers=proposer.feature_layers).features
    (pending,) = proposer.pending_features
    assert proposer.pending_tokens == context[-1:] and torch.allclose(pending, fresh[-1:], atol=1e-4)
    settings = GenerationSettings(max_new_tokens=8)
    assert tokens_of(engine, context + [7], settings) == tokens_of(Engine(target), context + [7], settings)
    engine.keep_cached_prefix(context[:1] + [7])
    assert proposer.consumed == 0 and not proposer.pending_tokens  # further back than the last pass: remade


@pytest.mark.parametrize("staged", [True, False])
def test_sps_is_staged_where_its_draft_model_has_a_head(staged, qwen_dir, tiny_model_dir, tmp_path, monkeypatch):
    """Built as chat builds it on a CPU: sps drafts through the draft model's own engine with the head
    bundled for it (DEAGLE, with lookup), unless told not to; a draft model without one, plainly."""
    from drafters import save_head
    from specchat import methods
    from specchat.proposers import build_proposer
    from specchat.settings import Settings

    target, draft = load_tiny_target(qwen_dir), load_tiny_target(tiny_model_dir)
    save_head(random_head("eagle3", draft), tmp_path / "head")
    bundled = {("deagle", str(tiny_model_dir)): str(tmp_path / "head")}
    monkeypatch.setattr(methods, "default_draft", lambda name, model: bundled.get((name, model)))
    settings = Settings(method="sps", draft=str(tiny_model_dir), lookup=True, plain_when_faster=True, staged=staged)
    proposer = build_proposer(settings, target, lambda name: draft)
    assert isinstance(proposer, StagedDraftModel) is staged and proposer.pace is not None
    if staged:
        assert proposer.engine.target is draft and proposer.engine.proposer.lookup is not None
        assert "drafts them itself with its head" in proposer.describe()
    bundled.clear()
    assert not isinstance(build_proposer(settings, target, lambda name: draft), StagedDraftModel)


@pytest.mark.parametrize("costs,step_ms,probs,ends", [
    (DEAR, 2.0, [0.3], True),  # a row dearer than the token it would add
    (FLAT, 2.0, [0.95, 0.95], False),  # rows nearly free, the draft sure of itself
    (FLAT, 30.0, [0.5], True),  # a draft step dearer than half a token is worth
])
def test_sps_drafts_a_chain_only_as_long_as_pays(qwen_dir, costs, step_ms, probs, ends, monkeypatch):
    """On the growing layout a chain ends where one more token would lower the cycle's expected tokens
    per millisecond, at what a draft step and a verified row cost."""
    target = load_tiny_target(qwen_dir)
    proposer = draft_model.for_target(target, target, draft_tokens=6, curve=GivenCurve(costs))
    stop_the_clock(monkeypatch, draft_model.__name__)  # ~76 ms spent would turn the first case
    proposer.started, proposer.step_ms = STOPPED_AT, step_ms  # (the cycle's start)
    assert proposer.enough([torch.tensor([p]) for p in probs]) is ends
    unsized = draft_model.for_target(target, target, draft_tokens=6)  # no curve (a GPU): chains at their length
    assert not unsized.enough([torch.tensor([0.01])])


def test_pld_proposes_what_followed_the_latest_match():
    pld = prompt_lookup.for_target(SimpleNamespace(envelope=None), draft_tokens=3, max_ngram=2)  # the growing layout's
    pld.observe([1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 8], None)
    assert pld.prepare(root=2, max_depth=10, max_nodes=10) == 3
    assert pld.draft(2, 11, None, None, None).tokens == [5, 6, 7]  # "1 2" last seen before "5 6 7"
    assert pld.prepare(root=42, max_depth=10, max_nodes=10) == 0  # no match: a plain step
    pld.rewind(4)
    assert pld.prepare(root=1, max_depth=2, max_nodes=10) == 2 and pld.draft(1, 4, None, None, None).tokens == [2, 3]


def test_pld_verifies_the_part_of_a_chain_worth_its_cost_on_this_machine(qwen_dir):
    """On a CPU whose verified tokens are dear (two AVX2 cores: a fifth of a forward each) a chain of
    lookup tokens accepted half the time is cut to one, where verifying is nearly free it is verified
    whole, and a chat that quotes its own text verifies longer chains on the dear machine too; the
    output stays plain decoding's either way."""
    flat = GivenCurve({1: 20.0, 2: 20.5, 4: 21.0, 8: 22.0, 16: 24.0})
    dear = GivenCurve({1: 20.0, 2: 25.0, 4: 35.0, 8: 55.0, 16: 95.0})  # docs/bench-cpu-peers: ~5 ms a row
    copying = [258] + list(range(60, 90)) * 3  # the answer repeats the prompt: lookup tokens are accepted
    target = load_tiny_target(qwen_dir)
    settings = GenerationSettings(max_new_tokens=30)
    plain = tokens_of(Engine(target), copying, settings)
    drafted = {}
    for name, curve in (("flat", flat), ("dear", dear)):
        pld = prompt_lookup.for_target(target, draft_tokens=8, curve=curve)
        pld.rates.counts = [[5.0, 10.0] for _ in pld.rates.BUCKETS]  # lookup tokens accepted half the time
        pld.observe(copying, None)
        pld.prepare(root=60, max_depth=20, max_nodes=20)
        drafted[name] = len(pld.chain)
        engine = Engine(target, prompt_lookup.for_target(target, draft_tokens=8, curve=curve))
        assert tokens_of(engine, copying, settings) == plain
    assert drafted["flat"] > 4 and drafted["dear"] == 1
    pld = prompt_lookup.for_target(target, draft_tokens=8, curve=dear)
    pld.rates.counts = [[19.0, 20.0] for _ in pld.rates.BUCKETS]  # a chat that quotes its own text
    pld.observe(copying, None)
    pld.prepare(root=60, max_depth=20, max_nodes=20)
    assert len(pld.chain) > 4
