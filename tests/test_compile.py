"""The target's forward under torch.compile(fullgraph=True) (`--compile on`): it compiles whole on a
CPU, through specchat's quantized kernel too, and decoding stays lossless through it.

The slow-ish tests of the suite (inductor compiles a few graphs: ~10-60 s each); a 2-layer model
keeps them small.
"""

import pytest
import torch

from conftest import ScriptedProposer, build_model, build_tokenizer, random_head, tokens_of
from specchat.decode.runtime import quantized
from specchat.decode.runtime import woq_kernel
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.drafting import heads, prompt_lookup
from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams, JakiroTree
from specchat.decode.runtime.target import ModelSpec, Target, compiles

pytestmark = pytest.mark.compile  # the slowest tests after the real model's: -m "not compile" leaves them out

PROMPT = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]  # repeats itself, so prompt lookup finds drafts


def tiny_target(compile: str, quantize_bits: int | None = None, cuda_graphs: str = "auto") -> Target:
    model = build_model("qwen2", num_hidden_layers=2)
    if quantize_bits:
        quantized.quantize_linears(model, quantize_bits)
    spec = ModelSpec(model="tiny", dtype="float32", device="cpu", compile=compile, cuda_graphs=cuda_graphs)
    return Target(model, build_tokenizer(), "tiny", spec=spec)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing and sees its own graph breaks."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def assert_compiled_whole():
    """fullgraph=True raises at a graph break; this also catches a silent fallback to eager (recompile limit)."""
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def steps(target):
    """A prefill, a decoded token and a verified tree: their logits and features."""
    cache = target.new_cache()
    out = [target.forward(torch.tensor([PROMPT]), cache, logits_for="all", feature_layers=(1, 2))]
    out.append(target.forward(torch.tensor([[7]]), cache, logits_for="last", feature_layers=(1, 2)))
    cached = cache.length
    rows = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, cached, dtype=torch.bool), rows], dim=1)[None, None]
    out.append(target.forward(torch.tensor([[9, 40, 41]]), cache, positions=torch.tensor([[0, 1, 1]]) + cached,
                              mask=mask, logits_for="all", feature_layers=(1, 2)))
    return [(o.logits, o.features) for o in out]


def test_auto_compiles_on_cuda_only():
    assert compiles("auto", torch.device("cuda")) and not compiles("auto", torch.device("cpu"))
    assert compiles("on", torch.device("cpu")) and not compiles("off", torch.device("cuda"))


def test_the_compiled_forward_computes_what_the_eager_one_does(capsys):
    compiled = tiny_target("on")
    assert compiled.compiled and "compiled" in compiled.runtime
    compiled.warm_up()
    assert "compiling the target's forward" in capsys.readouterr().err and compiled.compile_seconds > 0
    eager = Target(compiled.model, compiled.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off"))
    assert not eager.compiled
    for (logits, features), (eager_logits, eager_features) in zip(steps(compiled), steps(eager)):
        torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, eager_features, rtol=1e-4, atol=1e-4)
    assert_compiled_whole()


def test_a_deeper_model_compiles_no_more_graphs():
    """One layer is compiled and every layer runs it (regional compilation): the graphs a prefill,
    a token and a tree step compile are as many for 5 layers as for 2, so compiling costs one layer's
    time whatever the depth (a whole 24-layer forward did not finish compiling in a GPU block)."""
    graphs = []
    for layers in (2, 5):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        spec = ModelSpec(model="tiny", dtype="float32", device="cpu", compile="on")
        steps(Target(build_model("qwen2", num_hidden_layers=layers), build_tokenizer(), "tiny", spec=spec))
        assert_compiled_whole()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], graphs


@pytest.mark.skipif(woq_kernel.unavailable_reason() is not None,
                    reason=f"specchat's kernel does not run here: {woq_kernel.unavailable_reason()}")
def test_the_quantized_kernel_compiles_into_the_graph():
    compiled = tiny_target("on", quantize_bits=5)
    assert isinstance(compiled.lm_head, quantized.QuantizedLinear)  # the tiny sizes tile into the kernel's blocks
    eager = Target(compiled.model, compiled.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off"))
    for (logits, _), (eager_logits, _) in zip(steps(compiled), steps(eager)):
        # The kernel rounds each token's activations to 8 bits, so the last bits in which inductor's
        # norms differ from eager ones can move a logit by a rounding step (~0.1 here): close, same choices.
        assert torch.equal(logits.argmax(-1), eager_logits.argmax(-1))
        assert (logits - eager_logits).abs().max() <= 0.03 * (eager_logits.max() - eager_logits.min())
    assert_compiled_whole()


def test_speculative_greedy_through_the_compiled_forward_equals_plain_greedy():
    compiled = tiny_target("on")
    eager = Target(compiled.model, compiled.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off"))
    settings = GenerationSettings(max_new_tokens=12)
    plain = tokens_of(Engine(eager), PROMPT, settings)
    assert tokens_of(Engine(compiled), PROMPT, settings) == plain
    head = heads.for_target(random_head("eagle", compiled), compiled,
                            DynamicTree(DynamicTreeParams(total_tokens=8, depth=3, top_k=3)))
    proposers = {"eagle2": head, "pld": prompt_lookup.for_target(compiled),
                 "scripted": ScriptedProposer(PROMPT, plain, depth=4)}  # deep acceptance through tree masks
    for name, proposer in proposers.items():
        assert tokens_of(Engine(compiled, proposer), PROMPT, settings) == plain, name
    assert_compiled_whole()


def test_the_fixed_envelope_steps_through_the_compiled_forward_as_plain_greedy_does():
    """`--compile on` with the fixed layout (`--cuda-graphs on`; eager steps on a CPU, captured on
    CUDA): the steps' forward is the compiled one, the heads' layers too, and decoding stays lossless
    through them."""
    compiled = tiny_target("on", cuda_graphs="on")
    assert compiled.compiled and compiled.envelope is not None
    eager = Target(compiled.model, compiled.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off"))
    settings = GenerationSettings(max_new_tokens=12)
    plain = tokens_of(Engine(eager), PROMPT, settings)
    assert tokens_of(Engine(compiled), PROMPT, settings) == plain
    tree = DynamicTreeParams(total_tokens=8, depth=3, top_k=3)
    head = heads.for_target(random_head("eagle", compiled), compiled, DynamicTree(tree))
    jakiro = heads.for_target(random_head("jakiro", compiled), compiled, JakiroTree(tree))  # forward_both
    assert head.layer is not head.head  # the head's layer is compiled with the target's forward
    proposers = {"eagle2": head, "jakiro": jakiro, "pld": prompt_lookup.for_target(compiled),
                 "scripted": ScriptedProposer(PROMPT, plain, depth=4, device="cpu")}  # device trees: the fixed layout's
    for name, proposer in proposers.items():
        assert tokens_of(Engine(compiled, proposer), PROMPT, settings) == plain, name
    assert_compiled_whole()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_forward_is_the_default_without_graphs_and_lossless():
    model = build_model("qwen2", num_hidden_layers=2).cuda()
    target = Target(model, build_tokenizer(), "tiny",
                    spec=ModelSpec(model="tiny", dtype="float32", device="cuda", cuda_graphs="off"))
    assert target.compiled
    target.warm_up()
    eager = Target(model, target.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off"))
    settings = GenerationSettings(max_new_tokens=12)
    plain = tokens_of(Engine(eager), PROMPT, settings)
    assert tokens_of(Engine(target, prompt_lookup.for_target(target)), PROMPT, settings) == plain
    assert_compiled_whole()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_captured_steps_of_the_compiled_forward_are_lossless():
    model = build_model("qwen2", num_hidden_layers=2).cuda()
    spec = ModelSpec(model="tiny", dtype="float32", device="cuda", compile="on")
    target = Target(model, build_tokenizer(), "tiny", spec=spec)
    assert target.compiled and target.captures
    eager = Target(model, target.tokenizer, "tiny", spec=ModelSpec(model="tiny", compile="off", cuda_graphs="off"))
    settings = GenerationSettings(max_new_tokens=12)
    plain = tokens_of(Engine(eager), PROMPT, settings)
    for proposer in (None, prompt_lookup.for_target(target), ScriptedProposer(PROMPT, plain, depth=4, device="cuda")):
        engine = Engine(target, proposer)
        # A step shape is captured the second time it runs, and in 12 tokens the scripted tree's shapes
        # run once each: the second answer replays what the first captured.
        for _ in range(2):
            assert tokens_of(engine, PROMPT, settings) == plain
        assert engine.layout.graphs.failure is None and engine.layout.graphs.graphs  # captured, not eager
    assert_compiled_whole()
