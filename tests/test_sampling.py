"""The target distribution p matches transformers' own logits warpers."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specchat.decode.acceptance import sampling
from specchat.decode.runtime import woq_kernel
from specchat.decode.acceptance.sampling import SamplingParams, make_generator, sample, target_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9)])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = target_probs(logits, SamplingParams(temperature, top_p, top_k))
    torch.testing.assert_close(ours, expected.softmax(-1))


@pytest.mark.parametrize("vocab", [50, 1000, 151936])
def test_top_k_and_top_p_without_sorting_the_vocabulary_keep_what_the_sort_keeps(vocab):
    """On a CPU the likeliest tokens are found by a pass and only they are sorted (a device sorts the
    vocabulary): the same k-th largest logit; the nucleus that float64 sums give, but for tokens whose
    mass before them is within float32 rounding of top_p (on a flat 152k-token row the sort's float32
    cumulative sums miss by 2e-5 on an AVX-512 Xeon and 5e-5 on a Zen 3's AVX2, the candidates' by 1e-5 and
    2e-5), and the same probabilities within rounding. The tokens either rule gets wrong run between the
    two cuts, so together they hold at most twice the rounding and the last one's own mass: one token of
    1e-4 at a cut is wrong on some CPUs' rounding and right on others'. The first guesses are wrong
    often enough here to be lowered (flat rows, rows of a few values)."""
    generator = torch.Generator().manual_seed(vocab)
    rounding = 1e-4  # of the mass: far below what a wrong rule would change
    for trial in range(30):
        rows = 1 + trial % 3
        logits = torch.randn(rows, vocab, generator=generator) * (0.2 + trial % 5)
        if trial % 4 == 0:  # exact ties across the nucleus's edge
            logits = torch.randint(0, 4, (rows, vocab), generator=generator).float()
        if trial % 6 == 1:
            logits[:, : vocab // 3] = float("-inf")
        k = 1 + int(torch.randint(0, min(vocab, 300), (), generator=generator))
        assert torch.equal(sampling._kth_largest_on_host(logits, k), logits.topk(k, dim=-1).values[:, -1:])
        top_p = [0.3, 0.8, 0.95, 0.999][trial % 4]
        exact = logits.double().softmax(-1)
        ordered, order = exact.sort(dim=-1, descending=True, stable=True)
        mass_before = torch.zeros_like(exact).scatter(-1, order, ordered.cumsum(-1) - ordered)
        sorted_rule = logits.masked_fill(sampling._outside_nucleus(logits, top_p), float("-inf")).softmax(-1)
        on_host = sampling._nucleus_on_host(logits.softmax(-1), top_p)
        for kept in (on_host > 0, sorted_rule > 0):
            wrong = kept != (mass_before < top_p)
            assert bool(((mass_before - top_p).abs() <= rounding)[wrong].all())
            wrong_mass = exact * wrong
            assert bool((wrong_mass.sum(-1) <= 2 * rounding + wrong_mass.amax(-1)).all())
        same = (on_host > 0) == (sorted_rule > 0)
        torch.testing.assert_close(on_host[same.all(-1)], sorted_rule[same.all(-1)], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vocab", [1000, 151936])  # 1000: no whole blocks, one cumulative sum
def test_draws_follow_p_and_never_take_a_token_without_mass(vocab):
    """`sample` over blocks (a 152k vocabulary) or whole: every token drawn has mass, and the frequencies
    of a few likely tokens (in one block) among many unlikely ones are p's within six standard deviations
    (a wrong inversion, of the blocks' sums or within the block drawn, moves them by hundreds)."""
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.zeros(vocab)
    block = vocab // sampling.BLOCK // 2 * sampling.BLOCK  # the likely tokens share a block (the draw within counts)
    likely = block + torch.tensor([3, 17, 40, 41, 90, 127])
    probs[likely] = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.05, 0.05])
    spread = torch.randperm(vocab, generator=generator)[:200]
    probs[spread] += 0.15 / 200
    probs[: 3 * sampling.BLOCK] = 0  # whole blocks without mass, and mass at the vocabulary's ends
    probs[-1] = 0.01
    draws = torch.tensor([sample(probs, generator) for _ in range(20000)])
    assert bool((probs[draws] > 0).all())
    p = probs / probs.sum()
    for token in [*likely.tolist(), vocab - 1]:
        expected, sigma = 20000 * p[token], (20000 * p[token] * (1 - p[token])) ** 0.5
        assert abs(int((draws == token).sum()) - expected) <= 6 * sigma + 1


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert target_probs(logits, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_same_seed_same_stream_and_the_stream_continues():
    probs = torch.full((50,), 1 / 50)
    first = [sample(probs, make_generator(7)) for _ in range(1)]
    rng_a, rng_b = make_generator(7), make_generator(7)
    draws_a = [sample(probs, rng_a) for _ in range(20)]
    draws_b = [sample(probs, rng_b) for _ in range(20)]
    assert draws_a == draws_b
    assert draws_a[0] == first[0]
    assert len(set(draws_a)) > 5  # successive draws continue the stream rather than repeating it


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("vocab", [256, 1024, 151936, 1000])  # 1000: no whole blocks, torch's own path
def test_blockwise_argmax_and_margins_equal_torchs_ties_and_nan_included(vocab):
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        rows = 1 + trial % 4
        logits = torch.randn(rows, vocab, generator=generator)
        if trial % 3 == 0:  # many exact ties, within and across blocks
            logits = torch.randint(0, 3, (rows, vocab), generator=generator).float()
        if trial % 5 == 0:
            logits[0, int(torch.randint(0, vocab, (), generator=generator))] = float("nan")
        assert sampling.argmax(logits) == logits.argmax(-1).tolist()
        top = logits.topk(2, dim=-1).values
        expected = (top[:, 0] - top[:, 1]).tolist()
        got = sampling.margins(logits)
        assert [m if m == m else "nan" for m in got] == [m if m == m else "nan" for m in expected]


@pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                    reason="the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1003, 151936])
def test_the_kernels_draw_is_where_the_uniform_falls_in_softmaxs_cumulative_sums(vocab, dtype):
    """The kernel's `sample` (regeneration's slots on a CPU): a greedy row (temperature 0) its argmax; a
    sampled row the token whose interval of softmax(logits / T)'s cumulative sums holds u, checked at
    each interval's middle (where rounding cannot move it) for tokens across the row, the first and
    the last included."""
    woq_kernel.kernel()
    generator = torch.Generator().manual_seed(vocab)
    for temperature in (0.6, 1.0, 1.7):
        logits = (torch.randn(vocab, generator=generator) * 3).to(dtype)
        cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
        likeliest = torch.softmax(logits.float(), -1).topk(min(vocab, 20)).indices.tolist()
        tokens = sorted({0, vocab - 1, *likeliest})
        lower = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
        middle = ((lower + cdf) / 2)[tokens]
        wide = (cdf - lower)[tokens] > 2e-3  # intervals float32 sums over the row cannot blur
        rows = logits[None].expand(len(tokens), vocab).contiguous()
        drawn = torch.ops.specchat.sample(rows, torch.full((len(tokens),), temperature), middle.float())
        assert [d for d, w in zip(drawn.tolist(), wide.tolist()) if w] == [t for t, w in zip(tokens, wide.tolist()) if w]
        assert wide.sum() >= 2  # (something checked)
    greedy = torch.randn(3, vocab, generator=generator).to(dtype)
    greedy[1, vocab // 2] = float("nan")
    drawn = torch.ops.specchat.sample(greedy, torch.tensor([0.0, 1.0, 0.0]), torch.full((3,), 0.5))
    assert drawn.tolist() == greedy.float().argmax(-1).tolist()  # (a row holding a NaN: its argmax, the NaN)


@pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                    reason="the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 256, 1003, 1013, 151936])
def test_the_kernels_one_pass_choice_and_margin_equal_torchs_ties_nan_and_infinity_included(vocab, dtype):
    woq_kernel.kernel()  # loaded: `choices_and_margins` takes the extension's pass
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        rows = 1 + trial % 5
        logits = torch.randn(rows, vocab, generator=generator)
        if trial % 3 == 0:  # many exact ties
            logits = torch.randint(0, 3, (rows, vocab), generator=generator).float()
        if trial % 4 == 1:
            logits[-1, int(torch.randint(0, vocab, (), generator=generator))] = float("-inf")
        if trial % 5 == 0:
            logits[0, int(torch.randint(0, vocab, (), generator=generator))] = float("nan")
        if trial % 7 == 3:
            logits[-1, int(torch.randint(0, vocab, (), generator=generator))] = float("inf")
        if trial % 6 == 2:  # the maximum (once, or tied with an earlier one) near the end: in a pass's tails
            place = vocab - 1 - int(torch.randint(0, min(vocab, 40), (), generator=generator))
            logits[0, place] = 50.0
            if trial % 12 == 2:
                logits[0, place // 2] = 50.0
        logits = logits.to(dtype)
        exact = logits.float()
        top = exact.topk(2, dim=-1).values
        choices, margins = sampling.choices_and_margins(logits)
        assert choices == exact.argmax(-1).tolist()
        expected = (top[:, 0] - top[:, 1]).tolist()
        assert [m if m == m else "nan" for m in margins] == [m if m == m else "nan" for m in expected]
