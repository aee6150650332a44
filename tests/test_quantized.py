"""The quantized CPU runtime (--quantize int4/int5): the kernel's arithmetic, the quantizer's grids,
the cache of packed layers, and lossless speculation on the quantized model."""

import pytest
import torch

from conftest import load_tiny_target, random_head
from specchat.decode import quantized
from specchat.decode.head_proposer import DynamicTree, DynamicTreeParams, TreeProposer
from specchat.decode.engine import Engine, GenerationSettings
from specchat.decode.speedup import divergence
from specchat.decode.target import ModelSpec
from specchat.errors import ModelLoadError
from specchat.sources import load_target

needs_kernel = pytest.mark.skipif(quantized.missing_cpu_features() != [] or quantized.unavailable_reason() is not None,
                                  reason="the quantized kernel needs AVX512-BF16 and a C++ compiler")


@needs_kernel
@pytest.mark.parametrize("bits", [4, 5])
def test_the_kernel_multiplies_by_exactly_the_dequantized_weights(bits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True).bfloat16()
    layer = quantized.QuantizedLinear.from_linear(linear, bits)
    reference = quantized.dequantize(*quantized.quantize(linear.weight.detach(), bits))
    for rows in (*range(1, 10), 15, 17):  # every register tiling: 8-row tiles, then the 1-7 rows left in one pass
        x = torch.randn(rows, 96).bfloat16()
        expected = x.float() @ reference.T + linear.bias.float()
        got = layer(x).float()
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max(), rows  # bf16 rounding only
    assert torch.allclose(layer.weight.float(), reference, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_stacked_layers_and_the_fused_gated_mlp_give_exactly_the_separate_layers_outputs(qwen_dir):
    torch.manual_seed(0)
    with_bias, without = torch.nn.Linear(64, 48).bfloat16(), torch.nn.Linear(64, 32, bias=False).bfloat16()
    parts = [quantized.QuantizedLinear.from_linear(layer, 5) for layer in (with_bias, without)]
    x = torch.randn(3, 7, 64).bfloat16()
    assert torch.equal(quantized.QuantizedLinear.stacked(parts)(x), torch.cat([part(x) for part in parts], dim=-1))

    target = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="int5"))
    fused = target.decoder.layers[0].mlp
    assert isinstance(fused, quantized.GatedMLP)
    size, blocks = fused.gate_up.out_features // 2, fused.gate_up.out_features // 32
    gate, up = (quantized.QuantizedLinear(fused.gate_up.in_features, size, 5, {  # the separate layers again
        part: getattr(fused.gate_up, part)[rows] for part in quantized.PACKED_PARTS}, None)
        for rows in (slice(0, blocks), slice(blocks, None)))
    x = torch.randn(2, 5, fused.gate_up.in_features).bfloat16()
    assert torch.equal(fused(x), fused.down_proj(fused.act_fn(gate(x)) * up(x)))


@needs_kernel
def test_a_rows_output_does_not_depend_on_the_rows_multiplied_with_it():
    """Integer products: a token verified in a tree of 13 gets exactly what it gets alone."""
    torch.manual_seed(0)
    layer = quantized.QuantizedLinear.from_linear(torch.nn.Linear(256, 64).bfloat16(), 5)
    x = torch.randn(13, 256).bfloat16() * torch.logspace(-2, 2, 256).bfloat16()  # a wide range per group
    together = layer(x)
    assert all(torch.equal(layer(x[i : i + 1])[0], together[i]) for i in range(13))


def test_weights_from_a_q5_0_file_are_reproduced_exactly():
    """llama.cpp's Q5_0 stores w = d * (q - 16) with the largest magnitude at q = 0: the symmetric grid hits it."""
    torch.manual_seed(0)
    d = torch.rand(8, 4, 1) * 0.01 + 0.001
    q = torch.randint(1, 32, (8, 4, 32))
    q[..., 0] = 0  # the group's extreme
    weight = (d.half().float() * (q - 16)).reshape(8, 128)
    codes, scale, offset = quantized.quantize(weight, 5)
    assert torch.equal(quantized.dequantize(codes, scale, offset), weight)


@needs_kernel
def test_packed_layers_are_cached_and_read_back(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).bfloat16()
    model.get_output_embeddings = lambda: model[2]
    x = torch.randn(3, 64).bfloat16()
    first = pytest.importorskip("copy").deepcopy(model)
    quantized.quantize_linears(first, 5, tmp_path / "packed.safetensors")
    calls = []
    monkeypatch.setattr(quantized, "quantize", lambda *a: calls.append(1))
    second = pytest.importorskip("copy").deepcopy(model)
    quantized.quantize_linears(second, 5, tmp_path / "packed.safetensors")
    assert calls == [] and torch.equal(first(x), second(x))


def test_auto_keeps_float32_models_unquantized_and_int5_needs_bf16_on_a_cpu(qwen_dir):
    assert load_tiny_target(qwen_dir).spec.quantize == "none"  # the tests' float32: exact work
    with pytest.raises(ModelLoadError, match="--quantize int5 runs on a CPU with --dtype bfloat16"):
        load_target(ModelSpec(model=str(qwen_dir), dtype="float32", device="cpu", quantize="int5"))


@needs_kernel
def test_speculation_on_the_quantized_model_gives_its_plain_greedy_output(qwen_dir):
    target = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="int5"))
    assert isinstance(target.lm_head, quantized.QuantizedLinear)
    settings = GenerationSettings(max_new_tokens=24)
    prompt = [258, 10, 20, 30, 40, 50, 198]
    plain = [t for s in Engine(target).generate(prompt, settings) for t in s.tokens]
    head = random_head("eagle", target)  # drafts through the target's quantized LM head
    proposer = TreeProposer(head.to(torch.bfloat16), target.num_layers, DynamicTree(DynamicTreeParams(8, 4, 3)))
    drafted = [t for s in Engine(target, proposer).generate(prompt, settings) for t in s.tokens]
    assert drafted == plain


@needs_kernel
@pytest.mark.parametrize("method", ["eagle", "eagle2", "deagle", "jakiro", "sps", "pld", "deagle+lookup"])
def test_every_method_on_the_quantized_runtime_gives_its_plain_greedy_output(qwen_dir, tmp_path, method):
    """Every method is lossless on the quantized model too, the head quantized with it: in bf16 a
    verified tree's attention rounds differently from one token's, so an answer may part from plain
    decoding's only where plain decoding chose between near-equal logits (the tiny model has exact
    ties in bf16)."""
    import dataclasses

    from drafters import save_head
    from specchat.proposers import build_proposer
    from specchat.settings import Settings

    spec = ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="int5")
    target = load_target(spec)
    name, _, lookup = method.partition("+")
    kind = "jakiro" if name == "jakiro" else "eagle3"
    save_head(random_head(kind, load_tiny_target(qwen_dir)), tmp_path / "head")
    draft = str(qwen_dir) if name == "sps" else str(tmp_path / "head")
    settings = Settings(model=str(qwen_dir), method=name, draft=draft, lookup=bool(lookup), total_tokens=8)
    load_model = lambda model, gguf_file=None: load_target(dataclasses.replace(spec, model=model))  # noqa: E731
    proposer = build_proposer(settings, target, load_model)
    greedy = GenerationSettings(max_new_tokens=24)
    prompt = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]
    plain_steps = list(Engine(target).generate(prompt, greedy))
    plain, margins = [t for s in plain_steps for t in s.tokens], [m for s in plain_steps for m in s.margins]
    steps = list(Engine(target, proposer).generate(prompt, greedy))
    assert sum(s.draft_tokens for s in steps) > 0  # it did speculate
    where = divergence([t for s in steps for t in s.tokens], plain, margins)
    assert where is None or where.near_tie, where


@needs_kernel
def test_a_heads_packed_layers_are_cached_per_head_and_target(qwen_dir, tmp_path, monkeypatch):
    from drafters import save_head
    from specchat.proposers import build_proposer
    from specchat.settings import Settings

    target = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="int5"))
    save_head(random_head("eagle3", load_tiny_target(qwen_dir)), tmp_path / "head")
    settings = Settings(model=str(qwen_dir), method="eagle2", draft=str(tmp_path / "head"), total_tokens=8)
    first = build_proposer(settings, target, None)
    calls = []
    real = quantized.quantize
    monkeypatch.setattr(quantized, "quantize", lambda *a: calls.append(1) or real(*a))
    second = build_proposer(settings, target, None)
    assert calls == []  # read back, not quantized again
    x = torch.randn(2, first.head.config.hidden_size).bfloat16()
    assert torch.equal(first.head.fc(torch.cat([x, x, x], -1)), second.head.fc(torch.cat([x, x, x], -1)))
    save_head(random_head("eagle3", load_tiny_target(qwen_dir), seed=1), tmp_path / "head")  # another head there
    build_proposer(settings, target, None)
    assert calls  # new weights, new key
