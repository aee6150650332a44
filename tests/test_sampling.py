"""The target distribution p matches transformers' own logits warpers."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specchat.sampling import SamplingParams, make_generator, sample, target_probs


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
