"""KVCache: growth, trim and compaction give exactly what recomputation gives."""

import torch
from transformers import DynamicCache

from conftest import build_model
from drafters.cache import CHUNK, GrowingKV
from specchat.decode.runtime.transformers_cache import KVCache, cache_argument


def run(model, ids, cache, positions=None, mask=None):
    return model.model(input_ids=torch.tensor([ids]), **{cache_argument(model.model): cache}, use_cache=True,
                       position_ids=positions, attention_mask=mask).last_hidden_state[0]


def test_the_cache_goes_by_the_keyword_the_model_takes():
    """transformers 5.24 renamed `past_key_values` to `cache` (5.40 drops the old name); older ones
    (the GPU image's 5.17) know only `past_key_values`."""
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    assert cache_argument(Old()) == "past_key_values" and cache_argument(New()) == "cache"


def test_growing_past_a_chunk_matches_dynamic_cache():
    model = build_model("qwen2")
    ids = torch.randint(0, 250, (CHUNK + 40,)).tolist()
    ours, reference = KVCache(), DynamicCache()
    with torch.no_grad():
        for piece in (ids[:100], ids[100:CHUNK + 10], ids[CHUNK + 10:]):
            a, b = run(model, piece, ours), run(model, piece, reference)
            torch.testing.assert_close(a, b)
    assert ours.length == len(ids)
    assert ours.layers[0].capacity >= len(ids) and ours.layers[0].capacity % CHUNK == 0


def test_trim_then_continue_equals_never_having_seen_the_tokens():
    model = build_model("llama")
    ids = torch.randint(0, 250, (30,)).tolist()
    with torch.no_grad():
        cache = KVCache()
        run(model, ids[:20], cache)
        run(model, [5, 6, 7], cache)  # a detour that gets thrown away
        cache.trim(20)
        after_trim = run(model, ids[20:], cache)
        fresh = KVCache()
        run(model, ids[:20], fresh)
        expected = run(model, ids[20:], fresh)
    torch.testing.assert_close(after_trim, expected)


def test_compact_keeps_exactly_the_chosen_entries():
    """Entries written out of order (a tree) and compacted equal entries computed in order."""
    model = build_model("qwen2")
    prefix = torch.randint(0, 250, (12,)).tolist()
    branch_a, branch_b = [11, 12, 13], [21, 22]
    with torch.no_grad():
        cache = KVCache()
        run(model, prefix, cache)
        # Two branches side by side, each attending only to the prefix and its own ancestors.
        tokens = branch_a + branch_b
        n, start = len(tokens), len(prefix)
        mask = torch.zeros(1, 1, n, start + n, dtype=torch.bool)
        mask[..., :start] = True
        for row, parents in enumerate([[0], [0, 1], [0, 1, 2], [3], [3, 4]]):
            mask[0, 0, row, [start + p for p in parents]] = True
        positions = torch.tensor([[start, start + 1, start + 2, start, start + 1]])
        run(model, tokens, cache, positions, mask)
        cache.compact(start, torch.tensor([3, 4]))  # keep branch b
        assert cache.length == start + 2
        continued = run(model, [99], cache)
        fresh = KVCache()
        run(model, prefix + branch_b, fresh)
        expected = run(model, [99], fresh)
    torch.testing.assert_close(continued, expected)


def test_compaction_leaves_the_entries_already_in_place_and_moves_the_rest():
    """The root's and a path's first nodes are often where compaction would put them: only the rest
    move, and the cache holds what a gather of every kept entry gives."""
    storage = GrowingKV()
    keys, values = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4)
    for keep in ([0, 1, 2], [0, 1, 4, 7], [0, 3], [], [2, 3]):
        storage.trim(0)
        storage.append(keys, values)
        storage.compact(10, torch.tensor(keep, dtype=torch.long))
        rows = list(range(10)) + [10 + position for position in keep]
        assert storage.length == len(rows)
        torch.testing.assert_close(storage.keys, keys[:, :, rows], rtol=0, atol=0)
        torch.testing.assert_close(storage.values, values[:, :, rows], rtol=0, atol=0)
