"""Shared fixtures: a tiny byte-level tokenizer with a ChatML template and tiny random models.

Everything here is built in seconds on a CPU and saved as ordinary Hugging Face folders, so the
tests load models through the same code path users take.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from specchat.decode.drafting.tree import DraftTree
from specchat.decode.runtime.calibrate import Curve
from specchat.decode.engine.growing import verify_inputs

# Tests must never wait on the network or write into the user's real cache and config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A shell starts a background job with SIGINT ignored, and children inherit that: the tests that
# press Ctrl-C (on this process or on a child) then waited forever. Python's own handler, as in a
# terminal (a child gets the default action back, and Python's handler with it).
signal.signal(signal.SIGINT, signal.default_int_handler)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 288  # 256 bytes + 3 specials, padded like real models' embedding tables


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=257, eos_token_id=256, pad_token_id=257, tie_word_embeddings=False,
    )
    common.update(overrides)
    return {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(arch, LlamaConfig)(**common)


def build_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    # Large output weights give well-separated logits, so greedy choices never hinge on rounding.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 1.0)
    return model.eval()


def save_model_folder(path, arch: str, seed: int = 0, **overrides):
    model = build_model(arch, seed, **overrides)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_model_dir(request, tmp_path_factory):
    """A tiny random model folder of each architecture."""
    return save_model_folder(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return save_model_folder(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session", autouse=True)
def core_messages():
    """The core's messages (logging) on stderr as the command line shows them, in every test."""
    from specchat.logs import show_core_messages

    show_core_messages()


def isolate(patch: pytest.MonkeyPatch, root) -> None:
    """Caches, profiles and history under `root`, out of the user's home (the cache stays the real one
    where SPECCHAT_TEST_REAL_CACHE asks for it)."""
    if os.environ.get("SPECCHAT_TEST_REAL_CACHE") is None:
        patch.setenv("SPECCHAT_CACHE_DIR", str(root / "cache"))
    patch.setenv("XDG_CONFIG_HOME", str(root / "config"))
    patch.setenv("XDG_STATE_HOME", str(root / "state"))


@pytest.fixture(scope="session", autouse=True)
def isolated_session_dirs(tmp_path_factory):
    """What module- and session-scoped fixtures write (a chat opened once for a module's tests measured
    its verify-cost curve into the user's cache) goes to the run's folders: they are set up before
    any test's own."""
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, tmp_path_factory.mktemp("session-dirs"))
        yield


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Each test's caches, profiles and history in folders of its own."""
    isolate(monkeypatch, tmp_path)


LAYOUTS = {"growing": "off", "fixed": "on"}  # the engine's layouts, by the --cuda-graphs that gives each on a CPU


@pytest.fixture(params=list(LAYOUTS), scope="module")
def layout(request) -> str:
    """Each of the engine's layouts in turn (the fixed one runs its steps eagerly on a CPU)."""
    return request.param


def load_tiny_target(path, dtype: str = "float32", layout: str | None = None, **spec):
    """A tiny model folder loaded on the CPU, for `layout` (`spec`: more `ModelSpec` fields, e.g. cuda_graphs="on")."""
    if layout is not None:
        spec["cuda_graphs"] = LAYOUTS[layout]
    from specchat.decode.runtime.target import ModelSpec
    from specchat.sources import load_target

    return load_target(ModelSpec(model=str(path), dtype=dtype, device="cpu", **spec))


FLAT_COSTS = {1: 10.0, 4: 10.0, 8: 11.0, 16: 12.0, 32: 14.0}  # ms by tokens: verifying more costs little


class GivenCurve(Curve):
    """A verify-cost curve as given, which live forwards leave alone. A tiny model's forward takes a
    fraction of a millisecond, as noisy as the machine running the tests: observed, it would rescale
    and heal the curve (`Curve.observe`) so that what a test's drafter selects hung on timing (a
    lookup chain the test needed verified went unverified on one CI machine). It holds its own copy of
    the costs it is given, so a table the tests share stays as written."""

    def __post_init__(self):
        self.milliseconds = dict(self.milliseconds)
        super().__post_init__()

    def observe(self, n: int, milliseconds: float) -> None:
        pass


STOPPED_AT = 100.0  # what `stop_the_clock` leaves the drafting modules' clock at


def stop_the_clock(monkeypatch, *modules: str) -> None:
    """The named modules' `time.perf_counter` stopped at STOPPED_AT: the rate rules weigh the cycle's
    time so far, which a loaded machine (a stall, a garbage collection) would otherwise make long
    enough to turn what a test checks."""
    stopped = SimpleNamespace(perf_counter=lambda: STOPPED_AT)
    for module in modules:
        monkeypatch.setattr(f"{module}.time", stopped)


# ---------------------------------------------------------------------------------------------
# Draft heads for tests


def head_config(kind: str, **overrides):
    from drafters.eagle import EagleConfig
    from drafters.eagle3 import Eagle3Config
    from drafters.jakiro import JakiroConfig

    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=TINY_VOCAB)
    common.update(overrides)
    if kind == "eagle3":
        return Eagle3Config(**{"draft_vocab_size": 100, **common})
    return (EagleConfig if kind == "eagle" else JakiroConfig)(**common)


def random_head(kind: str, target, seed: int = 0, **overrides):
    from drafters.eagle import EagleHead
    from drafters.eagle3 import Eagle3Head
    from drafters.jakiro import JakiroHead

    torch.manual_seed(seed)
    config = head_config(kind, **overrides)
    if kind in ("eagle", "jakiro"):
        return (EagleHead if kind == "eagle" else JakiroHead)(config, target.embed_tokens, target.lm_head).eval()
    head = Eagle3Head(config, target.embed_tokens)
    if hasattr(head, "d2t"):
        used = torch.randperm(TINY_VOCAB)[: config.draft_vocab_size].sort().values  # a draft vocabulary
        head.d2t.copy_(used - torch.arange(config.draft_vocab_size))
        head.t2d.zero_()[used] = True
        head.refresh_vocab_map()
    return head.eval()


def bigram_model_dir(path):
    """A target whose layers add nothing: its next token depends on the current token alone."""
    model = build_model("qwen2", seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def oracle_head(target):
    """An EAGLE-1 head that drafts exactly the greedy choices of a `bigram_model_dir` target.

    It outputs (a multiple of) the embedding of its input token; the target's LM head on it ranks
    tokens as the target does after that token (the target's feature is the same vector, RMS-normalised).
    """
    from drafters.eagle import EagleHead

    H = target.hidden_size
    head = EagleHead(head_config("eagle"), target.embed_tokens, target.lm_head)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = 100 * torch.eye(H)  # confident drafts, so dynamic trees grow deep
        head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return head.eval()


@pytest.fixture(scope="session")
def bigram_dir(tmp_path_factory):
    return bigram_model_dir(tmp_path_factory.mktemp("tiny-bigram"))


class ScriptedProposer:
    """Drafts the known plain-greedy continuation as the best path of a branching tree, on either layout.

    Each level holds the right token plus `siblings` wrong ones (some listed before it), each with
    a wrong child of its own, so trees have real branches: verification must follow the right
    path at every depth, which only works if tree masks, positions and cache compaction are right.
    """

    feature_layers = None
    reach = 0

    CAPACITY = 64  # the most nodes a device tree holds

    def __init__(self, prompt: list[int], continuation: list[int], depth: int = 5, siblings: int = 2, seed: int = 0,
                 device=None):
        """`device`: where the fixed layout wants its trees (None: the growing layout's lists). There a
        cycle's tree is written to device buffers before its draft step (`prepare`, on the host) and
        the step reads them (`draft`), as the real proposers' steps do: a step captured as a CUDA graph
        may not copy from the host, and its replays read what the buffers hold then."""
        from specchat.decode.runtime.envelope import HostInputs

        self.script = list(prompt) + list(continuation)
        self.depth, self.siblings, self.device = depth, siblings, device
        self.context: list[int] = []
        self.rng = torch.Generator().manual_seed(seed)
        self.tree = None
        self.inputs = None if device is None else HostInputs(torch.device(device), tokens=self.CAPACITY,
                                                             parents=self.CAPACITY, depths=self.CAPACITY)

    def rewind(self, length: int) -> int:
        del self.context[length:]
        return len(self.context)

    def observe(self, tokens, features) -> None:
        self.context.extend(tokens)

    def predict(self, tokens) -> None:
        pass  # it drafts the script, whatever text is predicted

    def committed(self, tokens, cycle) -> None:
        self.context.extend(tokens)

    def commit(self, tree, acceptance, root, features) -> None:
        pass

    def prepare(self, root, max_depth, max_nodes) -> int:
        from specchat.decode.drafting.tree import DraftTree

        start = len(self.context) + 1  # the script position right after the root
        right = self.script[start : start + min(self.depth, max_depth)]
        tokens, parents, depths = [], [], []
        parent = -1
        for level, token in enumerate(right, start=1):
            wrong = [int(t) for t in torch.randint(0, 250, (self.siblings,), generator=self.rng) if int(t) != token]
            order = wrong[:1] + [token] + wrong[1:]  # a wrong sibling first, then the right one
            here = None
            for candidate in order:
                tokens.append(candidate)
                parents.append(parent)
                depths.append(level)
                if candidate == token and here is None:
                    here = len(tokens) - 1
                else:  # a wrong branch one level deeper
                    tokens.append((candidate + 7) % 250)
                    parents.append(len(tokens) - 2)
                    depths.append(level + 1)
            parent = here
        keep = _topological_prefix(parents, max_nodes)
        self.tree = DraftTree(tokens=[tokens[i] for i in keep], probs=[0.5] * len(keep),
                              parents=[keep.index(parents[i]) if parents[i] >= 0 else -1 for i in keep],
                              depths=[depths[i] for i in keep])
        if self.inputs is not None:
            assert len(self.tree) <= self.CAPACITY
            self.inputs.write(tokens=self.tree.tokens, parents=self.tree.parents, depths=self.tree.depths)
        return len(self.tree)

    def draft(self, root, length, span, sampling, rng):
        if self.device is None:
            return self.tree
        from specchat.decode.drafting.tree import DraftTree

        n, tokens = len(self.tree), self.inputs.tokens  # n is the step's shape: the layout keys its steps by it
        return DraftTree(tokens[:n], self.inputs.parents[:n], self.inputs.depths[:n], torch.full((n,), 0.5, device=tokens.device),
                         valid=tokens.new_ones(n, dtype=torch.bool), depth=self.depth + 1, sources=None, evidence=None)


def _topological_prefix(parents, limit):
    keep = []
    for node, parent in enumerate(parents):
        if len(keep) < limit and (parent < 0 or parent in keep):
            keep.append(node)
    return keep


# ---------------------------------------------------------------------------------------------
# Command line and statistics helpers


def invoke(args, capsys, monkeypatch=None, stdin=None):
    """Run `specchat ARGS` in-process; returns (exit status, stdout, stderr)."""
    import io

    from specchat.cli import main

    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as done:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return done.value.code, out, err


def tiny(model_dir, *extra):
    """Command-line options that select a tiny model folder, exactly and quickly."""
    return ["--model", str(model_dir), "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "6", *extra]


def interrupt_the_prompt_with(monkeypatch, word: str) -> None:
    """Ctrl-C arrives as the engine starts on a prompt that holds `word`."""
    from specchat.decode.engine.engine import Engine

    generate = Engine.generate

    def interrupted(self, prompt, settings, rng=None, prediction=None):
        if self.target.tokenizer.decode(prompt).count(word):
            raise KeyboardInterrupt
        yield from generate(self, prompt, settings, rng, prediction)

    monkeypatch.setattr(Engine, "generate", interrupted)


def tokens_of(engine, prompt, settings, rng=None):
    return [t for step in engine.generate(prompt, settings, rng) for t in step.tokens]


# Upper 0.001 points of the chi-square distribution, by degrees of freedom: the usual table values
# (NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4, "Critical values of the
# chi-square distribution", upper tail, probability of exceeding 0.001), to three decimals;
# test_verify.py recomputes them (scipy is not a dependency).
CHI2_LEVEL = 0.001
MIN_EXPECTED = 5  # draws each cell of a chi-square test must expect (see chi_square)
CHI2_CRITICAL = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
    10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 16: 39.252, 17: 40.790,
    18: 42.312, 19: 43.820, 20: 45.315,
}


def _as_mapping(values):
    """Counts or probabilities as {outcome: value}; a tensor's outcomes are its indices (zeros left out)."""
    if isinstance(values, torch.Tensor):
        return {index: value for index, value in enumerate(values.tolist()) if value}
    return {outcome: value for outcome, value in values.items() if value}


def chi_square(counts, probs) -> tuple[float, int]:
    """Pearson's statistic of observed `counts` against `probs`, and its degrees of freedom.

    Both are {outcome: value} mappings or tensors indexed by outcome. An outcome of probability 0
    that was observed fails at once: that is an error, not chance. The rarest outcomes are pooled
    into one cell until every cell expects at least MIN_EXPECTED draws: the chi-square law of the
    statistic, and so the false-alarm rate of CHI2_CRITICAL, holds only then (Cochran's rule);
    a cell that expects 0.1 draws adds 36 to the statistic when it gets 2 of them (the whole bound
    for 15 degrees of freedom is 37.7), which happens once in 200 samples. Simulated for the
    two-token check of 600 replies (16 pairs, 8 expecting under 5 draws): 1.1% of exact samples
    went past the bound unpooled, 0.16% pooled (8 degrees of freedom).
    """
    counts, probs = _as_mapping(counts), _as_mapping(probs)
    impossible = set(counts) - set(probs)
    assert not impossible, f"outcomes with zero target probability were produced: {sorted(impossible)[:5]}"
    assert abs(sum(probs.values()) - 1) < 1e-4, "the probabilities do not sum to 1"
    total = sum(counts.values())

    def expected(cell):
        return total * sum(probs[k] for k in cell)

    rest, pooled = sorted(probs, key=probs.get), []  # rarest first
    while rest and (expected(rest[:1]) < MIN_EXPECTED or 0 < expected(pooled) < MIN_EXPECTED):
        pooled.append(rest.pop(0))
    cells = [[k] for k in rest] + ([pooled] if pooled else [])
    assert len(cells) >= 2, f"{total} draws are too few for a chi-square test against these probabilities"
    statistic = sum((sum(counts.get(k, 0) for k in cell) - expected(cell)) ** 2 / expected(cell) for cell in cells)
    return statistic, len(cells) - 1


def assert_follows(sample, probs, seed: int) -> None:
    """Chi-square goodness of fit of sampled counts to `probs`, with a false-alarm rate that no
    machine's rounding can push up.

    `sample(seed)` draws the counts from a generator seeded with `seed`. A fixed-seed test at
    p = 0.001 is not deterministic across machines: the sample stream follows the CPU's float
    rounding (AVX2 and AVX-512 kernels round differently), so each machine sees its own draw and
    some machine fails by chance sooner or later. So a first statistic above the bound is not yet
    a failure: a second sample, from a generator seeded with seed + 1 (an independent stream), is
    drawn and the check fails only if it is above the bound too. For a correct sampler each
    exceeds the bound with probability 0.001 (0.0016 simulated, see chi_square), so a false alarm
    takes both: 0.001 * 0.001 = 1e-6 per test (0.0016 ** 2 = 3e-6), on any machine. A biased sampler whose samples are each rejected with probability
    (power) pi is rejected with pi ** 2: no loss where pi ~ 1, as for the wrong rules of the power
    checks (test_verify.py: statistic ~1900 against a bound of 24; test_speculative.py: ~150
    against 26), some for a bias at the edge of detection (pi = 0.5 becomes 0.25). The second
    sample costs time only after a first one failed.
    """
    statistics = []
    for attempt in (seed, seed + 1):
        statistic, dof = chi_square(sample(attempt), probs)
        statistics.append(round(statistic, 2))
        if statistic < CHI2_CRITICAL[dof]:
            return
    raise AssertionError(
        f"chi-square {statistics} (seeds {seed} and {seed + 1}) both above {CHI2_CRITICAL[dof]}, "
        f"the p = {CHI2_LEVEL} bound for {dof} degrees of freedom: the samples do not follow the distribution"
    )


def first_two_tokens(engine, prompt, top_k, runs, seed, drafted=None):
    """Counts of the first two tokens of `runs` replies sampled at temperature 1 with top-k.

    Three tokens each, so the second one can come from an accepted draft (the first is the
    prefill's); `drafted`, a list, receives how many second tokens were drafted ones.
    """
    from specchat.decode.engine.engine import GenerationSettings
    from specchat.decode.acceptance.sampling import SamplingParams, make_generator

    settings = GenerationSettings(max_new_tokens=3, sampling=SamplingParams(temperature=1.0, top_k=top_k))
    rng, counts, from_drafts = make_generator(seed), {}, 0
    for _ in range(runs):
        steps = list(engine.generate(prompt, settings, rng))
        pair = tuple([t for step in steps for t in step.tokens][:2])
        counts[pair] = counts.get(pair, 0) + 1
        if drafted is not None:
            from_drafts += [d for step in steps for d in step.drafted][1]
    if drafted is not None:
        drafted.append(from_drafts)
    return counts


def assert_samples_follow_the_target(engine, target, prompt, top_k, runs, seed=1, drafted=None):
    """The first two tokens of `runs` sampled replies against the exact target distribution (chi-square)."""
    joint = exact_two_token_distribution(target, prompt, top_k)
    assert_follows(lambda s: first_two_tokens(engine, prompt, top_k, runs, s, drafted), joint, seed)


def exact_two_token_distribution(target, prompt, top_k, temperature=1.0):
    """p(x1, x2) of plain sampling at `temperature` with top-k, from cache-free forwards."""
    def p_next(ids):
        logits = target.model(torch.tensor([ids])).logits[0, -1] / temperature
        return torch.softmax(torch.where(logits >= logits.topk(top_k).values[-1], logits, -torch.inf), -1)

    joint = {}
    with torch.no_grad():
        p1 = p_next(prompt)
        for x1 in p1.nonzero().flatten().tolist():
            p2 = p_next(prompt + [x1])
            for x2 in p2.nonzero().flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


FEATURE_LAYERS = (0, 1, 6)  # the embeddings, the first layer's output, the final normed state


def prefill_decode_and_tree(target, cache) -> list:
    """A prefill, one decoded token and a verified tree through `target`, each with its logits and the
    FEATURE_LAYERS' features: what two forwards of one model must agree on."""
    outputs = [target.forward(torch.tensor([[5, 9, 3, 17, 2, 11, 8, 100, 33]]), cache, feature_layers=FEATURE_LAYERS)]
    outputs.append(target.forward(torch.tensor([[12]]), cache, logits_for="last", feature_layers=FEATURE_LAYERS))
    tree = DraftTree(tokens=[40, 41, 90], parents=[-1, -1, 1], depths=[1, 1, 2], probs=[1.0] * 3)
    ids, positions, mask = verify_inputs(tree, 7, cache.length, "cpu")
    outputs.append(target.forward(ids, cache, positions=positions, mask=mask, feature_layers=FEATURE_LAYERS))
    return outputs
