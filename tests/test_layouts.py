"""The engine's two layouts: every method exact on each (the fixed one's steps run eagerly on a CPU:
what a GPU would replay is exactly what runs here), the same trees on both, and the fixed layout's
promises: one host read per step and none inside a step, a bounded set of shapes whatever the
conversation's length. Capturing the steps as CUDA graphs is checked where there is CUDA
(`test_cuda_*`, skipped elsewhere).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import (assert_samples_follow_the_target, load_tiny_target, oracle_head, random_head, save_model_folder,
                      tokens_of)
from drafters import save_head
from specchat.decode.acceptance.sampling import SamplingParams
from specchat.decode.acceptance.verify import accept_fixed
from specchat.runtime_check import ScriptedTree
from specchat.decode.drafting.tree import DraftTree, Source
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.runtime.envelope import Envelope, HostInputs, powers_of_two, window_mask
from specchat.decode.engine.fixed import padded
from specchat.decode.runtime.graphs import StepGraphs
from specchat.decode.runtime.target import compiles, fixed_steps
from specchat.errors import ModelLoadError
from specchat.proposers import build_proposer
from specchat.settings import Settings

PROMPT = [258, 10, 20, 30, 40, 50, 198, 10, 20, 30]  # repeats itself: prompt lookup finds drafts
TREE = dict(total_tokens=16, depth=5, tree_top_k=4)
METHODS = ["vanilla", "pld", "sps", "eagle", "eagle2", "deagle", "jakiro", "deagle+lookup", "eagle+lookup"]


@pytest.fixture(scope="module")
def target(qwen_dir, layout):
    return load_tiny_target(qwen_dir, layout=layout)


@pytest.fixture(scope="module")
def fixed(qwen_dir):
    return load_tiny_target(qwen_dir, layout="fixed")


@pytest.fixture(scope="module")
def growing(qwen_dir):
    return load_tiny_target(qwen_dir, layout="growing")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """sps's draft: another architecture and other weights, the same tokenizer."""
    return save_model_folder(tmp_path_factory.mktemp("draft-llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def heads(qwen_dir, tmp_path_factory):
    """A random head folder of each format for the tiny target."""
    target, folders = load_tiny_target(qwen_dir), {}
    for kind in ("eagle", "eagle3", "jakiro"):
        folders[kind] = tmp_path_factory.mktemp(f"head-{kind}")
        save_head(random_head(kind, target), folders[kind])
    return folders


def method_settings(label: str, heads, draft_dir) -> Settings:
    name, _, lookup = label.partition("+")
    draft = {"eagle": heads["eagle"], "eagle2": heads["eagle3"], "deagle": heads["eagle3"], "jakiro": heads["jakiro"],
             "sps": draft_dir}.get(name)
    return Settings(method=name, draft=None if draft is None else str(draft), lookup=bool(lookup), draft_tokens=4,
                    **TREE)


def engine_for(label, target, heads, draft_dir) -> Engine:
    """The method on `target`'s layout, built as chat builds it (sps's draft loaded alike)."""
    layout = "growing" if target.envelope is None else "fixed"
    load = lambda name: load_tiny_target(name, layout=layout)  # noqa: E731
    return Engine(target, build_proposer(method_settings(label, heads, draft_dir), target, load))


# --- exact output --------------------------------------------------------------------------------


@pytest.mark.parametrize("label", METHODS)
def test_every_method_is_exact_on_either_layout(label, target, growing, heads, draft_dir):
    """Greedy float32 output equals plain decoding's, over a conversation of three turns (the second
    reusing the cached prefix, the third after an interruption) and at a one-token budget."""
    engine, plain = engine_for(label, target, heads, draft_dir), Engine(growing)
    conversation = list(PROMPT)
    for max_new in (40, 1, 25):
        settings = GenerationSettings(max_new_tokens=max_new)
        answer = tokens_of(engine, conversation, settings)
        assert answer == tokens_of(plain, conversation, settings)
        conversation += answer + [198, 10, 20]
    stream = engine.generate(conversation, GenerationSettings(max_new_tokens=30))
    next(stream), next(stream)
    stream.close()  # Ctrl-C after two steps: caches cut back to what is committed
    conversation += [198]
    assert tokens_of(engine, conversation, settings) == tokens_of(plain, conversation, settings)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "jakiro"])
def test_both_layouts_draft_the_same_trees(kind, fixed, growing, heads, draft_dir):
    """The same shapes grown through fixed slots give the same verified nodes, cycle by cycle."""
    label = {"eagle": "eagle", "eagle3": "deagle", "jakiro": "jakiro"}[kind]
    settings = GenerationSettings(max_new_tokens=30)
    fixed_steps_, growing_steps = (list(engine_for(label, target, heads, draft_dir).generate(PROMPT, settings))
                                   for target in (fixed, growing))
    assert len(fixed_steps_) == len(growing_steps)
    produced = 1
    for ours, theirs in zip(fixed_steps_[1:], growing_steps[1:]):
        room = settings.max_new_tokens - produced
        if room > 8:  # near the end the growing layout drafts no deeper than the room, the fixed tree stays whole
            assert paths(ours.cycle.tree) == paths(theirs.cycle.tree)
        assert ours.tokens == theirs.tokens
        produced += len(ours.tokens)


@pytest.mark.parametrize("seed", range(6))
def test_lookup_chains_merge_on_the_device_as_on_the_host(seed):
    """`merge_lookup` + `select_fixed` choose what `Candidates.add_chain` + `select` choose, on random
    tables and chains that share prefixes with the head's nodes (and one that does not)."""
    from specchat.decode.drafting.selection import Candidates, merge_lookup, select_fixed
    from specchat.decode.drafting.growth import CandidateTable

    generator = torch.Generator().manual_seed(seed)
    k, depth = 3, 4
    size = k + (depth - 1) * k * k
    table = CandidateTable.allocate(size, "cpu")
    logps = torch.rand(size, generator=generator).clamp(min=0.05).log()
    table.write(0, torch.tensor([3, 7, 11]), -1, 1, logps[:k], logps[:k])
    beam = torch.arange(k)
    for level in range(1, depth):
        first = k + (level - 1) * k * k
        parents = beam.repeat_interleave(k)
        tokens = torch.tensor([100 * level + 10 * p % 7 + c for p in range(k) for c in range(k)])
        scores = table.scores[parents] + logps[first : first + k * k]
        table.write(first, tokens, parents, level + 1, logps[first : first + k * k], scores)
        beam = first + scores.topk(k).indices
    # chain 0 follows the best node's path two levels and goes on; chain 1 starts where no node is
    best = int(table.scores[k : k + k * k].argmax()) + k
    spelled = [int(table.tokens[int(table.parents[best])]), int(table.tokens[best]), 555, 556, 557]
    chains = torch.tensor([spelled + [0] * 3, [999, 998, 997] + [0] * 5])
    lengths = torch.tensor([5, 3])
    # each token's own rate and evidence (`LookupRates.along`); past a chain's length the device form's rate 1
    accept = torch.rand(2, 8, generator=generator).clamp(min=0.05).masked_fill(torch.arange(8) >= lengths[:, None], 1.0)
    evidence = torch.randint(1, 12, (2, 8), generator=generator)
    host = Candidates.from_table(table)
    for chain, length, rates, strengths in zip(chains.tolist(), lengths.tolist(), accept.tolist(), evidence.tolist()):
        host.add_chain(chain[:length], rates[:length], strengths[:length])
    keep = 12
    ours = select_fixed(merge_lookup(table, chains, lengths, accept.log(), depth, evidence), keep, 8)
    theirs = host.select(keep)
    kept = [i for i in range(keep) if bool(ours.valid[i])]
    tree = type(theirs)(tokens=[int(ours.tokens[i]) for i in kept],
                        parents=[kept.index(int(ours.parents[i])) if int(ours.parents[i]) >= 0 else -1 for i in kept],
                        depths=[int(ours.depths[i]) for i in kept], probs=[1.0] * len(kept))
    assert paths(tree) == paths(theirs)
    ours_by_path = {path: (int(ours.sources[kept[i]]), int(ours.evidence[kept[i]])) for i, path in enumerate(walks(tree))}
    theirs_by_path = {path: (theirs.sources[i], theirs.evidence[i]) for i, path in enumerate(walks(theirs))}
    assert ours_by_path == theirs_by_path


def walks(tree) -> list[tuple[int, ...]]:
    """Per node, the token path that reaches it."""
    found = []
    for token, parent in zip(tree.tokens, tree.parents):
        found.append((found[parent] if parent >= 0 else ()) + (token,))
    return found


def paths(tree) -> set[tuple[int, ...]]:
    """A tree's nodes as the token paths that reach them (order-free)."""
    return set(walks(tree))


def test_an_oracle_is_accepted_exactly_as_deep_as_scripted(target, growing):
    plain = tokens_of(Engine(growing), PROMPT, GenerationSettings(max_new_tokens=40))
    for nodes, depth in ((7, 3), (15, 1), (4, 4)):
        oracle = ScriptedTree(PROMPT + plain, target, nodes, depth)
        steps = list(Engine(target, oracle).generate(PROMPT, GenerationSettings(max_new_tokens=40)))
        assert [t for s in steps for t in s.tokens] == plain
        assert all(len(s.tokens) == depth + 1 for s in steps[1:-1])  # tau = depth + 1 until the budget's end


def test_a_head_that_is_always_right_goes_deep(bigram_dir, layout, tmp_path):
    bigram = load_tiny_target(bigram_dir, layout=layout)
    save_head(oracle_head(bigram), tmp_path / "oracle")
    engine = Engine(bigram, build_proposer(Settings(method="deagle", draft=str(tmp_path / "oracle"), **TREE), bigram))
    steps = list(engine.generate(PROMPT, GenerationSettings(max_new_tokens=40)))
    assert [t for s in steps for t in s.tokens] == tokens_of(Engine(load_tiny_target(bigram_dir)), PROMPT,
                                                             GenerationSettings(max_new_tokens=40))
    assert sum(len(s.tokens) for s in steps[1:]) / len(steps[1:]) >= 4


# --- exact sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["vanilla", "pld", "sps", "deagle", "jakiro", "deagle+lookup"])
def test_sampling_follows_the_target_distribution(label, target, heads, draft_dir):
    """The first two tokens of sampled replies against the exact distribution (chi-square): either
    layout's acceptance rules (the fixed one's: one draw per row, a sampled chain's p/q rule) are exact."""
    engine = engine_for(label, target, heads, draft_dir)
    assert_samples_follow_the_target(engine, target, [258, 40, 41, 40], top_k=4, runs=600)


def test_sampled_chains_are_accepted_by_the_p_over_q_rule_and_stay_exact(target, qwen_dir, layout):
    """sps with the target as its own draft (q = p): the chain's rule accepts nearly every token."""
    engine = Engine(target, build_proposer(Settings(method="sps", draft=str(qwen_dir), draft_tokens=3), target,
                                           lambda name: load_tiny_target(name, layout=layout)))
    drafted = []
    assert_samples_follow_the_target(engine, target, [258, 40, 41, 40], top_k=4, runs=400, drafted=drafted)
    assert drafted[-1] > 0.9 * 400


def test_sampling_with_an_oracle_head_accepts_and_stays_exact(bigram_dir, layout, tmp_path):
    bigram = load_tiny_target(bigram_dir, layout=layout)
    save_head(oracle_head(bigram), tmp_path / "oracle")
    engine = Engine(bigram, build_proposer(Settings(method="eagle2", draft=str(tmp_path / "oracle"), **TREE), bigram))
    drafted = []
    assert_samples_follow_the_target(engine, bigram, [258, 40, 41], top_k=4, runs=600, drafted=drafted)
    assert drafted[-1] > 100


# --- the fixed layout's promises: one read per step, none inside, few shapes ----------------------------

# Operations that wait for the device on CUDA: a scalar read, or an output whose size depends on
# the data (the host must learn it). Plus tensors made from host data, which a CUDA graph cannot
# replay (their copy from the host is not captured).
SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave.Tensor",
         "equal", "is_nonzero")
HOST_DATA = ("lift_fresh", "lift_fresh_copy")


class Watch(TorchDispatchMode):
    """Counts the host reads (and host data) that the operations dispatched under it make."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.host_data: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        full = str(func.overloadpacket.__name__) + "." + func._overloadname
        if any(full.startswith(s) or name == s for s in SYNCS):
            self.reads.append(full)
        if any(full.startswith(h) for h in HOST_DATA):
            self.host_data.append(full)
        return func(*args, **(kwargs or {}))


@contextmanager
def watched_reads(monkeypatch):
    """Every host read under it: `Watch`'s, and `tolist`/`numpy`, which a CPU tensor serves without dispatch."""
    watch = Watch()
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _name=method, **kwargs):
            watch.reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    with watch:
        yield watch


@pytest.mark.parametrize("label", METHODS)
def test_one_host_read_per_step_and_none_inside_a_replayed_step(label, fixed, heads, draft_dir, monkeypatch):
    engine = engine_for(label, fixed, heads, draft_dir)
    list(engine.generate(PROMPT, GenerationSettings(max_new_tokens=20)))  # every step has run once (warm-up)
    inside, run = [], StepGraphs.run

    def replay(self, key, step, generator=None):  # what a graph would replay: must read nothing from the host
        watch = Watch()
        with watch:
            run(self, key, step, generator)
        inside.append((key[0], watch.reads, watch.host_data))

    monkeypatch.setattr(StepGraphs, "run", replay)
    conversation = PROMPT + [198, 10, 20]
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_k=8)):
        settings = GenerationSettings(max_new_tokens=24, sampling=sampling)
        with watched_reads(monkeypatch) as watch:
            stream = engine.generate(conversation, settings, torch.Generator().manual_seed(0))
            next(stream)  # the prefill (eager, not a cycle)
            for _ in range(20):
                before = len(watch.reads)
                step = next(stream, None)
                if step is None:
                    break
                assert len(watch.reads) - before == 1, f"{label}: host reads in one step: {watch.reads[before:]}"
    replayed = [entry for entry in inside if entry[0] in ("draft", "verify", "plain")]
    assert replayed
    for kind, reads, host_data in replayed:
        assert not reads and not host_data, f"{label}: the {kind} step read the host: {reads + host_data}"


def test_the_shapes_reaching_the_target_are_bounded_whatever_the_length(fixed, heads, draft_dir):
    """A long conversation (crossing attention windows, prefills of every size) meets only the
    envelope's buckets of rows, and its spans; the steps' keys stay few."""
    engine = engine_for("deagle+lookup", fixed, heads, draft_dir)
    shapes, forward = set(), fixed.own_forward.at

    def recording(input_ids, cache, positions, mask, slots, span, feature_layers):
        shapes.add((input_ids.shape[1], span))
        return forward(input_ids, cache, positions, mask, slots, span, feature_layers)

    fixed.own_forward.at = recording
    try:
        conversation = list(PROMPT)
        for turn in range(6):
            conversation += tokens_of(engine, conversation, GenerationSettings(max_new_tokens=60)) + \
                list(range(30, 30 + 7 * turn))
    finally:
        del fixed.own_forward.at
    envelope = fixed.envelope
    assert len(conversation) > envelope.spans[0]  # the conversation crossed a window
    rows = {n for n, _ in shapes}
    assert rows <= set(envelope.buckets) and len(rows) <= len(envelope.buckets)
    assert {span for _, span in shapes} <= set(envelope.spans)
    assert len(engine.layout.graphs.warmed) <= 3 * len(envelope.spans)  # plain, draft, verify per window at most


# --- the fixed layout's pieces ---------------------------------------------------------------------


def test_envelope_buckets_and_spans():
    envelope = Envelope.for_target(max_context=2000, bytes_per_position=1000, free_bytes=None)
    assert envelope.capacity == 2000 + 512 and envelope.max_context == 2000
    assert envelope.spans == powers_of_two(256, 2512) and envelope.spans[-1] == 2512
    assert envelope.rows_for(1) == 1 and envelope.rows_for(60) == 64 and envelope.rows_for(300) == 512
    assert envelope.span_for(257) == 512
    with pytest.raises(ValueError):
        envelope.rows_for(513)
    tight = Envelope.for_target(max_context=32768, bytes_per_position=1000, free_bytes=8_000_000)
    assert tight.capacity == 2000  # a quarter of the free memory


def test_window_mask_marks_the_context_and_the_block():
    block = torch.tensor([[True, False], [True, True]])
    mask = window_mask(block, torch.tensor(3), torch.tensor(4), span=8)[0, 0]
    assert mask.tolist() == [[True, True, True, False, True, False, False, False],
                             [True, True, True, False, True, True, False, False]]


def test_host_inputs_are_declared_fields_the_step_reads_as_tensors():
    inputs = HostInputs(torch.device("cpu"), length=(), chains=(2, 3), lengths=2)
    inputs.write(length=7, chains=[[5, 6, 7], [8]], lengths=[3, 1])
    assert int(inputs.length) == 7 and inputs.length.dim() == 0
    assert inputs.chains.tolist() == [[5, 6, 7], [8, 0, 0]] and inputs.lengths.tolist() == [3, 1]
    inputs.write(chains=[[9]], lengths=[1])  # a field written again keeps nothing of before
    assert inputs.chains.tolist() == [[9, 0, 0], [0, 0, 0]] and int(inputs.length) == 7


def test_padding_nodes_are_never_accepted():
    tree = padded(DraftTree.device_chain(torch.tensor([5, 6]), torch.tensor([True, True]), source=Source.LOOKUP), 4)
    logits = torch.full((5, 10), -10.0)
    logits[0, 5] = logits[1, 6] = 10.0  # the chain is right...
    logits[2, 0] = 10.0  # ...and a padding node holds the token the target wants next: still never accepted
    result = accept_fixed(tree, logits, SamplingParams(), None, torch.tensor(10))
    assert int(result.count) == 2 and int(result.bonus) == 0
    assert int(accept_fixed(tree, logits, SamplingParams(), None, torch.tensor(1)).count) == 1  # the room's limit


def test_cuda_graphs_setting_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fixed_steps("auto", cuda) and not fixed_steps("auto", cpu) and fixed_steps("on", cpu)
    assert not fixed_steps("off", cuda)
    # auto compiles on CUDA on either layout (on the fixed one, the forward its captured steps run) and
    # not on a CPU; on compiles anywhere.
    assert compiles("auto", cuda) and not compiles("auto", cpu)
    assert compiles("on", cuda) and compiles("on", cpu) and not compiles("off", cuda)
    with pytest.raises(ModelLoadError, match="unknown --cuda-graphs"):
        fixed_steps("sometimes", cpu)


def test_the_runtime_says_what_runs_it(fixed, growing):
    assert "fixed-shape steps (eager)" in fixed.runtime and fixed.envelope is not None and not fixed.captures
    assert growing.envelope is None and "fixed" not in growing.runtime


# --- CUDA: the same steps, captured -----------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("label", ["vanilla", "eagle2", "deagle+lookup", "sps"])
def test_cuda_captured_steps_replay_what_eager_steps_compute(label, qwen_dir, heads, draft_dir):
    """On CUDA the steps are captured (the second run) and replayed; the output equals the eager
    fixed steps' and plain decoding's, and no replayed step synchronizes with the host."""
    from specchat.decode.runtime.target import ModelSpec
    from specchat.sources import load_target

    # The eager forward captured (the compiled one inside the steps: test_compile's own CUDA test).
    on_cuda = dict(dtype="float32", device="cuda", compile="off")
    target = load_target(ModelSpec(model=str(qwen_dir), cuda_graphs="on", **on_cuda))
    settings = dataclasses.replace(method_settings(label, heads, draft_dir), device="cuda", compile="off")
    load = lambda name: load_target(ModelSpec(model=str(name), **on_cuda))  # noqa: E731
    engine, plain = Engine(target, build_proposer(settings, target, load)), Engine(target)
    plain.layout.graphs.capture = False
    generation = GenerationSettings(max_new_tokens=40)
    assert tokens_of(engine, PROMPT, generation) == tokens_of(plain, PROMPT, generation)
    assert engine.layout.graphs.graphs and engine.layout.graphs.failure is None
    run = StepGraphs.run

    def strict(self, key, step, generator=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(self, key, step, generator)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    StepGraphs.run = strict
    try:
        assert tokens_of(engine, PROMPT + [198], generation) == tokens_of(plain, PROMPT + [198], generation)
    finally:
        StepGraphs.run = run
