"""specchat's own forward (decode/forward.py) computes what transformers' forward computes: the
same logits and features for a prefill, one decoded token and a verified tree, on a cache that is
trimmed and compacted as the engine does it; families it does not compute go through transformers'."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Qwen3Config

from conftest import TINY_VOCAB, build_tokenizer, save_model_folder
from specchat.decode.runtime import quantized
from specchat.decode.runtime import woq_kernel
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.runtime.transformers_cache import KVCache
from specchat.decode.runtime.forward import LayerKV, unsupported_reason
from specchat.decode.runtime.target import Target

FEATURES = (0, 2, 6)  # the embeddings, a middle layer's output and the final normed state (6 layers)
EXACT = dict(rtol=1e-5, atol=1e-5)  # float32; the two forwards order a few sums differently


def qwen3_model(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def target(request, tmp_path_factory):
    """A tiny target of each family, loaded as users load it (qwen3 built in memory)."""
    from conftest import load_tiny_target

    if request.param == "qwen3":
        return Target(qwen3_model(), build_tokenizer(), "tiny-qwen3")
    return load_tiny_target(save_model_folder(tmp_path_factory.mktemp(f"forward-{request.param}"), request.param))


def through_transformers(target, run):
    """`run(cache)` with transformers' forward in place of specchat's."""
    own, target.own_forward = target.own_forward, None
    try:
        return run(KVCache())
    finally:
        target.own_forward = own


def tree_inputs(cached: int):
    """A verified tree: the root, two children of it, a grandchild under the second (positions by depth)."""
    ids = torch.tensor([[7, 40, 41, 90]])
    positions = torch.tensor([[0, 1, 1, 2]]) + cached
    rows = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, cached, dtype=torch.bool), rows], dim=1)[None, None]
    return ids, positions, mask


def steps(target, cache):
    """A prefill, one decoded token and a tree's verification: every output, in order."""
    prompt = torch.tensor([[5, 9, 3, 17, 2, 11, 8, 100, 33]])
    outputs = [target.forward(prompt, cache, logits_for="all", feature_layers=FEATURES)]
    outputs.append(target.forward(torch.tensor([[12]]), cache, logits_for="last", feature_layers=FEATURES))
    ids, positions, mask = tree_inputs(cache.length)
    outputs.append(target.forward(ids, cache, positions=positions, mask=mask, logits_for="all", feature_layers=FEATURES))
    return outputs


def test_supported_families_run_specchat_s_forward_with_its_cache(target):
    assert unsupported_reason(target.model) is None
    assert target.own_forward is not None and isinstance(target.new_cache(), LayerKV)


def test_prefill_decode_and_tree_verify_match_transformers(target):
    ours = steps(target, target.new_cache())
    theirs = through_transformers(target, lambda cache: steps(target, cache))
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine.logits, reference.logits, **EXACT)
        torch.testing.assert_close(mine.features, reference.features, **EXACT)


@torch.inference_mode()  # as the engine compacts: the cache's buffers are inference tensors
def test_compacting_then_continuing_equals_a_fresh_forward_over_the_kept_tokens(target):
    prompt = [5, 9, 3, 17, 2, 11]
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache, logits_for="none")
    ids, positions, mask = tree_inputs(cache.length)
    target.forward(ids, cache, positions=positions, mask=mask, logits_for="all")
    cache.compact(len(prompt), torch.tensor([0, 2, 3]))  # keep the root, its second child and that one's child
    kept = prompt + [7, 41, 90]
    assert cache.length == len(kept)
    continued = target.forward(torch.tensor([[55, 56]]), cache, logits_for="all", feature_layers=FEATURES)
    fresh = target.forward(torch.tensor([kept + [55, 56]]), target.new_cache(), logits_for="all", feature_layers=FEATURES)
    torch.testing.assert_close(continued.logits, fresh.logits[-2:], **EXACT)
    torch.testing.assert_close(continued.features, fresh.features[-2:], **EXACT)


def test_trimming_then_continuing_equals_a_fresh_forward(target):
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 9, 3, 17, 2, 11]]), cache, logits_for="none")
    target.forward(torch.tensor([[44, 45, 46]]), cache, logits_for="none")  # rejected: trimmed away
    cache.trim(4)
    continued = target.forward(torch.tensor([[60]]), cache, logits_for="last")
    fresh = target.forward(torch.tensor([[5, 9, 3, 17, 60]]), target.new_cache(), logits_for="last")
    torch.testing.assert_close(continued.logits, fresh.logits, **EXACT)


def test_a_growing_cache_keeps_its_entries(target):
    """Past the first buffer's room (256 positions) the cache reallocates; nothing is lost."""
    ids = torch.randint(0, 250, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    target.forward(ids[:, :250], cache, logits_for="none")
    stepped = target.forward(ids[:, 250:], cache, logits_for="all")
    whole = target.forward(ids, target.new_cache(), logits_for="all")
    torch.testing.assert_close(stepped.logits, whole.logits[250:], **EXACT)


def test_the_causal_mask_is_the_default():
    from conftest import build_model

    target = Target(build_model("llama"), build_tokenizer(), "tiny-llama")
    ids = torch.tensor([[5, 9, 3, 17]])
    cache = target.new_cache()
    target.forward(ids[:, :2], cache, logits_for="none")
    default = target.forward(ids[:, 2:], cache, logits_for="all").logits
    cache.trim(2)
    explicit = target.forward(ids[:, 2:], cache, positions=torch.tensor([[2, 3]]), mask=causal_mask(2, 2, "cpu"),
                              logits_for="all").logits
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def test_other_architectures_go_through_transformers_forward():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    target = Target(model, build_tokenizer(), "tiny-gpt2")
    assert "gpt2" in unsupported_reason(model) and target.own_forward is None
    cache = target.new_cache()
    assert isinstance(cache, KVCache)
    ids = torch.tensor([[5, 9, 3, 17, 2]])
    target.forward(ids[:, :4], cache, logits_for="none")
    stepped = target.forward(ids[:, 4:], cache, logits_for="last").logits
    with torch.no_grad():
        whole = model(ids).logits[0, -1:]
    torch.testing.assert_close(stepped, whole, **EXACT)


@pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                    reason=f"specchat's kernel does not run here: {woq_kernel.unavailable_reason()}")
def test_a_quantized_model_s_stacked_projections_and_mlps_give_transformers_answers():
    """With q, k, v stacked into one kernel call (`quantized.share_projections`) and gate and up
    fused (`GatedMLP`), specchat's forward calls the same layers transformers' does."""
    from conftest import build_model

    model = build_model("qwen2")
    quantized.quantize_linears(model, 5)
    target = Target(model, build_tokenizer(), "tiny-int5")
    assert target.own_forward.projections[0].stacked is not None
    ours = steps(target, target.new_cache())
    theirs = through_transformers(target, lambda cache: steps(target, cache))
    for mine, reference in zip(ours, theirs):
        # (measured: 6e-6 apart at most, on logits up to 28; the kernel rounds activations to 8 bits
        # per token, which the two attentions' last-bit differences could tip by a step, ~0.1)
        torch.testing.assert_close(mine.logits, reference.logits, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(mine.features, reference.features, rtol=1e-4, atol=1e-3)
