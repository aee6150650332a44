"""`specchat runtime-check`: what the decoding runtime itself costs, measured without a model download.

A target of a real model's shape (the published config; random weights) is driven by an oracle
drafter that knows the answer: it first decodes a prompt plainly, then drafts that continuation
as a tree of a chosen size whose right path is a chosen depth (`ScriptedTree`), so every cycle
accepts exactly `depth` tokens (τ = depth + 1) and the drafting costs nothing. What is left is the
runtime: the verify forward of the padded tree, acceptance, compaction, the step launches.

    runtime efficiency = speedup over plain decoding / τ = ms per plain step / ms per cycle

1.0 means a cycle costs what one plain step does: every accepted token is a gain. With `--head`,
a random EAGLE-3 head of the bundled head's shape also drafts a full EAGLE-2 tree (60 tokens,
depth 6, top-10), to time the drafting the oracle leaves out.

    specchat runtime-check --shape qwen2.5-0.5b --device cuda           # on a GPU
    specchat runtime-check --shape qwen2.5-0.5b --layers 2 --tokens 32   # on a CPU, small
    specchat runtime-check --shape llama-3.1-8b --runtime fixed --depths 1 2 3 4 --head   # the seeds' scale

`--runtime` picks the engine's layout: `fixed` (CUDA graphs on CUDA, the same steps eagerly on a
CPU), `growing` (the growing cache, eager; `host` is its former name), `both` each in turn.
`--slots 256 512` times the decoding step of `specchat data regenerate` instead (continuous
batching, `specchat.train.batched.SlotDecoder`: every slot answering, captured on CUDA) at those
many slots, the deepest at `--spans` positions and the others spread down to an eighth of it, greedy
and with half the slots sampling, each slot reading the common span and (where flash attention runs)
its own positions alone; `--runtime none`
leaves the layouts out. `--trace DIR` writes a torch profiler trace of a few cycles (or slot steps) and its summary. Its options take
lists as argparse does (`--nodes 7 15 63`), so it parses them itself (`specchat.cli` hands it the
arguments); man/specchat-runtime-check.1 documents them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from drafters.eagle3 import Eagle3Config, Eagle3Head
from specchat.decode.drafting import heads
from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams
from specchat.decode.drafting.tree import DraftTree
from specchat.decode.engine.engine import Engine, GenerationSettings
from specchat.decode.runtime.machine import hardware
from specchat.decode.runtime.target import ModelSpec, Target
from specchat.errors import UsageError
from specchat.tracing import write_trace
from specchat.train.batched import SlotDecoder, SlotTimes, flash_varlen_failure

# The published configs (config.json of Qwen/Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, whose
# embedded GGUF files carry the same, and of meta-llama/Llama-3.1-8B-Instruct: the seeds' scale,
# where a verify step reads 16 GB of bfloat16 weights), as (family, fields).
QWEN = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
            hidden_act="silu", use_sliding_window=False)
LLAMA_3_1 = dict(max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", dict(QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-3.1-8b": ("llama", dict(LLAMA_3_1, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)),
    "tiny": ("qwen2", dict(QWEN, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=True, vocab_size=512)),  # for the test suite
    "tiny-llama": ("llama", dict(LLAMA_3_1, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),  # for the test suite
}
FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
# --head drafts with a random head of the bundled head's layout at the target's width and heads; at
# the 8B scale, of the published EAGLE-3 head's (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: the target's
# MLP width, a 32k draft vocabulary), whose drafting costs what a real one's does.
HEAD_FIELDS = {"llama-3.1-8b": dict(intermediate_size=14336, draft_vocab_size=32000)}
HEAD_CONFIG = "qwen2.5-coder-0.5b-eagle3/config.json"  # in `specchat.heads`: the bundled head whose layout --head takes
LAYOUTS = {"fixed": "on", "growing": "off", "host": "off"}  # --runtime: the --cuda-graphs that gives each layout
SCRIPT_ROUNDS = 8  # untimed runs that settle an oracle's script (`agree`)
SLOT_STEPS = 8  # timed regeneration steps per --repeats (after three: warm-up and capture)


class ScriptedTree:
    """An oracle: drafts, from a continuation it knows (`script`, the whole sequence of a plain
    greedy run: prompt and answer), a tree of `nodes` nodes whose right path is `depth` deep,
    every other node a wrong sibling hanging off it, so that exactly `depth` tokens are accepted per
    cycle (τ = depth + 1) and the verify step pays for the whole tree. The drafting itself costs
    one gather: what is left of a cycle is the runtime's own cost.

    It drafts on either layout (lists on the growing one, device tensors on the fixed one), so the
    two can be compared on the same trees (`specchat runtime-check`)."""

    feature_layers = None
    reach = 0

    def __init__(self, script: list[int], target: Target, nodes: int, depth: int):
        if not 1 <= depth <= nodes:
            raise ValueError(f"a scripted tree of {nodes} nodes cannot be {depth} deep")
        self.nodes, self.depth, self.vocab_size = nodes, depth, target.vocab_size
        self.fixed, self.device = target.envelope is not None, target.device
        self.follow(script)
        self.kept: list[int] = []  # the growing layout's: this cycle's nodes
        # Levels 1..depth hold one right node each; the wrong ones are spread over the levels,
        # children of the right node above (the root for level 1). Parents come before children.
        levels = [[0] for _ in range(depth)]  # per level: 0 = the right node, w > 0 = the w-th wrong one
        for extra in range(nodes - depth):
            levels[extra % depth].append(len(levels[extra % depth]))
        self.layout: list[tuple[int, int, int]] = []  # (parent, depth, offset) per node
        right = -1
        for level, members in enumerate(levels, start=1):
            first = len(self.layout)
            self.layout += [(right, level, member) for member in members]
            right = first  # this level's right node, the parent of the next level
        parents, depths, offsets = zip(*self.layout)
        self.parents = torch.tensor(parents, device=self.device)
        self.depths = torch.tensor(depths, device=self.device)
        self.offsets = torch.tensor(offsets, device=self.device)  # added to the right token: the wrong ones differ

    def follow(self, script: list[int]) -> None:
        """Draft from `script` (prompt and answer) from the next cycle on."""
        self.script_ids, self.script = list(script), torch.tensor(script, device=self.device)

    def describe(self) -> str:
        return f"an oracle: {self.nodes} nodes, the right path {self.depth} deep"

    def rewind(self, length: int) -> int:
        return length  # it keeps nothing: a cycle's tree depends on the context's length alone

    def forget(self) -> None:
        pass

    def predict(self, tokens: list[int]) -> None:
        pass  # its trees follow the script, whatever text is predicted

    def observe(self, tokens, features) -> None:
        pass

    def prepare(self, root: int, max_depth: int, max_nodes: int) -> int:
        if self.fixed:
            return self.nodes
        self.kept = [node for node, (_, depth, _) in enumerate(self.layout) if depth <= max_depth][:max_nodes]
        return len(self.kept)

    def draft(self, root, length, span, sampling, rng) -> DraftTree:
        if self.fixed:
            at = (length + self.depths).clamp(max=len(self.script) - 1)
            tokens = (self.script[at] + self.offsets) % self.vocab_size
            ones = torch.ones(self.nodes, device=tokens.device)
            return DraftTree(tokens, self.parents, self.depths, ones, valid=ones.bool(), depth=self.depth,
                             sources=None, evidence=None)
        last, slot = len(self.script_ids) - 1, {node: index for index, node in enumerate(self.kept)}
        parents, depths, offsets = zip(*(self.layout[node] for node in self.kept))
        return DraftTree(
            tokens=[(self.script_ids[min(length + depth, last)] + offset) % self.vocab_size
                    for depth, offset in zip(depths, offsets)],
            parents=[slot[parent] if parent >= 0 else -1 for parent in parents], depths=list(depths),
            probs=[1.0] * len(self.kept))

    def commit(self, tree, acceptance, root, features) -> None:
        pass

    def committed(self, tokens, cycle) -> None:
        pass


def build_target(shape: str, layers: int | None, device: str, dtype: torch.dtype, runtime: str,
                 compile: bool = False) -> Target:
    """A target of `shape` with random weights, on the layout `runtime` names, its forward compiled or not."""
    family, fields = SHAPES[shape]
    config_class, model_class = FAMILIES[family]
    fields = {**fields, "num_hidden_layers": layers or fields["num_hidden_layers"]}
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config_class(**fields)).to(dtype)
    spec = ModelSpec(model=f"{shape} (random weights)", dtype=str(dtype).removeprefix("torch."), device=device,
                     quantize="none", compile="on" if compile else "off", cuda_graphs=LAYOUTS[runtime])
    return Target(model, None, spec.model, spec=spec)


def run(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], list]:
    settings = GenerationSettings(max_new_tokens=tokens)
    steps = list(engine.generate(prompt, settings))
    return [t for s in steps for t in s.tokens], steps


def timed(engine: Engine, prompt: list[int], tokens: int, repeats: int, warm: bool = False) -> tuple[list[int], list]:
    """One untimed run (warms up and captures) unless the engine is `warm` already, then `repeats`
    runs; the steps of the last ones."""
    if not warm:
        run(engine, prompt, tokens)
    steps = []
    for _ in range(repeats):
        engine.reset()
        answer, latest = run(engine, prompt, tokens)
        steps += latest[1:]  # the prefill left out
    return answer, steps


def agree(engine: Engine, oracle: ScriptedTree, prompt: list[int], plain: list[int], tokens: int) -> list[int]:
    """Leave `oracle` (`engine`'s drafter) following the answer it gives when it drafts that same
    answer, the script its every cycle accepts, and return that answer.

    In float32 that is the plain answer. In bfloat16 a verify forward of many rows rounds apart from
    a plain step, and a random target's top two logits are often that close: the paths part, the
    oracle goes on drafting a continuation the target no longer takes, and no later cycle accepts its
    whole chain (the 8B shape on an H200, 2026-11-30: not one). Each round drafts the last round's
    answer; a round's cycles repeat the last one's up to where it parted and then accept the token
    it took there, so the answers agree a little further each round."""
    script = plain
    for _ in range(SCRIPT_ROUNDS):
        oracle.follow(prompt + script)
        answer, _ = run(engine, prompt, tokens)
        engine.reset()
        if answer == script:
            break
        script = answer
    return script


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


def measure(args, runtime: str) -> dict:
    dtype = getattr(torch, args.dtype)
    target = build_target(args.shape, args.layers, args.device, dtype, runtime, args.compile)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (args.prompt,), generator=generator).tolist()
    plain, steps = timed(Engine(target), prompt, args.tokens, args.repeats)
    plain_ms = median_ms([s.seconds for s in steps])
    rows = []
    for nodes in args.nodes:
        for depth in args.depths:
            oracle = ScriptedTree(prompt + plain, target, nodes, depth)
            engine = Engine(target, oracle)
            agree(engine, oracle, prompt, plain, args.tokens)  # its untimed runs warm the engine up too
            answer, cycles = timed(engine, prompt, args.tokens, args.repeats, warm=True)
            full = [s for s in cycles if len(s.tokens) == depth + 1]  # the budget's last cycle may be cut
            if not full:
                raise RuntimeError(f"no cycle of the {nodes}-node oracle accepted its {depth} drafted tokens: "
                                   f"the random target's choices stayed too close to call in {args.dtype}")
            cycle_ms = median_ms([s.seconds for s in full])
            tau = depth + 1
            rows.append({"nodes": nodes, "rows": nodes + 1, "depth": depth, "tau": tau, "cycle_ms": round(cycle_ms, 3),
                         "speedup": round(tau * plain_ms / cycle_ms, 3),
                         "efficiency": round(plain_ms / cycle_ms, 3), "exact": answer == plain})
    result = {"runtime": target.runtime, "plain_ms": round(plain_ms, 3), "plain_tok_s": round(1000 / plain_ms, 1),
              "oracle": rows}
    if args.head:
        result["head"] = head_cycle(args, target, prompt)
    if args.trace:
        trace(args, target, prompt, plain, runtime)
    return result


def slot_steps(args) -> list[dict]:
    """`specchat data regenerate`'s decoding step at each slot count and span: every slot busy, the
    deepest at the span and the others spread evenly down to an eighth of it (as answers at every
    depth share a step), all greedy or half of them sampling, each slot attending over the common
    span and, where flash attention runs, over its own positions alone (`attention`: span, own); host
    bookkeeping included (the step's inputs written, its tokens read: as regeneration runs it). A
    target loaded as regeneration loads it (no graphs of its own: the slot decoder captures its steps)."""
    target = build_target(args.shape, args.layers, args.device, getattr(torch, args.dtype), "growing")
    timed_steps, results = SLOT_STEPS * args.repeats, []
    extra = timed_steps + 3 + 3 + 2  # tokens per slot: the timed steps, warm-up and capture, a trace's, a margin
    attentions = ("span", "own") if flash_varlen_failure(target.device, target.dtype) is None else ("span",)
    for slots, span, hot, attention in itertools.product(args.slots, args.spans, (0, 1), attentions):
        hot = hot * round(slots / 2)  # slots sampling
        decoder = SlotDecoder(target, slots, max_prompt_tokens=span, max_new_tokens=extra, stop_ids=frozenset(),
                              own_spans=attention == "own")
        deepest = max(1, span - extra)
        decoder.fill([max(1, round(deepest * (1 + 7 * i / max(1, slots - 1)) / 8)) for i in range(slots)],
                     [1.0] * hot + [0.0] * (slots - hot))
        for _ in range(3):
            decoder.step()
        decoder.times = times = SlotTimes(slots)  # the timed steps' alone
        for _ in range(timed_steps):
            decoder.step()
        step_ms = 1000 * times.step_seconds / times.steps
        results.append({"slots": slots, "span": times.span_positions // times.steps,
                        "own": round(times.own_positions / times.steps), "sampling": hot, "attention": attention,
                        "step_ms": round(step_ms, 3), "tok_s": round(1000 * slots / step_ms, 1)})
        if args.trace and slots == max(args.slots) and span == max(args.spans) and hot and attention == attentions[-1]:
            write_trace(args.trace, "slots-steps.json", "slots-summary.txt", target.device,
                        lambda: [decoder.step() for _ in range(3)])
    return results


def head_cycle(args, target: Target, prompt: list[int]) -> dict:
    """A random EAGLE-3 head drafting EAGLE-2 trees (60 / 6 / 10): the bundled 0.5B head's layout
    (its MLP width and draft vocabulary; at the 8B scale the published head's, `HEAD_FIELDS`), at
    the target's width and heads."""
    bundled = json.loads(resources.files("specchat.heads").joinpath(HEAD_CONFIG).read_text())
    text = target.config.get_text_config()
    fields = {**bundled, **HEAD_FIELDS.get(args.shape, {})}
    config = Eagle3Config.from_dict({**fields, "hidden_size": text.hidden_size, "vocab_size": target.vocab_size,
                                     "num_attention_heads": text.num_attention_heads,
                                     "num_key_value_heads": text.num_key_value_heads,
                                     "draft_vocab_size": min(fields["draft_vocab_size"], target.vocab_size)})
    torch.manual_seed(0)
    with torch.device(target.device):
        head = Eagle3Head(config, target.embed_tokens).to(target.dtype).eval()
    head.refresh_vocab_map()
    shape = DynamicTree(DynamicTreeParams())  # EAGLE-2's tree as its paper sizes it
    proposer = heads.for_target(head, target, shape)
    _, cycles = timed(Engine(target, proposer), prompt, args.tokens, args.repeats)
    return {"draft_ms": round(median_ms([s.draft_seconds for s in cycles]), 3),
            "verify_ms": round(median_ms([s.verify_seconds for s in cycles]), 3),
            "cycle_ms": round(median_ms([s.seconds for s in cycles]), 3)}


def trace(args, target: Target, prompt: list[int], plain: list[int], runtime: str) -> None:
    """A profiler trace of a few oracle cycles at the largest tree and depth asked for."""
    oracle = ScriptedTree(prompt + plain, target, max(args.nodes), max(args.depths))
    engine = Engine(target, oracle)
    run(engine, prompt, args.tokens)  # warm-up and capture
    engine.reset()
    write_trace(args.trace, f"{runtime}-cycles.json", f"{runtime}-summary.txt", target.device,
                lambda: run(engine, prompt, min(args.tokens, 4 * (max(args.depths) + 1))))


def table(results: dict) -> str:
    lines = []
    for runtime, result in results["runs"].items():
        lines.append(f"{runtime}: {result['runtime']}; plain {result['plain_ms']} ms/token ({result['plain_tok_s']} tok/s)")
        lines.append("  nodes  depth  tau  cycle_ms  speedup  efficiency  exact")
        for row in result["oracle"]:
            lines.append(f"  {row['nodes']:5d}  {row['depth']:5d}  {row['tau']:3d}  {row['cycle_ms']:8.3f}  "
                         f"{row['speedup']:7.2f}  {row['efficiency']:10.2f}  {row['exact']}")
        if "head" in result:
            head = result["head"]
            lines.append(f"  EAGLE-3 head, EAGLE-2 tree 60/6/10: draft {head['draft_ms']} ms + verify "
                         f"{head['verify_ms']} ms = cycle {head['cycle_ms']} ms")
    if results.get("slots"):
        lines.append("regeneration steps (continuous batching, every slot busy):")
        lines.append("  slots   span   own  sampling  attention  step_ms      tok/s")
        for row in results["slots"]:
            lines.append(f"  {row['slots']:5d}  {row['span']:5d}  {row['own']:4d}  {row['sampling']:8d}  "
                         f"{row['attention']:>9}  {row['step_ms']:7.3f}  {row['tok_s']:9.1f}")
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    """argparse's, with a mistake reported as the command line reports every other: one line."""

    def error(self, message: str):
        raise UsageError(f"runtime-check: {message}")


def parser() -> Parser:
    """`specchat runtime-check`'s options."""
    parser = Parser(prog="specchat runtime-check", description=__doc__.split("\n\n")[0].strip('"'))
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a CI-sized run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--runtime", choices=(*LAYOUTS, "both", "none"), default="both",
                        help="the engine's layout (host: the growing one's former name; none: --slots only)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[7, 15, 31, 63], help="tree sizes (rows - 1)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3], help="right-path depths (tau - 1)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement")
    parser.add_argument("--head", action="store_true", help="also time a random EAGLE-3 head's EAGLE-2 trees")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the target's forward (on the fixed layout: inside its captured steps)")
    parser.add_argument("--slots", type=int, nargs="+", default=[],
                        help="also time regeneration's decoding step at these many slots (continuous batching)")
    parser.add_argument("--spans", type=int, nargs="+", default=[256, 1024],
                        help="positions each slot attends over in --slots' steps")
    parser.add_argument("--trace", default=None, help="write a profiler trace of a few cycles to this folder")
    parser.add_argument("-o", "--output", default=None, help="write the results as JSON")
    return parser


def main(argv: list[str]) -> dict:
    """`specchat runtime-check ARGS`: measure, print the table, write the JSON if asked; the results."""
    args = parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    started = time.perf_counter()
    runtimes = {"both": ("fixed", "growing"), "none": ()}.get(args.runtime, (args.runtime,))
    results = {"command": " ".join(["specchat runtime-check", *argv]), "shape": args.shape, "layers": args.layers,
               "dtype": args.dtype, "hardware": hardware(),
               "runs": {runtime: measure(args, runtime) for runtime in runtimes}}
    if args.slots:
        results["slots"] = slot_steps(args)
    results["seconds"] = round(time.perf_counter() - started, 1)
    print(table(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return results

