"""The quantized CPU runtime (--quantize int4/int5): the kernel's arithmetic, the quantizer's grids,
the cache of packed layers, and lossless speculation on the quantized model."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_VOCAB, load_tiny_target, random_head
from specchat.decode.runtime import cpu_decoder, quantized
from specchat.decode.runtime import woq_kernel
from specchat.decode.drafting import heads
from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.runtime.target import ModelSpec
from specchat.errors import ModelLoadError
from specchat.sources import load_target

needs_kernel = pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                                  reason="the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")
RUNNABLE = woq_kernel.runnable_isas()  # every path this machine runs (avx-vnni only without AVX-512)


def test_every_kernel_source_is_compiled_and_hashed_and_only_the_torch_face_includes_torch():
    """Each .cpp is compiled (`woq_kernel.UNITS`) or included by arithmetic.cpp (`woq_kernel.SOURCES`):
    one left out would be missing from the build; a file the hash misses would leave packed models made
    by another build looking current. Only extension.cpp includes torch's headers (the arithmetic
    compiles beside it, on a user's first start): the rest take c10's number types and ATen's
    parallel_for only."""
    kernel_files = {path.name for path in woq_kernel.KERNELS.iterdir() if path.suffix in (".cpp", ".h")}
    arithmetic = (woq_kernel.KERNELS / "arithmetic.cpp").read_text()
    assert {path.name for path in woq_kernel.SOURCES} == set(re.findall(r'#include "(\w+\.cpp)"', arithmetic))
    assert {path.name for path in (*woq_kernel.UNITS, *woq_kernel.SOURCES)} == \
        {name for name in kernel_files if name.endswith(".cpp")}
    assert {path.name for path in woq_kernel.FILES} == kernel_files
    light = {"<ATen/Parallel.h>", "<c10/util/BFloat16.h>", "<c10/util/Half.h>"}
    for path in woq_kernel.FILES:
        torch_headers = set(re.findall(r"#include (<(?:torch|ATen|c10)/[^>]+>)", path.read_text()))
        assert path.name == "extension.cpp" or torch_headers <= light, (path.name, torch_headers - light)


def test_the_last_build_is_loaded_directly_while_nothing_it_was_made_from_has_changed(tmp_path, monkeypatch):
    """A start loads the library the last build noted, skipping torch's build machinery, only while
    the library is the one noted and the sources, flags, torch and Python are those it was built from."""
    library = tmp_path / "built.so"
    library.write_bytes(b"")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    assert not woq_kernel._load_built()  # nothing noted yet
    woq_kernel._note_built(str(library))
    assert woq_kernel._load_built() and loaded == [str(library)]
    os.utime(library, ns=(1, 1))  # built again since
    assert not woq_kernel._load_built()
    woq_kernel._note_built(str(library))
    monkeypatch.setattr(woq_kernel, "source_hash", lambda: "another")  # a source or header changed
    assert not woq_kernel._load_built()
    monkeypatch.undo()
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    woq_kernel._note_built(str(library))
    library.unlink()
    assert not woq_kernel._load_built()
    (woq_kernel.machine.cache_dir() / woq_kernel.BUILT).write_text("{")  # damaged
    assert not woq_kernel._load_built() and len(loaded) == 1


def test_starting_the_build_says_whether_it_compiles(tmp_path, monkeypatch):
    """Its caller leaves the compiler a core only while it compiles: where no current build is noted."""
    started = []
    monkeypatch.setattr(woq_kernel.threading, "Thread",
                        lambda **kwargs: SimpleNamespace(start=lambda: started.append(1)))
    library = tmp_path / "built.so"
    library.write_bytes(b"")
    assert woq_kernel.start_build() is True  # nothing noted yet
    woq_kernel._note_built(str(library))
    assert woq_kernel.start_build() is False and started == [1, 1]  # loaded on the thread all the same
    monkeypatch.setattr(woq_kernel, "source_hash", lambda: "another")
    assert woq_kernel.start_build() is True


@needs_kernel
def test_a_start_after_a_build_loads_the_kernel_without_torchs_build_machinery(tmp_path):
    """Importing torch's build machinery (with setuptools) cost ~0.1 s of every start (issue 48)."""
    code = ("import sys; from specchat.decode.runtime import woq_kernel; woq_kernel.kernel(); "
            "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    env = {**os.environ, "SPECCHAT_CACHE_DIR": str(tmp_path)}
    first, again = (subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.split() for _ in range(2))
    assert first == ["True", "True"] and again == ["False", "False"]


def test_the_head_sizes_python_takes_are_those_the_attention_is_compiled_for():
    """`cpu_decoder.HEAD_SIZES` decides which models take the fused forward; layers.cpp's
    `attend_heads` compiles one attention loop per size, and extension.cpp's layer checks the size
    early (layers.h's `head_size_supported`). A size in one list only would fail at the first
    forward, or send a model the kernel takes to the slower path."""
    source = (woq_kernel.KERNELS / "layers.cpp").read_text()
    switch = source[source.index("void attend_heads("):]
    switch = switch[: switch.index("\n}\n")]
    compiled = tuple(int(size) for size in re.findall(r"case (\d+): return attend_group", switch))
    header = (woq_kernel.KERNELS / "layers.h").read_text()
    checked = re.search(r"head_size_supported\(int64_t d\) \{ return ([^;]+);", header).group(1)
    assert compiled == cpu_decoder.HEAD_SIZES
    assert tuple(int(size) for size in re.findall(r"d == (\d+)", checked)) == cpu_decoder.HEAD_SIZES


@pytest.fixture
def force_isa(monkeypatch):
    """Run the kernel on a given path, as SPECCHAT_CPU_ISA does (the choice is made again after the test)."""

    def force(isa: str | None):
        if isa is None:
            monkeypatch.delenv(woq_kernel.ISA_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(woq_kernel.ISA_VARIABLE, isa)
        woq_kernel.kernel_isa.cache_clear()

    yield force
    woq_kernel.kernel_isa.cache_clear()


@pytest.fixture(params=list(woq_kernel.ISAS))
def isa(request, force_isa):
    """Each path in turn, those the CPU lacks skipped."""
    if request.param not in RUNNABLE:
        pytest.skip(f"this CPU (or compiler) has no {request.param} path")
    force_isa(request.param)
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 5])
def test_the_kernel_multiplies_by_exactly_the_dequantized_weights(isa, bits, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=True).to(dtype)
    layer = quantized.QuantizedLinear.from_linear(linear, bits)
    reference = quantized.dequantize(*quantized.quantize(linear.weight.detach(), bits))
    for rows in (*range(1, 10), 15, 17):  # every register tiling: full tiles, then the rows left in one pass
        x = torch.randn(rows, 96).to(dtype)
        expected = x.float() @ reference.T + linear.bias.float()
        got = layer(x)
        assert got.dtype == dtype
        assert (got.float() - expected).abs().max() <= 0.02 * expected.abs().max(), rows  # int8 x, bf16 rounding
    assert layer.weight.dtype == dtype
    assert torch.allclose(layer.weight.float(), reference, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_bf16_activations_get_the_float32_result_rounded_once(isa):
    """x is quantized to int8 either way, so bf16 in differs from float32 in only by the final rounding."""
    torch.manual_seed(0)
    layer = quantized.QuantizedLinear.from_linear(torch.nn.Linear(128, 64).bfloat16(), 5)
    x = torch.randn(5, 128).bfloat16()
    assert torch.equal(layer(x), layer(x.float()).bfloat16())
    assert layer(x.half()).dtype == torch.float16  # other dtypes go through float32


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="this machine runs one path of the kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_gives_bit_identical_outputs(force_isa, dtype):
    """The same int32 sums (vpdpbusd or vpmaddubsw + vpmaddwd) and the same float operations."""
    torch.manual_seed(0)
    layers = [quantized.QuantizedLinear.from_linear(torch.nn.Linear(256, 48).to(dtype), bits) for bits in (4, 5)]
    xs = [torch.randn(rows, 256).to(dtype) * torch.logspace(-3, 3, 256).to(dtype) for rows in (*range(1, 10), 17)]
    outputs = {}
    for isa in RUNNABLE:
        force_isa(isa)
        outputs[isa] = [layer(x) for layer in layers for x in xs]
    first = outputs[RUNNABLE[0]]
    for isa in RUNNABLE[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, outputs[isa])), isa


def test_a_forced_path_the_cpu_lacks_is_a_one_line_error_naming_its_flags(force_isa, monkeypatch):
    from specchat.decode.runtime import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    force_isa("avx512")
    assert woq_kernel.missing_cpu_features() == ["avx512f", "avx512bw", "avx512vl", "avx512_vnni"]
    lacks = "avx512f, avx512bw, avx512vl, avx512_vnni"
    assert woq_kernel.unavailable_reason() == f"SPECCHAT_CPU_ISA=avx512: this CPU lacks {lacks}"
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(woq_kernel.KernelUnavailable, match="lacks avx512f"):
        quantized.quantize_linears(model, 5)
    assert isinstance(model[0], torch.nn.Linear)  # untouched
    force_isa("avx-vnni")
    assert woq_kernel.unavailable_reason() == "SPECCHAT_CPU_ISA=avx-vnni: this CPU lacks avx_vnni"
    force_isa("avx3")
    assert woq_kernel.unavailable_reason() == "SPECCHAT_CPU_ISA=avx3 is not one of avx512, avx-vnni, avx-vnni-evex, avx2"
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    force_isa(None)
    assert woq_kernel.missing_cpu_features() == ["avx2", "fma", "f16c"]
    assert woq_kernel.unavailable_reason() == "this CPU lacks avx2, fma, f16c"


@needs_kernel
def test_without_the_variable_the_best_path_the_cpu_has_runs(force_isa, monkeypatch):
    from specchat.decode.runtime import machine

    force_isa(None)
    assert woq_kernel.kernel_isa() == RUNNABLE[0]
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c", "avx_vnni"}))
    force_isa(None)
    assert woq_kernel.kernel_info() == woq_kernel.KernelInfo("avx-vnni", (torch.bfloat16, torch.float32), torch.float32)
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    force_isa(None)
    assert woq_kernel.kernel_isa() == "avx2" and woq_kernel.missing_cpu_features() == []
    layer = quantized.QuantizedLinear.from_linear(torch.nn.Linear(64, 32), 5)  # a float32 model
    assert layer(torch.randn(2, 64)).dtype == torch.float32


@needs_kernel
def test_stacked_layers_and_the_fused_gated_mlp_give_exactly_the_separate_layers_outputs(qwen_dir, isa):
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_output_does_not_depend_on_the_rows_multiplied_with_it(isa, dtype):
    """Integer products: a token verified in a tree of 13 gets exactly what it gets alone."""
    torch.manual_seed(0)
    layer = quantized.QuantizedLinear.from_linear(torch.nn.Linear(256, 64).to(dtype), 5)
    x = (torch.randn(13, 256) * torch.logspace(-2, 2, 256)).to(dtype)  # a wide range per group
    together = layer(x)
    assert all(torch.equal(layer(x[i : i + 1])[0], together[i]) for i in range(13))


@needs_kernel
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_times_the_largest_int8_sum_exactly_on_every_tiling(isa, sign):
    """Every code 31 and every int8 of x at +-127: the integer sums are at their largest (the AVX2
    path keeps two pairs of quads in int16, 8 * 31 * 127 = 31496, before widening), and exact."""
    N, K = 32, 256
    codes = torch.full((N, K), 31, dtype=torch.uint8)
    ones, zeros = torch.ones(N, K // quantized.GROUP).half(), torch.zeros(N, K // quantized.GROUP).half()
    layer = quantized.QuantizedLinear(K, N, 5, quantized.pack(codes, ones, zeros, 5), None, torch.float32)
    for rows in (1, 3, 4, 5, 8, 16):
        got = layer(torch.full((rows, K), sign))
        assert torch.equal(got, torch.full((rows, N), sign * 31 * K)), rows


@needs_kernel
def test_x_is_quantized_as_llama_cpp_does_ties_to_even_zero_groups_to_zero(isa):
    """Each group of x: the largest magnitude to 127, every value rounded to nearest, ties to even
    (2.5 -> 2, 3.5 -> 4, -2.5 -> -2), a group of zeros all zeros. With the largest at 127 the step is
    1, weights of small integers make every product and sum exact, so the output is those integers'
    dot product, whatever the order of the kernel's operations."""
    N, K = 16, 64
    codes = torch.zeros(N, K, dtype=torch.uint8)
    codes[:, :4] = torch.tensor([1, 3, 5, 7], dtype=torch.uint8)  # x's first group: 127, 2.5, 3.5, -2.5
    ones, zeros = torch.ones(N, K // quantized.GROUP).half(), torch.zeros(N, K // quantized.GROUP).half()
    layer = quantized.QuantizedLinear(K, N, 5, quantized.pack(codes, ones, zeros, 5), None, torch.float32)
    x = torch.zeros(2, K)
    x[0, :4] = torch.tensor([127.0, 2.5, 3.5, -2.5])
    x[1, :4] = torch.tensor([-127.0, 0.5, 1.5, -0.5])  # 0, 2, -0
    assert torch.equal(layer(x), torch.tensor([[127 + 3 * 2 + 5 * 4 - 7 * 2.0], [-127.0 + 5 * 2]]).expand(2, N))


def reference_quantize(weight: torch.Tensor, bits: int):
    """The quantizer as torch's elementwise operations (what specchat ran before kernels/quantize.cpp):
    codes, scales and offsets, and each group's squared error on either grid in float64."""
    N, K = weight.shape
    groups = weight.float().reshape(N, K // 32, 32)
    top, half = 2**bits - 1, 2 ** (bits - 1)
    low, high = groups.amin(-1), groups.amax(-1)
    extreme = torch.where(high.abs() > low.abs(), high, low)
    results = []
    for scale, offset in (((high - low) / top, low), (-extreme / half, extreme)):
        scale = torch.where(scale.abs() < 1e-7, 1e-7, scale).half()
        step, base = scale.float()[..., None], offset.half().float()[..., None]
        codes = groups.sub(base).div(step).round().clamp(0, top)
        error = (codes.double() * step.double() + base.double() - groups.double()).square().sum(-1)
        results.append((codes.to(torch.uint8), scale, offset.half(), error))
    (codes, scale, offset, error), (codes2, scale2, offset2, error2) = results
    second = error2 < error
    return (torch.where(second[..., None], codes2, codes).reshape(N, K), torch.where(second, scale2, scale),
            torch.where(second, offset2, offset), error, error2)


def reference_pack(codes, scale, offset, bits):
    """The kernel's layout as torch's reshapes (kernels/woq_linear.cpp's top comment)."""
    N, K = codes.shape
    quads = codes.reshape(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).reshape(N // 16, K // 4, 64)
    nibbles = (quads & 15).reshape(N // 16, K // 8, 2, 64)
    fifth = (quads >> 4).reshape(N // 16, K // 4, 8, 8).int()
    high = sum(fifth[..., t] << t for t in range(8)).to(torch.uint8) if bits == 5 else torch.zeros(0, dtype=torch.uint8)
    per_group = lambda t: t.reshape(N // 16, 16, K // 32).transpose(1, 2)  # noqa: E731
    return {"low": nibbles[:, :, 0] | (nibbles[:, :, 1] << 4), "high": high, "scale": per_group(scale),
            "bias": per_group(offset)}


@needs_kernel
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantizer_chooses_the_better_grid_and_packs_the_kernels_layout(bits, dtype):
    """Each group on whichever grid reconstructs it better, its codes the nearest (ties to even) in
    range, then in the kernel's layout: as torch's elementwise version computes them, except where
    the two grids' errors are within the rounding of their sums (whose order is the quantizer's own)."""
    torch.manual_seed(0)
    weight = torch.randn(64, 512) * torch.rand(64, 16, 1).repeat_interleave(32, -1).reshape(64, 512)
    weight[:8] += 3 * torch.rand(8, 512)  # skewed groups: the min-max grid wins
    weight[8:16, :64] = 0.25  # constant groups
    weight = weight.to(dtype)
    codes, scale, offset = quantized.quantize(weight, bits)
    expected, expected_scale, expected_offset, error, error2 = reference_quantize(weight, bits)
    tie = (error - error2).abs() <= 1e-6 * error.maximum(error2)
    same = (codes.reshape(64, 16, 32) == expected.reshape(64, 16, 32)).all(-1) & (scale == expected_scale) & \
        (offset == expected_offset)
    assert (same | tie).all() and same.float().mean() > 0.99
    assert (error2 < error).any() and (error < error2).any()
    packed = quantized.pack(codes, scale, offset, bits)
    for name, value in reference_pack(codes, scale, offset, bits).items():
        assert packed[name].shape == value.shape and torch.equal(packed[name], value), name


@needs_kernel
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


def test_auto_keeps_float32_models_unquantized_and_int5_needs_bf16_or_float32_on_a_cpu(qwen_dir):
    assert load_tiny_target(qwen_dir).spec.quantize == "none"  # the tests' float32, asked for: exact work
    with pytest.raises(ModelLoadError, match="--quantize int5 runs on a CPU with --dtype bfloat16 or float32"):
        load_target(ModelSpec(model=str(qwen_dir), dtype="float16", device="cpu", quantize="int5"))


@needs_kernel
def test_a_cpu_without_native_bf16_runs_the_kernel_on_float32_and_says_what_runs(qwen_dir, monkeypatch, capsys):
    """--dtype auto on an AVX2-class CPU: float32 activations through the int5 kernel, named in /stats and records."""
    from specchat.decode.runtime import target as runtime_target

    monkeypatch.setattr(runtime_target, "cpu_has_bf16", lambda: False)
    target = load_target(ModelSpec(model=str(qwen_dir), device="cpu"))
    assert target.dtype == torch.float32 and target.spec.quantize == "int5"
    assert target.runtime == f"int5 weights, {woq_kernel.kernel_isa()} kernel, float32 activations"
    said = capsys.readouterr().err.splitlines()
    # progress only
    assert said and all(line.endswith("once (a second or two per billion weights)...") for line in said)
    explicit = load_target(ModelSpec(model=str(qwen_dir), dtype="float32", device="cpu", quantize="int5"))
    assert explicit.spec.quantize == "int5" and explicit.runtime == target.runtime


@needs_kernel
def test_a_runtime_that_is_not_the_fastest_is_said_in_one_line(qwen_dir, monkeypatch, capsys):
    load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="none"))
    assert capsys.readouterr().err.strip() == ("specchat: --quantize none as asked; --quantize auto (int5, "
                                               "specchat's kernel) decodes faster on this CPU")
    monkeypatch.setenv(woq_kernel.ISA_VARIABLE, "avx2")
    woq_kernel.kernel_isa.cache_clear()
    try:
        target = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu"))
        err = [line for line in capsys.readouterr().err.splitlines() if not line.endswith("...")]  # not progress
    finally:
        monkeypatch.delenv(woq_kernel.ISA_VARIABLE)
        woq_kernel.kernel_isa.cache_clear()
    assert target.runtime == "int5 weights, avx2 (forced) kernel, bfloat16 activations"
    best = woq_kernel.runnable_isas()[0]
    assert err == [] if best == "avx2" else err == [f"specchat: {target.runtime}: SPECCHAT_CPU_ISA forces the path "
                                                     f"(this CPU's best: {best})"]


@needs_kernel
def test_speculation_on_the_quantized_model_gives_its_plain_greedy_output(qwen_dir):
    target = load_target(ModelSpec(model=str(qwen_dir), dtype="bfloat16", device="cpu", quantize="int5"))
    assert isinstance(target.lm_head, quantized.QuantizedLinear)
    settings = GenerationSettings(max_new_tokens=24)
    prompt = [258, 10, 20, 30, 40, 50, 198]
    plain = [t for s in Engine(target).generate(prompt, settings) for t in s.tokens]
    head = random_head("eagle", target)  # drafts through the target's quantized LM head
    proposer = heads.for_target(head.to(torch.bfloat16), target, DynamicTree(DynamicTreeParams(8, 4, 3)))
    drafted = [t for s in Engine(target, proposer).generate(prompt, settings) for t in s.tokens]
    assert drafted == plain


@needs_kernel
@pytest.mark.parametrize("method", ["eagle", "eagle2", "deagle", "jakiro", "sps", "pld", "deagle+lookup"])
def test_every_method_on_the_quantized_runtime_gives_its_plain_greedy_output(qwen_dir, tmp_path, method):
    """Every method is lossless on the quantized model too, the head quantized with it: the fused
    forward computes a verified token's logits bit for bit as plain decoding does (test_cpu_decoder),
    so in bf16 too the answers are plain decoding's, token for token."""
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
    plain = [t for s in Engine(target).generate(prompt, greedy) for t in s.tokens]
    steps = list(Engine(target, proposer).generate(prompt, greedy))
    assert sum(s.draft_tokens for s in steps) > 0  # it did speculate
    assert [t for s in steps for t in s.tokens] == plain


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


@needs_kernel
def test_a_draft_vocabularys_rows_of_the_target_lm_head_are_packed_too(qwen_dir, tmp_path):
    """An EAGLE or Jakiro head drafting over a subset of the vocabulary draws its logits from those
    rows of the target's LM head; as float32 rows torch's CPU product cost ~10 ms a step on a Zen 3,
    so on a quantized target they are packed as its other layers are, and stay lossless."""
    from drafters import save_head
    from specchat.decode.options import HEAD_QUANTIZE, KERNEL_BITS
    from specchat.proposers import build_proposer
    from specchat.settings import Settings

    spec = ModelSpec(model=str(qwen_dir), dtype="float32", device="cpu", quantize="int5")
    target = load_target(spec)
    head = random_head("jakiro", load_tiny_target(qwen_dir))
    head.restrict_vocab(torch.arange(0, TINY_VOCAB, 2))
    save_head(head, tmp_path / "head")
    settings = Settings(model=str(qwen_dir), method="jakiro", draft=str(tmp_path / "head"), total_tokens=8)
    proposer = build_proposer(settings, target, None)
    layer = proposer.head.draft_logits_layer()
    assert isinstance(layer, quantized.QuantizedLinear) and layer.out_features == TINY_VOCAB // 2
    assert layer.bits == KERNEL_BITS[HEAD_QUANTIZE]
    rows = target.lm_head.weight[::2]  # the target's (dequantized) rows, packed again in the head's bits:
    assert torch.allclose(layer.weight, rows, atol=float(rows.max() - rows.min()) / 30)  # within half a step
    out = torch.randn(3, target.hidden_size)
    exact = out @ layer.weight.T  # the packed rows multiplied exactly
    # (the kernel rounds activations to int8 per 32 values: close, not equal)
    assert torch.allclose(proposer.head.log_probs(out), torch.log_softmax(exact, -1), rtol=0.02, atol=0.2)
    greedy = GenerationSettings(max_new_tokens=24)
    prompt = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]
    plain = [t for s in Engine(target).generate(prompt, greedy) for t in s.tokens]
    steps = list(Engine(target, proposer).generate(prompt, greedy))
    assert sum(s.draft_tokens for s in steps) > 0
    assert [t for s in steps for t in s.tokens] == plain


@needs_kernel
def test_an_eagle3_head_on_a_quantized_target_drafts_in_fused_steps_and_stays_lossless(qwen_dir, tmp_path):
    """On a quantized target an EAGLE-3 head's steps and top-k run as one kernel call each
    (`cpu_decoder.FusedEagle3Step`), its layers in HEAD_QUANTIZE's bits whatever the target's, on
    both of its paths: trees grown level by level and the default profile's rate-sized trees with
    lookup (`--lookup`); greedy output stays plain decoding's."""
    from drafters import save_head
    from specchat.decode.options import HEAD_QUANTIZE, KERNEL_BITS
    from specchat.decode.runtime.cpu_decoder import FusedEagle3Step
    from specchat.proposers import build_proposer
    from specchat.settings import Settings

    target = load_target(ModelSpec(model=str(qwen_dir), dtype="float32", device="cpu", quantize="int5"))
    save_head(random_head("eagle3", load_tiny_target(qwen_dir), draft_vocab_size=96), tmp_path / "head")
    greedy = GenerationSettings(max_new_tokens=24)
    prompt = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]
    plain = [t for s in Engine(target).generate(prompt, greedy) for t in s.tokens]
    for lookup in (False, True):
        settings = Settings(model=str(qwen_dir), method="deagle", draft=str(tmp_path / "head"), total_tokens=8,
                            lookup=lookup, plain_when_faster=False)
        proposer = build_proposer(settings, target, None)
        assert isinstance(proposer.fused, FusedEagle3Step)
        head_bits = {layer.bits for layer in proposer.head.modules() if isinstance(layer, quantized.QuantizedLinear)}
        assert head_bits == {KERNEL_BITS[HEAD_QUANTIZE]} != {target.lm_head.bits}
        tops, draft = [], proposer.fused.draft  # the top-k its draft steps computed: what a call of its own gives

        def draft_level(*args, k, **kwargs):
            outputs, logps, ids = draft(*args, k=k, **kwargs)
            own_logps, own_ids = proposer.fused.top(outputs, k)
            tops.append(torch.equal(ids, own_ids) and torch.equal(logps, own_logps))
            return outputs, logps, ids

        proposer.fused.draft = draft_level
        steps = list(Engine(target, proposer).generate(prompt, greedy))
        assert tops and all(tops)
        assert sum(s.draft_tokens for s in steps) > 0
        assert [t for s in steps for t in s.tokens] == plain
