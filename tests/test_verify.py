"""Acceptance: greedy follows the argmax; sampling leaves the target distribution exactly unchanged,
in both forms of the rules (the growing layout's on the host, the fixed layout's on the device).

The statistical tests compare the empirical distribution of the accepted/bonus token with p by
the shared chi-square check of conftest (`assert_follows`: p = 0.001, a second sample only after
a first failure); with the sample sizes used, a wrong rule (for example accepting with p(x)
without renormalising after a rejection, or drawing the bonus from p instead of the residual)
moves the statistic far beyond the threshold, and a test below shows that it does.
"""

import math

import pytest
import torch

from conftest import CHI2_CRITICAL, CHI2_LEVEL, assert_follows, chi_square
from specchat.decode.acceptance.sampling import SamplingParams, target_probs
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.acceptance.verify import accept, accept_fixed, ancestor_mask, follow, follow_fixed

FORMS = ["growing", "fixed"]


def accepted(form: str, tree: DraftTree, logits, sampling, rng) -> tuple[list[int], int]:
    """(path, bonus) of `tree` by `form`'s rule: `accept` on the host lists, or `accept_fixed` on the
    same tree as device tensors."""
    if form == "growing":
        out = accept(tree, logits, sampling, rng)
        return out.path, out.bonus
    n = len(tree)
    on_device = DraftTree(torch.tensor(tree.tokens), torch.tensor(tree.parents), torch.tensor(tree.depths),
                          torch.tensor(tree.probs), q=tree.q, valid=torch.ones(n, dtype=torch.bool),
                          depth=max(tree.depths), sources=None, evidence=None)
    out = accept_fixed(on_device, logits, sampling, rng, torch.tensor(n))
    return out.path[: int(out.count)].tolist(), int(out.bonus)


@pytest.mark.parametrize("form", FORMS)
def test_greedy_follows_the_argmax_down_the_tree(form):
    # root ─ 3 ─ 4        logits rows: root, node0, node1, node2
    #      └ 5
    tree = DraftTree(tokens=[3, 5, 4], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.4, 0.9])
    logits = torch.full((4, 8), -5.0)
    logits[0, 5] = 1  # the target wants 5 after the root: second child accepted
    logits[2, 6] = 1  # after node 1 (token 5) it wants 6: the bonus
    assert accepted(form, tree, logits, SamplingParams(), None) == ([1], 6)


def test_given_the_same_draws_the_device_form_accepts_what_the_host_form_does():
    """`follow_fixed` (every row's token at once, in a tree padded to a bucket) against `follow`, the
    reference, on random trees and random draws from a small vocabulary (so that children match,
    duplicate siblings included): the same path and bonus, exactly. Both `accept` forms are these
    walks over the target's tokens (argmaxes, or draws from p)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        nodes = int(torch.randint(1, 10, (1,), generator=generator))
        parents = [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(nodes)]
        depths = []
        for parent in parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        tokens = torch.randint(0, 3, (nodes,), generator=generator).tolist()
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths, probs=[0.5] * nodes)
        padding = int(torch.randint(0, 4, (1,), generator=generator))
        drawn = torch.randint(0, 3, (nodes + padding + 1,), generator=generator)
        host = follow(tree, lambda row: int(drawn[row]))
        on_device = DraftTree(torch.tensor(tokens + [0] * padding), torch.tensor(parents + [-1] * padding),
                              torch.tensor(depths + [1] * padding), torch.full((nodes + padding,), 0.5),
                              valid=torch.arange(nodes + padding) < nodes, depth=max(depths), sources=None,
                              evidence=None)
        fixed = follow_fixed(on_device, drawn, torch.tensor(nodes), ancestor_mask(on_device))
        assert (fixed.path[: int(fixed.count)].tolist(), int(fixed.bonus)) == (host.path, host.bonus), trial


def first_token_counts(form, tree, logits, sampling, draws, seed=0):
    vocab = logits.shape[-1]
    counts = torch.zeros(vocab)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        path, bonus = accepted(form, tree, logits, sampling, rng)
        first = tree.tokens[path[0]] if path else bonus
        counts[first] += 1
    return counts


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_sampled_first_token_follows_p_whatever_the_draft(sampling, form):
    torch.manual_seed(1)
    vocab = 8
    logits = torch.randn(4, vocab)
    # Three root children, deliberately including unlikely tokens, in a 'wrong' order.
    tree = DraftTree(tokens=[6, 2, 0], parents=[-1, -1, -1], depths=[1, 1, 1], probs=[0.9, 0.05, 0.05])
    p = target_probs(logits[0], sampling)
    assert_follows(lambda seed: first_token_counts(form, tree, logits, sampling, draws=20000, seed=seed), p, seed=0)


def test_a_rule_without_the_residual_would_be_caught():
    """Sanity check of the test's power: drawing the bonus from p (not the residual) is rejected,
    by the same two-sample check the lossless rules pass."""
    torch.manual_seed(1)
    logits = torch.randn(2, 8)
    sampling = SamplingParams(temperature=1.0)
    p = target_probs(logits[0], sampling)

    def flawed(seed):
        rng = torch.Generator().manual_seed(seed)
        counts = torch.zeros(8)
        for _ in range(20000):  # the flawed rule: accept 6 with p(6), else sample from p
            accepted = float(torch.rand((), generator=rng)) < float(p[6])
            counts[6 if accepted else int(torch.multinomial(p, 1, generator=rng))] += 1
        return counts

    with pytest.raises(AssertionError, match="do not follow the distribution"):
        assert_follows(flawed, p, seed=0)


@pytest.mark.parametrize("form", FORMS)
def test_sampled_chain_with_q_follows_p(form):
    """The min(1, p/q) rule with the residual max(0, p - q), for a token drawn from q."""
    torch.manual_seed(2)
    vocab = 6
    logits = torch.randn(2, vocab)
    q = torch.softmax(torch.randn(vocab) * 2, -1)
    sampling = SamplingParams(temperature=1.0)
    p = target_probs(logits[0], sampling)

    def sample(seed):
        rng = torch.Generator().manual_seed(seed)
        counts = torch.zeros(vocab)
        for _ in range(20000):
            x = int(torch.multinomial(q, 1, generator=rng))
            tree = DraftTree(tokens=[x], parents=[-1], depths=[1], probs=[float(q[x])], q=q[None])
            path, bonus = accepted(form, tree, logits, sampling, rng)
            counts[x if path else bonus] += 1
        return counts

    assert_follows(sample, p, seed=3)


# --- the shared chi-square check itself -------------------------------------------------------------


def test_a_chance_failure_is_retried_once_with_another_seed():
    p = {"a": 0.5, "b": 0.3, "c": 0.2}
    exact, off = {"a": 500, "b": 300, "c": 200}, {"a": 600, "b": 250, "c": 150}  # off: statistic 40.8 > 13.8
    seeds = []

    def unlucky_once(seed):
        seeds.append(seed)
        return off if len(seeds) == 1 else exact

    assert_follows(unlucky_once, p, seed=7)
    assert seeds == [7, 8]
    seeds.clear()
    assert_follows(lambda seed: seeds.append(seed) or exact, p, seed=7)
    assert seeds == [7]  # a first sample that passes is the only one
    with pytest.raises(AssertionError, match=r"chi-square \[40.83, 40.83\] \(seeds 7 and 8\) both above 13.816"):
        assert_follows(lambda seed: off, p, seed=7)


def test_rare_outcomes_are_pooled_and_impossible_ones_fail():
    # 100 draws expect 0.1 of "c": alone it would add (1 - 0.1)^2 / 0.1 = 8.1 for one lucky draw;
    # pooled with "b" until the cell expects at least 5 draws, it adds nothing.
    assert chi_square({"a": 50, "b": 49, "c": 1}, {"a": 0.5, "b": 0.499, "c": 0.001}) == (0.0, 1)
    with pytest.raises(AssertionError, match="zero target probability"):
        chi_square(torch.tensor([5.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.0]))


def chi_square_tail(x: float, dof: int) -> float:
    """P(X > x) for X chi-square with `dof` degrees of freedom: 1 - P(dof/2, x/2), the regularised
    lower incomplete gamma function by its power series (Abramowitz and Stegun 6.5.29)."""
    s, z = dof / 2, x / 2
    term = total = 1 / s
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (s + n)
        total += term
    return 1 - math.exp(s * math.log(z) - z - math.lgamma(s)) * total


def test_the_critical_values_are_the_upper_points_of_the_chi_square_law():
    for dof, critical in CHI2_CRITICAL.items():
        # Three decimals: the tail at the rounded value is within 5e-7 of the level.
        assert abs(chi_square_tail(critical, dof) - CHI2_LEVEL) < 5e-7, dof
    assert abs(chi_square_tail(3.841, 1) - 0.05) < 1e-4 and abs(chi_square_tail(9.488, 4) - 0.05) < 1e-4  # 5% points
