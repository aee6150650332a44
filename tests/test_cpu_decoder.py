"""The quantized target's forward as one call into the kernel's extension (decode/cpu_decoder.py):
it computes what specchat's Python forward computes, and every row on its own, so a verified draft
token gets the very bits plain decoding gives it."""

import pytest
import torch

from conftest import load_tiny_target, prefill_decode_and_tree, save_model_folder
from specchat.decode.runtime import cpu_decoder, woq_kernel
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.engine.growing import verify_inputs
from specchat.decode.drafting.tree import DraftTree

pytestmark = pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                                reason="the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")


# (12 query heads over one KV head: attention's eight-heads-a-vector blocks, a whole one and a part)
@pytest.fixture(scope="module", params=[("qwen2", "float32", {}), ("qwen2", "bfloat16", {}),
                                        ("qwen3", "float32", {"head_dim": 32}), ("llama", "bfloat16", {}),
                                        ("llama", "float32", {"hidden_size": 192, "num_attention_heads": 12,
                                                              "num_key_value_heads": 1})],
                ids=["qwen2-float32", "qwen2-bfloat16", "qwen3-float32", "llama-bfloat16", "llama-12-heads-per-kv"])
def target(request, tmp_path_factory):
    arch, dtype, overrides = request.param
    folder = save_model_folder(tmp_path_factory.mktemp(f"fused-{arch}"), arch, **overrides)
    target = load_tiny_target(folder, dtype=dtype, quantize="int5")
    assert cpu_decoder.unfused_reason(target.own_forward) is None and target.own_forward.fused is not None
    return target


def run(target, fused: bool, steps):
    """`steps(cache)` with the forward fused or in Python."""
    forward = target.own_forward
    kept, forward.fused = forward.fused, forward.fused if fused else None
    try:
        return steps(target.new_cache())
    finally:
        forward.fused = kept


def test_the_fused_forward_computes_what_the_python_forward_computes(target):
    """Layer by layer the same arithmetic, a few sums in another order. The kernel quantizes each
    layer's input to int8, where a difference in the last bit may move a value one step, so
    differences grow with depth: the first layer's output (from identical inputs) is compared
    closely, the final state and the logits within a few percent of their scale."""
    fused = run(target, True, lambda cache: prefill_decode_and_tree(target, cache))
    python = run(target, False, lambda cache: prefill_decode_and_tree(target, cache))
    hidden = target.hidden_size
    close = dict(rtol=0.02, atol=0.02) if target.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for mine, reference in zip(fused, python):
        torch.testing.assert_close(mine.features[:, : 2 * hidden], reference.features[:, : 2 * hidden], **close)
        for ours, theirs in ((mine.features[:, 2 * hidden :], reference.features[:, 2 * hidden :]),
                             (mine.logits, reference.logits)):
            assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()


def test_a_verified_token_gets_exactly_the_logits_plain_decoding_gives_it(target):
    """Each node of a branching tree, verified on top of a cache, against decoding its path one
    token at a time: bit for bit, whatever its siblings, in bf16 too."""
    prompt = torch.tensor([[5, 9, 3, 17, 2, 11, 8, 100, 33, 4, 60]])
    tree = DraftTree(tokens=[40, 41, 90, 91, 7], parents=[-1, -1, 0, 1, 3], depths=[1, 1, 2, 2, 3], probs=[1.0] * 5)
    cache = target.new_cache()
    target.forward(prompt, cache, logits_for="none")
    cached = cache.length
    ids, positions, mask = verify_inputs(tree, 77, cached, "cpu")
    verified = target.forward(ids, cache, positions=positions, mask=mask, logits_for="all").logits
    for node, line in enumerate(tree.ancestors()):
        cache.trim(cached)
        for token in [77] + [tree.tokens[i] for i in line]:
            alone = target.forward(torch.tensor([[token]]), cache, logits_for="last").logits
        assert torch.equal(alone[0], verified[node + 1]), f"node {node}"
    cache.trim(cached)
    root = target.forward(torch.tensor([[77]]), cache, logits_for="last").logits
    assert torch.equal(root[0], verified[0])


def test_a_forward_over_several_tokens_gets_each_row_as_one_token_would(target):
    """A prefill's rows equal one-token steps over the same prompt (causal, no mask given)."""
    prompt = [5, 9, 3, 17, 2, 11, 8, 100]
    whole = target.forward(torch.tensor([prompt]), target.new_cache()).logits
    cache = target.new_cache()
    for index, token in enumerate(prompt):
        step = target.forward(torch.tensor([[token]]), cache, mask=causal_mask(index, 1, "cpu")).logits
        assert torch.equal(step[0], whole[index])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_quantized_head_s_layer_runs_in_one_call_and_computes_what_its_torch_code_does(target, kind):
    """A draft step through `FusedBlock` against the layer's own torch code, on the head's growing
    cache: a context pass and then tree nodes that see some of the entries before them."""
    from conftest import random_head
    from drafters.cache import HeadCache
    from specchat.decode.runtime.quantized import quantize_linears

    if target.embed_tokens.weight.shape[1] != 64:
        pytest.skip("the tiny heads are made for the tiny models' hidden size, 64")
    head = random_head(kind, target).to(target.dtype)
    quantize_linears(head, 5)
    cpu_decoder.fuse_head(head)
    layer = head.midlayer if kind == "eagle3" else head.layers[0]
    assert isinstance(layer.fast_block, cpu_decoder.FusedBlock)
    features = torch.randn(6, 3 * 64 if kind == "eagle3" else 64, dtype=target.dtype)
    tree_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)[None, None]

    def steps(fused: bool):
        kept, layer.fast_block = layer.fast_block, layer.fast_block if fused else None
        try:
            cache = HeadCache()
            context = head(features, torch.arange(6) + 30, torch.arange(6), causal_mask(0, 6, "cpu"), cache)
            tree = head(context[-2:], torch.tensor([50, 51]), torch.tensor([6, 6]), tree_mask, cache)
            return torch.cat([context, tree])
        finally:
            layer.fast_block = kept

    tolerance = dict(rtol=0.02, atol=0.02) if target.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps(True), steps(False), **tolerance)


def test_an_eagle3_head_s_step_and_top_k_run_in_one_call_each_and_compute_what_its_torch_code_does(target):
    """`FusedEagle3Step` against the head's torch code (forward, log_probs, topk), on the head's
    growing cache: a context pass over target features, then tree nodes that see the context and
    some of the nodes before them; the top-k's tokens are the same, their log-probabilities close."""
    from conftest import random_head
    from drafters.cache import HeadCache
    from specchat.decode.runtime.quantized import quantize_linears

    if target.embed_tokens.weight.shape[1] != 64:
        pytest.skip("the tiny heads are made for the tiny models' hidden size, 64")
    head = random_head("eagle3", target, draft_vocab_size=96).to(target.dtype)  # (whole blocks of 16: packable)
    quantize_linears(head, 5)
    cpu_decoder.fuse_head(head)
    assert cpu_decoder.FusedEagle3Step.fits(head) and not cpu_decoder.FusedEagle3Step.fits(random_head("eagle", target))
    fused = cpu_decoder.FusedEagle3Step(head)
    features = torch.randn(6, 3 * 64, dtype=target.dtype)
    tokens, tree_tokens, tree_positions = torch.arange(6) + 30, torch.tensor([50, 51, 52]), torch.tensor([6, 6, 7])
    tree_block = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)  # the third a child of the first

    def torch_steps():  # (the layer's torch code, not its FusedBlock)
        cache, fast_block, head.midlayer.fast_block = HeadCache(), head.midlayer.fast_block, None
        try:
            context = head(features, tokens, torch.arange(6), causal_mask(0, 6, "cpu"), cache)
            mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree_block], dim=1)[None, None]
            tree = head(context[[-1, -1, 0]], tree_tokens, tree_positions, mask, cache)
        finally:
            head.midlayer.fast_block = fast_block
        return torch.cat([context, tree]), cache.length

    def fused_steps():
        cache = HeadCache()
        context = fused.step(features, tokens, torch.arange(6), cache, 0, None)
        tree = fused.step(context[[-1, -1, 0]], tree_tokens, tree_positions, cache, 6, tree_block)
        return torch.cat([context, tree]), cache.length

    (ours, our_length), (theirs, their_length) = fused_steps(), torch_steps()
    tolerance = dict(rtol=0.03, atol=0.03) if target.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, theirs, **tolerance)
    assert our_length == their_length == 9
    # A context pass that reads only its last row's output: the same row, and the same entries for what follows.
    cache = HeadCache()
    last = fused.step(features, tokens, torch.arange(6), cache, 0, None, outputs=1)
    tree = fused.step(ours[[5, 5, 0]], tree_tokens, tree_positions, cache, 6, tree_block)
    assert last.shape == (1, 64) and torch.equal(last[0], ours[5]) and torch.equal(tree, ours[6:])
    logps, ids = fused.top(theirs, 4)
    expected = head.log_probs(theirs).topk(4, dim=-1)
    torch.testing.assert_close(logps, expected.values.float(), **tolerance)
    if target.dtype == torch.float32:  # (bf16 logits tie often)
        assert torch.equal(ids, expected.indices)
    # A draft level in one call (the embedding, the step, its top-k): what the three calls give.
    cache = HeadCache()
    last, last_logps, last_ids = fused.draft(features, tokens, torch.arange(6), cache, 0, None, outputs=1, k=4)
    tree, tree_logps, tree_ids = fused.draft(ours[[5, 5, 0]], tree_tokens, tree_positions, cache, 6, tree_block,
                                             outputs=None, k=4)
    assert torch.equal(last[0], ours[5]) and torch.equal(tree, ours[6:]) and cache.length == 9
    for outputs, (logps, ids) in ((last, (last_logps, last_ids)), (tree, (tree_logps, tree_ids))):
        separate_logps, separate_ids = fused.top(outputs, 4)
        assert torch.equal(logps, separate_logps) and torch.equal(ids, separate_ids)
