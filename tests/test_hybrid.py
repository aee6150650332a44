"""Hybrid drafting: lookup continuations and head drafts in one tree, lossless whatever the lookup
proposes (on both of the engine's layouts), with the lookup found in the conversation and in the
chat's earlier text."""

import pytest
import torch

from conftest import (FLAT_COSTS, GivenCurve, assert_samples_follow_the_target, load_tiny_target, random_head,
                      stop_the_clock, tokens_of)
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.drafting import heads
from specchat.decode.drafting.pace import Arm, Found, Pace
from specchat.decode.drafting.selection import Candidates
from specchat.decode.drafting.trust import ContradictedLookups, HeadTrust, LookupRates
from specchat.decode.drafting.growth import CandidateTable, Growth
from specchat.decode.drafting.shapes import DeagleTree, DynamicTreeParams
from specchat.decode.drafting.deagle import DeagleParams
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.drafting.lookup import LookupSource, Match, paths
from specchat.decode.drafting.tree import Cycle, DraftTree, Source
from specchat.stats import Stats

PROMPT = [258, 10, 20, 30, 40, 50, 198]


@pytest.fixture(scope="module")
def bigram(bigram_dir, layout):
    return load_tiny_target(bigram_dir, layout=layout)


class ScriptedLookup(LookupSource):
    """Proposes the script's continuation after the context, right, wrong or half right."""

    def __init__(self, script: list[int], kind: str):
        super().__init__()
        self.script, self.kind = script, kind

    def matches(self, root, limit, count=1, tree=False):
        start = len(self.context_ids) + 1
        right = self.script[start : start + limit]
        if self.kind == "wrong":
            right = [(t + 5) % 250 for t in right]
        elif self.kind == "half":
            right = right[: len(right) // 2] + [(t + 5) % 250 for t in right[len(right) // 2 :]]
        return [Match(right, evidence=4)] if right else []


def hybrid(target, lookup, curve=FLAT_COSTS, pace=False):
    """A hybrid drafter on a fresh curve of these costs, as given (the growing layout's: the fixed one
    verifies its whole budget)."""
    head = random_head("eagle3", target)  # a poor head: whatever is accepted beyond it came from the lookup
    shape = DeagleTree(DynamicTreeParams(total_tokens=8, depth=3, top_k=3), DeagleParams())
    return heads.for_target(head, target, shape, lookup=lookup,
                            curve=GivenCurve(curve) if curve and target.envelope is None else None,
                            pace=pace)


@pytest.mark.parametrize("kind", ["right", "wrong", "half"])
@pytest.mark.parametrize("curve", [FLAT_COSTS, None])
def test_greedy_output_is_plain_whatever_the_lookup_proposes(bigram, kind, curve):
    settings = GenerationSettings(max_new_tokens=30)
    plain = tokens_of(Engine(bigram), PROMPT, settings)
    proposer = hybrid(bigram, ScriptedLookup(PROMPT + plain, kind), curve)
    stats = Stats()
    tokens = []
    for step in Engine(bigram, proposer).generate(PROMPT, settings):
        stats.add_step(step)
        tokens += step.tokens
    assert tokens == plain
    if kind == "right":
        assert stats.accepted_from_lookup >= 10 and stats.tau > 2
    if kind == "wrong":
        assert stats.accepted_from_lookup == 0


def test_sampling_with_lookup_follows_the_target_distribution(bigram):
    prompt = [258, 40, 41]
    greedy = tokens_of(Engine(bigram), prompt, GenerationSettings(max_new_tokens=3))
    engine = Engine(bigram, hybrid(bigram, ScriptedLookup(prompt + greedy, "half")))
    assert_samples_follow_the_target(engine, bigram, prompt, top_k=4, runs=600)


def test_a_lookup_chain_merges_with_the_heads_nodes_where_they_agree():
    candidates = Candidates(tokens=[5, 6, 7], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.3, 0.5],
                            scores=[-0.69, -1.2, -1.39])
    candidates.add_chain([5, 7, 9, 9, 9], [0.9] * 5, [6] * 5)
    H, L, B = Source.HEAD, Source.LOOKUP, Source.BOTH
    assert candidates.sources == [B, H, B, L, L, L]
    tree = candidates.select(5)
    assert all(p < i for i, p in enumerate(tree.parents))  # connected, parents first
    assert tree.depths[-1] >= 3 and Source.LOOKUP in tree.sources  # the chain goes past the head's depth


def test_the_values_read_before_a_chain_joins_are_not_reused_after():
    def head_nodes():
        return Candidates(tokens=[5, 6, 7], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.3, 0.5],
                          scores=[-0.69, -1.2, -1.39])

    read_early, fresh = head_nodes(), head_nodes()
    assert read_early.values(0.8) == fresh.values(0.8)
    for candidates in (read_early, fresh):  # merges with 5 and 7 (their scores rise) and adds a node
        candidates.add_chain([5, 7, 9], [0.9] * 3, [6] * 3)
    fresh = Candidates(fresh.tokens, fresh.parents, fresh.depths, fresh.probs, fresh.scores, fresh.sources,
                       fresh.evidence, fresh.shares)
    assert read_early.values(0.8) == fresh.values(0.8) and len(read_early.values(0.8)) == 4


def test_the_budget_verifies_a_long_confident_chain_and_little_of_a_weak_one():
    def chain(accept):
        candidates = Candidates([], [], [], [], [])
        candidates.add_chain(list(range(100, 116)), [accept] * 16, [8] * 16)
        return candidates

    steep = Curve({1: 10.0, 2: 13.0, 4: 19.0, 8: 31.0, 16: 55.0})
    assert len(chain(0.95).select_for_rate(steep, 3.0, 64)) >= 8
    assert len(chain(0.2).select_for_rate(steep, 3.0, 64)) <= 1


def test_lookup_only_adds_to_the_heads_own_tree():
    def candidates(accept):
        # The head's four nodes are unlikely (what an under-trained head proposes); lookup's chain is not.
        found = Candidates(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3],
                           probs=[0.3, 0.2, 0.3, 0.3], scores=[-1.2, -1.6, -2.4, -3.6])
        heads_tree = found.best(4)
        found.add_chain([9, 10, 11, 12, 13, 14], [accept] * 6, [8] * 6)
        return found, heads_tree

    steep = Curve({1: 10.0, 2: 13.0, 4: 19.0, 8: 31.0, 16: 55.0})
    found, heads_tree = candidates(0.95)
    tree = found.select_for_rate(steep, 3.0, 64, kept=heads_tree)
    assert [tree.tokens[i] for i, s in enumerate(tree.sources) if s == Source.HEAD] == [5, 6, 7, 8]
    assert tree.sources.count(Source.LOOKUP) >= 4 and all(p < i for i, p in enumerate(tree.parents))
    found, heads_tree = candidates(0.05)
    assert sorted(found.select_for_rate(steep, 3.0, 64, kept=heads_tree).tokens) == [5, 6, 7, 8]


def test_the_head_is_trusted_as_far_as_its_drafts_are_accepted():
    tree = DraftTree(tokens=[5, 6, 7, 9], parents=[-1, 0, 1, -1], depths=[1, 2, 3, 1], probs=[0.9, 0.9, 0.9, 0.05],
                     sources=[Source.HEAD] * 3 + [Source.LOOKUP])  # the head's chain: expects 0.9 + 0.81 + 0.73
    sure = HeadTrust()
    for _ in range(50):
        sure.learn(Cycle(0, tree, [0, 1, 2], 8))
    assert sure.factor() == 1.0  # at most full trust (a head node never outranks its parent)
    doubtful = HeadTrust()
    for _ in range(50):
        doubtful.learn(Cycle(0, tree, [0], 8))  # one of ~2.4 expected: what sampling makes of a sure head
    assert 0.35 < doubtful.factor() < 0.55
    for _ in range(50):
        doubtful.learn(Cycle(0, tree, [3], 1))  # only lookup's node taken: the head earns nothing
    assert doubtful.factor() < 0.2


def test_siblings_count_one_acceptance_at_most_and_a_contradicted_lookup_node_counts_less():
    """One token follows a node, so its children's acceptances given it sum to at most 1 (each
    scaled with its subtree); a lookup node the head contradicts counts `lookup_trust` as often."""
    import math

    # The head: 5 (0.7) under the root, 6 (0.5) under 5; lookup's chain 9, 10 (0.6 each) under the root.
    found = Candidates(tokens=[5, 6], parents=[-1, 0], depths=[1, 2], probs=[0.7, 0.5],
                       scores=[math.log(0.7), math.log(0.35)])
    found.add_chain([9, 10], [0.6, 0.6], [3, 4])
    assert found.sources == [Source.HEAD, Source.HEAD, Source.LOOKUP, Source.LOOKUP]
    value = found.values()
    assert value == pytest.approx([0.7 / 1.3, 0.35 / 1.3, 0.6 / 1.3, 0.36 / 1.3])  # the root's 1.3 scaled to 1
    value = found.values(lookup_trust=0.5)  # 9 contradicts the head's 5; 10 has no head sibling
    assert value == pytest.approx([0.7, 0.35, 0.3, 0.18])
    assert all(value[node] <= value[parent] for node, parent in enumerate(found.parents) if parent >= 0)
    alone = Candidates(tokens=[5], parents=[-1], depths=[1], probs=[0.4], scores=[math.log(0.4)])
    alone.add_chain([5, 11], [0.5, 0.6], [3, 4])  # lookup agrees with the head: BOTH, then its own child
    assert alone.values(lookup_trust=0.1) == pytest.approx([0.5, 0.3])  # nothing contradicted


def test_lookup_nodes_the_head_contradicts_are_trusted_as_far_as_they_are_accepted():

    tree = DraftTree(tokens=[5, 9, 6], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.6, 0.5],
                     sources=[Source.HEAD, Source.LOOKUP, Source.LOOKUP])  # 9 contradicts 5; 6 has no head sibling
    doubted = ContradictedLookups()
    for _ in range(60):
        doubted.learn(Cycle(0, tree, [0, 2], 8))  # the head's 5, then lookup's 6: the contradicted 9 not taken
    assert doubted.factor() < 0.2
    trusted = ContradictedLookups()
    for _ in range(60):
        trusted.learn(Cycle(0, tree, [1], 8))
    assert trusted.factor() == 1.0


@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_the_engine_tells_the_drafter_what_was_accepted(bigram, kind):
    """The acceptance rate of lookup nodes is learned from the cycles the engine reports (`observe`'s
    cycle): a lookup that is always right rises above the prior's 1 in 2, one always wrong falls."""
    settings = GenerationSettings(max_new_tokens=30)
    plain = tokens_of(Engine(bigram), PROMPT, settings)
    proposer = hybrid(bigram, ScriptedLookup(PROMPT + plain, kind))
    prior = proposer.rates.estimate(4)
    tokens_of(Engine(bigram, proposer), PROMPT, settings)
    assert proposer.rates.estimate(4) > 0.8 if kind == "right" else proposer.rates.estimate(4) < 0.3
    assert prior == 0.5


def test_a_less_trusted_head_gets_fewer_of_its_nodes_verified():
    found = Candidates(tokens=[5, 6, 7, 8], parents=[-1, 0, 1, 2], depths=[1, 2, 3, 4],
                       probs=[0.9, 0.9, 0.9, 0.9], scores=[-0.105, -0.211, -0.316, -0.421])
    found.add_chain([9], [0.3], [1])
    avx2 = Curve({1: 22.6, 2: 23.5, 3: 26.4, 4: 31.0, 6: 42.8, 8: 46.0, 16: 73.7})
    trusted, doubted = found.select_for_rate(avx2, 5.0, 64), found.select_for_rate(avx2, 5.0, 64, head_trust=0.3)
    assert len(doubted) < len(trusted) and all(p < i for i, p in enumerate(doubted.parents))
    assert found.select_for_rate(avx2, 5.0, 64, head_trust=1.0).tokens == trusted.tokens


def test_lookup_finds_text_that_left_the_conversation():
    source = LookupSource(max_ngram=2)
    source.observe([1, 2, 3, 4, 5, 6])
    source.rewind(0)  # a new conversation (/clear): the old one goes to the chat's history
    source.observe([9, 9, 2])
    found = source.matches(root=3, limit=3)
    assert found and found[0].tokens == [4, 5, 6] and found[0].evidence == 2  # "2 3" agreed
    source.observe([3, 7])
    assert source.matches(root=2, limit=2)[0].tokens == [3, 7]  # the conversation first, latest occurrence


def test_lookup_takes_the_longest_match_first():
    """Two occurrences of "2 3": the older agrees with four tokens of context, the latest with two."""
    source = LookupSource(max_ngram=2)
    source.observe([10, 11, 2, 3, 40, 41, 99, 2, 3, 50, 51, 98, 10, 11, 2])
    strongest, latest = source.matches(root=3, limit=2, count=2)
    assert (strongest.tokens, strongest.evidence) == ([40, 41], 4) and (latest.tokens, latest.evidence) == ([50, 51], 2)


def test_the_lookup_tree_gives_each_path_its_share_of_the_occurrences():
    follows = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5]]
    found = paths(follows, [4, 3, 3, 2], count=4)
    assert [match.tokens for match in found] == [[1, 2, 3], [1, 2, 4], [5]]  # the repeated continuation adds nothing
    assert found[0].shares == (0.75, 1.0, 2 / 3) and found[1].shares == (0.75, 1.0, 1 / 3) and found[2].shares == (0.25,)
    assert [match.evidence for match in found] == [4, 3, 2]
    assert len(paths(follows, [4, 3, 3, 2], count=2)) == 2


def test_the_lookup_trees_paths_share_their_common_nodes():
    source = LookupSource(max_ngram=1)
    source.observe([8, 7, 1, 2, 3, 9, 7, 1, 2, 4, 6, 7, 1, 2, 3, 5])  # three occurrences of 7, each after another token
    found = source.matches(root=7, limit=3, count=4, tree=True)
    assert [match.tokens for match in found] == [[1, 2, 3], [1, 2, 4]]
    candidates = Candidates([], [], [], [], [])
    rates = LookupRates()
    for match in found:
        candidates.add_chain(match.tokens, *rates.along(match))
    assert candidates.tokens == [1, 2, 3, 4] and candidates.parents == [-1, 0, 1, 1]
    assert candidates.shares == [1.0, 1.0, 2 / 3, 1 / 3]
    assert candidates.probs[3] == pytest.approx(candidates.probs[2] / 2)  # a third of the occurrences: half as likely


def test_a_lookup_rate_is_learned_per_unit_of_share():
    """Nodes taken by half the occurrences, accepted half the time: a unanimous node is then expected
    to be accepted always (the rate per unit of share is 1)."""
    rates = LookupRates()
    tree = DraftTree(tokens=[4, 5], parents=[-1, -1], depths=[1, 1], probs=[0.5, 0.5],
                     sources=[Source.LOOKUP] * 2, evidence=[6, 6], shares=[0.5, 0.5])
    for accepted in range(400):
        rates.learn(Cycle(root=1, tree=tree, accepted=[accepted % 2], bonus=0))
    assert rates.estimate(6, share=1.0) == pytest.approx(0.99) and rates.estimate(6, share=0.5) == pytest.approx(0.5, abs=0.02)


def test_forgetting_drops_the_history_too():
    """bench answers each question on its own: nothing found in an earlier question's text."""
    source = LookupSource(max_ngram=2)
    source.observe([1, 2, 3, 4, 5, 6])
    source.rewind(0)
    source.forget()
    source.observe([9, 9, 2])
    assert source.matches(root=3, limit=3) == []


def run_pace(pace, found, rates, steps):
    """`steps` steps where each arm earns its `rates` (tokens per 10 ms); returns how often each ran."""
    runs = {arm: 0 for arm in rates}
    for _ in range(steps):
        arm = pace.choose(found)
        runs[arm] += 1
        pace.learn(arm, found, tokens=rates[arm], milliseconds=10.0)
    return runs


def test_the_pace_takes_the_fastest_arm_and_tries_the_others_ever_later():
    pace = Pace(plain_ms=10.0)
    assert pace.choose(found=False) is Arm.HEAD  # nothing measured yet: the head first
    waits = []
    for _ in range(6):
        pace.learn(Arm.HEAD, False, tokens=1, milliseconds=30.0)  # a cycle: 1 token in the time of 3 plain steps
        plain_steps = 0
        while pace.choose(found=False) is Arm.PLAIN:
            pace.learn(Arm.PLAIN, False, tokens=1, milliseconds=10.0)
            plain_steps += 1
        waits.append(plain_steps)
    assert waits == [8, 16, 32, 32, 32, 32]  # each try that finds the head slower waits twice as long
    head, plain = pace.records[(Arm.HEAD, False)], pace.records[(Arm.PLAIN, False)]
    gaps, plain_steps = [], 0
    while head.rate < plain.rate:  # the text turned easy: 5 tokens a cycle, each such try followed by another soon
        if pace.choose(found=False) is Arm.PLAIN:
            pace.learn(Arm.PLAIN, False, tokens=1, milliseconds=10.0)
            plain_steps += 1
        else:
            pace.learn(Arm.HEAD, False, tokens=5, milliseconds=30.0)
            gaps.append(plain_steps)
            plain_steps = 0
    assert gaps[0] == 0 and set(gaps[1:]) == {Pace.EXPLORE} and len(gaps) < 10
    waits = []
    for _ in range(5):  # plain steps are tried again ever later in turn
        head_cycles = 0
        while pace.choose(found=False) is Arm.HEAD:
            pace.learn(Arm.HEAD, False, tokens=5, milliseconds=30.0)
            head_cycles += 1
        pace.learn(Arm.PLAIN, False, tokens=1, milliseconds=10.0)
        waits.append(head_cycles)
    assert waits == [Pace.EXPLORE - 1, 8, 16, 32, 32]  # (a plain step ran just before the head's record caught up)
    pace.learn(Arm.HEAD, False, tokens=1, milliseconds=300.0)  # drafting went slow again: plain steps ...
    assert pace.choose(found=False) is Arm.PLAIN
    pace.check_soon()  # ... until a new reply, whose first step tries every other arm
    assert pace.choose(found=False) is Arm.HEAD
    plain = pace.records[(Arm.PLAIN, False)].rate
    pace.forget()  # an unrelated conversation: nothing measured of its drafting yet, a plain step's cost kept
    assert pace.choose(found=False) is Arm.HEAD and pace.records[(Arm.PLAIN, False)].rate == plain


def test_a_new_reply_weighs_what_its_own_text_earns():
    """A head record kept whole from a reply where the head lost (a long prompt: dear cycles) kept it
    away for most of a short reply where it wins; a new reply carries CARRY of each record's weight,
    so a few good cycles of its own bring the head back (here it runs three cycles in a row from the
    reply's third cycle on; from its eleventh with its waits and records kept whole)."""
    pace = Pace(plain_ms=10.0)
    for _ in range(60):  # the first reply: the head earns 1 token in 3 plain steps' time
        arm = pace.choose(found=False)
        pace.learn(arm, False, tokens=1, milliseconds=30.0 if arm is Arm.HEAD else 10.0)
    assert pace.choose(found=False) is Arm.PLAIN
    pace.check_soon()
    cycles, heads_in_a_row = 0, 0
    while heads_in_a_row < 3:  # the next reply: the head earns 5 tokens in that time
        arm = pace.choose(found=False)
        pace.learn(arm, False, tokens=5 if arm is Arm.HEAD else 1, milliseconds=30.0 if arm is Arm.HEAD else 10.0)
        heads_in_a_row = heads_in_a_row + 1 if arm is Arm.HEAD else 0
        cycles += 1
    assert cycles <= 6


def test_with_a_continuation_found_the_pace_weighs_lookup_alone_apart_from_the_head():
    pace = Pace(plain_ms=10.0)
    # With a continuation lookup alone earns most; without one the head beats plain steps.
    with_lookup = run_pace(pace, True, {Arm.PLAIN: 1, Arm.LOOKUP: 3, Arm.HEAD: 2}, 200)
    without = run_pace(pace, False, {Arm.PLAIN: 1, Arm.HEAD: 2}, 200)
    assert with_lookup[Arm.LOOKUP] > 170 and with_lookup[Arm.HEAD] >= 1 and with_lookup[Arm.PLAIN] >= 1
    assert without[Arm.HEAD] > 170 and Arm.LOOKUP not in without
    assert pace.best_rate(found=True) == pace.records[(Arm.LOOKUP, True)].rate  # each context keeps its own records
    assert pace.best_rate(found=False) == pace.records[(Arm.HEAD, False)].rate
    # a continuation likely accepted is never passed over for a plain step, even where plain steps were fastest
    slow = Pace(plain_ms=10.0, arms=(Arm.PLAIN, Arm.LOOKUP))
    run_pace(slow, True, {Arm.PLAIN: 1, Arm.LOOKUP: 0.5}, 50)
    assert slow.choose(Found.CONTINUATION) is Arm.PLAIN
    run_pace(slow, Found.LIKELY, {Arm.LOOKUP: 0.5}, 50)
    assert slow.choose(Found.LIKELY) is Arm.LOOKUP and Found.of(True, 0.7) is Found.LIKELY
    assert Found.of(True, 0.5) is Found.CONTINUATION and Found.of(False, 0.9) is Found.NOTHING


def test_a_slower_arm_waits_its_own_contexts_steps():
    """A context that comes back now and then (one cycle in eleven finds nothing to look up) retries
    its slower arm after its own waits, not whenever the other contexts' steps have run past them."""
    pace = Pace(plain_ms=10.0)
    rates = {Arm.PLAIN: 1, Arm.HEAD: 0.5}  # without a continuation plain steps are faster
    head_tries = 0
    for _ in range(60):
        run_pace(pace, Found.LIKELY, {Arm.LOOKUP: 3, Arm.HEAD: 2}, 10)
        arm = pace.choose(Found.NOTHING)
        head_tries += arm is Arm.HEAD
        pace.learn(arm, Found.NOTHING, tokens=rates[arm], milliseconds=10.0)
    assert 3 <= head_tries <= 6  # the first try, then after 4, 8, 16 and 32 of its context's steps (21 when every step counted)


@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_every_arm_the_pace_takes_leaves_greedy_output_plain(bigram, kind):
    """Whichever arm the pace takes (here head, plain, lookup alone in turn, by script), output stays
    plain decoding's and the head's cache follows the context: drafting resumes where it left off."""
    if bigram.envelope is not None:
        pytest.skip("the pace is the growing layout's (the fixed one verifies a whole bucket every step)")
    settings = GenerationSettings(max_new_tokens=30)
    plain = tokens_of(Engine(bigram), PROMPT, settings)
    proposer = hybrid(bigram, ScriptedLookup(PROMPT + plain, kind), pace=True)
    turns = iter([Arm.HEAD, Arm.PLAIN, Arm.LOOKUP] * 30)
    proposer.pace.choose = lambda found: next(turns)
    steps = list(Engine(bigram, proposer).generate(PROMPT, settings))
    assert [t for step in steps for t in step.tokens] == plain
    stats = Stats()
    for step in steps:
        stats.add_step(step)
    assert set(stats.arms) == {"head", "plain", "lookup"}
    assert len(stats.plain_step_times) == stats.plain_steps
    if kind == "right":
        assert sum(step.drafted.count(True) for step in steps) >= 5
        lookup_alone = [step for step in steps[1:] if step.cycle.arm is Arm.LOOKUP]
        assert all(set(step.cycle.tree.sources) == {Source.LOOKUP} for step in lookup_alone)
        assert sum(len(step.tokens) for step in lookup_alone) > len(lookup_alone)  # lookup alone drafted tokens


def test_the_head_expands_a_node_only_where_its_children_are_expected_to_pay(bigram, monkeypatch):
    """With rows that cost nothing the likely node is expanded (its unlikely siblings are not); where a
    verified row costs as much as the forward, not even it: drafting stops after one level."""
    if bigram.envelope is not None:
        pytest.skip("the rate rules are the growing layout's (the fixed one drafts its whole shape)")
    # a stall of 8 ms between prepare and narrow expanded the node on the steep curve
    stop_the_clock(monkeypatch, "specchat.decode.drafting.heads.proposer", "specchat.decode.drafting.heads.growing")
    probs = torch.tensor([0.9, 0.05, 0.05])
    steep = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}
    for curve, expanded in ((FLAT_COSTS, [0]), (steep, [])):
        proposer = hybrid(bigram, None, curve)
        proposer.prepare(root=5, max_depth=6, max_nodes=30)
        table = CandidateTable.allocate(3, "cpu")
        table.write(0, torch.tensor([5, 6, 7]), -1, 1, probs.log(), probs.log())
        growth = Growth(table, beam=torch.arange(3), beam_hidden=None, beam_entries=torch.zeros(3, 6, dtype=torch.bool),
                        beam_scores=[probs.log()])
        assert proposer.narrow(growth, torch.arange(3), depth=1).tolist() == expanded


def test_a_short_replys_plain_step_is_the_median_of_those_kept_for_its_context_not_one_early_timing():
    """A reply with too few plain steps of its own takes those kept for its context length: timed ones
    where there are too few, then what later replies took there, so one slow early timing does not
    decide every later short reply's estimate."""
    from collections import deque
    from types import SimpleNamespace

    from specchat.speedup import KEPT_STEPS, TIMED_STEPS, WARMUP_STEPS, PlainStepClock

    timings = []
    engine = SimpleNamespace(cache=SimpleNamespace(length=50),
                             plain_step_seconds=lambda steps: timings.append(steps) or [0.1] + [0.020] * (steps - 1))
    clock = PlainStepClock(engine)
    assert clock.seconds_per_step(Stats()) == 0.020 and timings == [WARMUP_STEPS + TIMED_STEPS]  # timed (slow)
    assert clock.seconds_per_step(Stats(plain_step_times=[0.014] * 6)) == 0.014  # a long reply's own
    assert clock.seconds_per_step(Stats(plain_step_times=[0.015])) == 0.014  # a short one's: the kept median
    assert len(timings) == 1  # timed once
    engine.cache.length = 300  # another bucket: timed there
    assert clock.seconds_per_step(Stats()) == 0.020 and len(timings) == 2
    assert isinstance(clock.steps_by_bucket[64], deque) and clock.steps_by_bucket[64].maxlen == KEPT_STEPS


def test_a_plain_step_is_the_median_of_a_records_own_so_one_slowed_step_moves_no_estimate():
    """The estimate takes a reply's own plain steps for plain decoding's (`PlainStepClock`): their mean
    let one step slowed by a neighbour move a reply's estimate 17% off the measured speedup."""
    first, second = Stats(plain_step_times=[0.015, 0.016]), Stats(plain_step_times=[0.015, 0.045])
    assert first.plain_step_seconds == 0.0155
    first += second
    assert first.plain_step_times == [0.015, 0.016, 0.015, 0.045] and first.plain_step_seconds == 0.0155
    assert Stats().plain_step_seconds is None
