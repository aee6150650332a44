"""Acceptance: greedy follows the argmax; sampling leaves the target distribution exactly unchanged.

The statistical tests compare the empirical distribution of the accepted/bonus token with p by
a chi-square test at a small significance level; with the sample sizes used, a wrong rule (for
example accepting with p(x) without renormalising after a rejection, or drawing the bonus from p
instead of the residual) moves the statistic far beyond the threshold.
"""

import pytest
import torch

from specchat.decode.sampling import SamplingParams, target_probs
from specchat.decode.tree import DraftTree
from specchat.decode.verify import accept

# chi-square critical values at p = 0.001 for the degrees of freedom used below
CHI2_CRITICAL = {4: 18.47, 5: 20.52, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was produced"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_follows_the_argmax_down_the_tree():
    # root ─ 3 ─ 4        logits rows: root, node0, node1, node2
    #      └ 5
    tree = DraftTree(tokens=[3, 5, 4], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.4, 0.9])
    logits = torch.full((4, 8), -5.0)
    logits[0, 5] = 1  # the target wants 5 after the root: second child accepted
    logits[2, 6] = 1  # after node 1 (token 5) it wants 6: the bonus
    out = accept(tree, logits, SamplingParams(), None)
    assert out.path == [1] and out.bonus == 6


def first_token_counts(tree, logits, sampling, draws, seed=0):
    vocab = logits.shape[-1]
    counts = torch.zeros(vocab)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        out = accept(tree, logits, sampling, rng)
        first = tree.tokens[out.path[0]] if out.path else out.bonus
        counts[first] += 1
    return counts


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_sampled_first_token_follows_p_whatever_the_draft(sampling):
    torch.manual_seed(1)
    vocab = 8
    logits = torch.randn(4, vocab)
    # Three root children, deliberately including unlikely tokens, in a 'wrong' order.
    tree = DraftTree(tokens=[6, 2, 0], parents=[-1, -1, -1], depths=[1, 1, 1], probs=[0.9, 0.05, 0.05])
    p = target_probs(logits[0], sampling)
    counts = first_token_counts(tree, logits, sampling, draws=20000)
    dof = int((p > 0).sum()) - 1
    assert chi_square(counts, p) < CHI2_CRITICAL[dof]


def test_a_rule_without_the_residual_would_be_caught():
    """Sanity check of the test's power: drawing the bonus from p (not the residual) is rejected."""
    torch.manual_seed(1)
    logits = torch.randn(2, 8)
    sampling = SamplingParams(temperature=1.0)
    p = target_probs(logits[0], sampling)
    rng = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    for _ in range(20000):  # the flawed rule: accept 6 with p(6), else sample from p
        token = 6 if float(torch.rand((), generator=rng)) < float(p[6]) else int(torch.multinomial(p, 1, generator=rng))
        counts[token] += 1
    assert chi_square(counts, p) > CHI2_CRITICAL[7]


def test_sampled_chain_with_q_follows_p():
    """The min(1, p/q) rule with the residual max(0, p - q), for a token drawn from q."""
    torch.manual_seed(2)
    vocab = 6
    logits = torch.randn(2, vocab)
    q = torch.softmax(torch.randn(vocab) * 2, -1)
    sampling = SamplingParams(temperature=1.0)
    p = target_probs(logits[0], sampling)
    rng = torch.Generator().manual_seed(3)
    counts = torch.zeros(vocab)
    for _ in range(20000):
        x = int(torch.multinomial(q, 1, generator=rng))
        tree = DraftTree(tokens=[x], parents=[-1], depths=[1], probs=[float(q[x])], q=q[None])
        out = accept(tree, logits, sampling, rng)
        counts[x if out.path else out.bonus] += 1
    assert chi_square(counts, p) < CHI2_CRITICAL[5]
