"""Grouped attention on a CPU: the same numbers as SDPA for one query and several, and the target loads with it."""

import pytest
import torch
import torch.nn.functional as F

from conftest import load_tiny_target
from drafters.attention import attention, grouped
from specchat.decode.runtime.loading import ATTENTION
from specchat.decode.runtime.transformers_cache import KVCache


def reference(query, key, value, mask):
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (14, 2)])
@pytest.mark.parametrize("queries", [1, 3, 5])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_grouped_matches_sdpa(heads, kv_heads, queries, mask_kind):
    torch.manual_seed(0)
    length = 37
    query = torch.randn(1, heads, queries, 16)
    key, value = torch.randn(1, kv_heads, length, 16), torch.randn(1, kv_heads, length, 16)
    visible = torch.rand(1, 1, queries, length) > 0.3
    visible[..., -1] = True
    mask = {"none": None, "bool": visible,
            "additive": torch.zeros(1, 1, queries, length).masked_fill(~visible, float("-inf"))}[mask_kind]
    # no mask: SDPA's is_causal aligns to the top left; for decoding (the queries are the last
    # keys) the causal mask is the bottom-right one, which `grouped` applies
    causal = torch.ones(queries, length, dtype=torch.bool).tril(diagonal=length - queries)[None, None]
    expected = reference(query, key, value, causal if mask is None else mask)
    torch.testing.assert_close(grouped(query, key, value, mask, 16 ** -0.5), expected)
    torch.testing.assert_close(attention(query, key, value, mask), expected)


def test_a_mask_of_rows_only_broadcasts_over_the_heads():
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7)
    torch.testing.assert_close(attention(query, key, value, mask), reference(query, key, value, mask))


def test_a_cpu_target_decodes_with_it_and_gets_sdpa_s_logits(tiny_model_dir):
    target = load_tiny_target(tiny_model_dir)
    assert target.model.config._attn_implementation == ATTENTION
    target.own_forward = None  # transformers' forward, which families specchat's forward does not compute take
    ids = torch.tensor([[5, 9, 3, 17, 2, 11, 8]])

    def last_logits():
        cache = KVCache()
        target.forward(ids[:, :-1], cache, logits_for="none")
        return target.forward(ids[:, -1:], cache, logits_for="last").logits

    ours = last_logits()
    target.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, last_logits())


def test_a_query_that_may_attend_nothing_gets_zeros_not_nan():
    """Padding rows of a batch (training's feature extraction): SDPA gives zeros there, so must grouped."""
    torch.manual_seed(2)
    query, key, value = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    mask[..., 0, :] = False
    out = attention(query, key, value, mask)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    torch.testing.assert_close(out[:, :, 1], reference(query, key, value, mask)[:, :, 1])
