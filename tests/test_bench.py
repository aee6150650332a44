"""`specchat bench`: the Spec-Bench statistics, the outputs, and a run end to end on a tiny model."""

import importlib.util
import json
import re

import pytest

from conftest import invoke, load_tiny_target, random_head
from specchat.cli import resolve_settings
from specchat.errors import UsageError
from specchat.methods import bench_methods
from specchat.bench.measure import TurnResult, calibration, summarize


def turn(method, question, turn_index, new_tokens, seconds, forwards, response="same", category="writing", **extra):
    return TurnResult(method=method, question=question, category=category, turn=turn_index, repeat=0,
                      response=response, new_tokens=new_tokens, seconds=seconds, target_forwards=forwards, **extra)


def test_bench_measures_plain_the_profiles_method_and_lookup_unless_told():
    assert bench_methods(resolve_settings({})[0]) == ["vanilla", "deagle", "pld"]  # the default profile
    assert bench_methods(resolve_settings({"method": "pld"})[0]) == ["vanilla", "pld"]  # each once
    assert bench_methods(resolve_settings({"profile": "qwen2.5-coder-1.5b-sps"})[0]) == ["vanilla", "sps", "pld"]


def test_speedup_is_the_ratio_of_mean_per_question_speeds():
    results = [
        turn("vanilla", 1, 0, 10, 1.0, 10), turn("vanilla", 1, 1, 10, 1.0, 10),  # question 1: 10 tok/s
        turn("vanilla", 2, 0, 30, 1.0, 30),  # question 2: 30 tok/s -> mean 20
        turn("eagle2", 1, 0, 10, 0.5, 4, draft_tokens=30, accepted_tokens=6),
        turn("eagle2", 1, 1, 10, 0.5, 4, response="different", draft_tokens=30, accepted_tokens=6),  # 20 tok/s
        turn("eagle2", 2, 0, 30, 0.5, 10, draft_tokens=90, accepted_tokens=20),  # 60 tok/s -> mean 40
    ]
    summary = summarize(results, greedy=True)
    overall = summary["eagle2"]["overall"]
    assert summary["vanilla"]["overall"]["tokens_per_s"] == 20.0
    assert overall["tokens_per_s"] == 40.0 and overall["speedup"] == 2.0
    assert overall["tau"] == round(50 / 18, 3)
    assert overall["acceptance_rate"] == round(32 / 150, 4)
    assert overall["identical"] == round(2 / 3, 4)
    assert summarize(results, greedy=False)["eagle2"]["overall"]["identical"] is None


def test_a_peers_speculation_is_compared_with_its_own_runtimes_plain_decoding():
    # llama.cpp's answers differ from specchat's plain ones (another quantization); its EAGLE-3
    # speculation is lossless or not against llama.cpp's own plain decoding, when that ran too.
    results = [turn("vanilla", 1, 0, 3, 1.0, 3, response="a", tokens=[1, 2, 3]),
               turn("llamacpp", 1, 0, 3, 1.0, 3, response="b", tokens=[1, 2, 4]),
               turn("llamacpp-eagle3", 1, 0, 3, 1.0, 2, response="b", tokens=[1, 2, 4]),
               turn("llamacpp-lookup", 1, 0, 3, 1.0, 2, response="c", tokens=[1, 5, 4])]
    summary = summarize(results, greedy=True)
    assert summary["llamacpp"]["overall"]["identical"] == 0.0  # against vanilla: its own plain is vanilla
    assert summary["llamacpp-eagle3"]["overall"]["identical"] == 1.0
    assert summary["llamacpp-lookup"]["overall"]["identical"] == 0.0
    assert results[3].divergence.position == 1
    alone = summarize([r for r in results if r.method != "llamacpp"], greedy=True)
    assert alone["llamacpp-eagle3"]["overall"]["identical"] is None  # nothing of its runtime to compare with


def test_tree_and_stop_depths_are_means_over_cycles():
    deep = {"depths": [1, 2, 3, 3], "stop_depth": 4}
    shallow = {"depths": [1, 1], "stop_depth": 2}
    summary = summarize([turn("deagle", 1, 0, 4, 1.0, 2, cycles=[deep, shallow]),
                         turn("eagle2", 1, 0, 4, 1.0, 2, cycles=[{"depths": [1, 2]}])], greedy=True)
    assert summary["deagle"]["overall"]["tree_depth"] == 2.0
    assert summary["deagle"]["overall"]["stop_depth"] == 3.0
    assert summary["eagle2"]["overall"]["stop_depth"] is None


def test_calibration_counts_only_reachable_nodes():
    # root -> a (0.9, accepted) -> c (0.8, rejected); root -> b (0.05): c is reachable via a.
    cycle = {"parents": [-1, -1, 0, 2], "probs": [0.9, 0.05, 0.8, 0.95], "accepted": [0]}
    points = calibration([turn("eagle2", 1, 0, 2, 1.0, 1, cycles=[cycle])], "eagle2")
    counted = sum(count for _, _, count in points)
    assert counted == 3  # node 3's parent (c) was rejected: not reachable
    high = [p for p in points if p[0] > 0.85][0]
    assert high[1] == 1.0  # the 0.9 node was accepted


def test_the_selection_is_judged_on_every_candidate_the_answer_shows_accepted():
    """At temperature 0 the answer says which of a cycle's candidates the target would have accepted,
    verified or not: per source, their expected against realized acceptance, and the accepted tokens
    an oracle choosing among the same candidates would have gained beyond the verified tree's."""
    answer = [10, 11, 12, 13, 14, 15]
    # cycle 1 (root 10): candidates 11 (head, verified), 12 under it (lookup, left out: would have been
    # accepted), 99 (head, verified, rejected); accepted [11], bonus 12 -> the next root is 12
    first = {"root": 10, "tokens": [11, 99], "parents": [-1, -1], "accepted": [0],
             "candidates": {"tokens": [11, 99, 12], "parents": [-1, -1, 0], "verified": [0, 1],
                            "values": [0.8, 0.1, 0.5], "sources": ["head", "head", "lookup"]}}
    plain = {"root": 12, "tokens": [], "parents": [], "accepted": []}  # a plain step: no offer; next root 13
    # cycle 3 (root 13): a chain 14, 15, 16 proposed; the answer ends at 15: undetermined, left out
    last = {"root": 13, "tokens": [14], "parents": [-1], "accepted": [0],
            "candidates": {"tokens": [14, 15, 16], "parents": [-1, 0, 1], "verified": [0], "values": [0.9, 0.8, 0.7]}}
    rows = [turn("deagle", 1, 0, 6, 1.0, 3, tokens=answer, cycles=[first, plain, last])]
    selection = summarize(rows, greedy=True)["deagle"]["overall"]["selection"]
    assert selection == {"cycles": 1, "missed_per_cycle": 1.0,
                         "by_source": {"head": {"candidates": 2, "expected": 0.45, "accepted": 0.5},
                                       "lookup": {"candidates": 1, "expected": 0.5, "accepted": 1.0}}}
    assert "selection" not in summarize(rows, greedy=False)["deagle"]["overall"]  # sampled: the answer cannot say
    assert "selection" not in summarize([turn("pld", 1, 0, 6, 1.0, 3, tokens=answer, cycles=[plain])],
                                        greedy=True)["pld"]["overall"]


def test_bench_end_to_end_writes_tables_json_csv_and_plots(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": ["hi", "more"]})
                                 for i, c in ((1, "writing"), (2, "coding"))) + "\n")
    out = tmp_path / "bench"
    args = ["bench", str(prompts), "--model", str(qwen_dir), "--dtype", "float32", "--max-new-tokens", "6",
            "--methods", "pld,hf-pld,eagle2", "--output", str(out), "--warmup", "0"]
    code, _, err = invoke(args, capsys)
    assert code == 0, err
    assert "skipping eagle2" in err  # no head bundled for a tiny model and none given: said, not crashed
    per_turn = re.findall(r"^(\S+) \d+/\d+: question \d turn \d, \d+ tokens, [\d.]+ tok/s, τ [\d.]+$", err, re.M)
    assert sorted(set(per_turn)) == ["hf-pld", "pld", "vanilla"] and len(per_turn) == 3 * 4  # a log gets a line per turn
    data = json.loads((out / "results.json").read_text())
    assert set(data["summary"]) == {"vanilla", "pld", "hf-pld"}
    assert {"overall", "writing", "coding"} <= set(data["summary"]["pld"])
    assert data["summary"]["pld"]["overall"]["identical"] == 1.0  # lossless at temperature 0
    assert len(data["turns"]) == 3 * 2 * 2
    assert (out / "results.csv").read_text().startswith("method,category,tokens_per_s,speedup")
    for name in ("speedup.png", "calibration.png", "acceptance_by_depth.png", "memory.png"):
        assert (out / name).stat().st_size > 1000


def test_interleaved_bench_asks_every_method_each_question_in_turn(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "q.txt"
    prompts.write_text("hi\nmore\n")
    out = tmp_path / "bench"
    code, err = _bench([str(prompts), "--model", str(qwen_dir), "--methods", "pld,deagle+lookup=off", "--interleave",
                        "--draft-for", "deagle=none", "--output", str(out)], capsys)
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    order = [(turn["question"], turn["method"]) for turn in data["turns"]]
    questions = list(dict.fromkeys(q for q, _ in order))
    assert order == [(q, m) for q in questions for m in ("vanilla", "pld")]  # question-major; the misfit skipped
    assert data["meta"]["interleave"] and "deagle+lookup=off" in data["meta"]["skipped"]
    assert data["summary"]["pld"]["overall"]["identical"] == 1.0
    assert "peak_memory_mib" not in data["summary"]["pld"]["overall"] and not (out / "memory.png").exists()


def test_interleaved_answers_come_one_by_one_so_an_interruption_keeps_them():
    from specchat.bench.measure import run_interleaved
    from specchat.chat import Turn
    from specchat.inputs import PromptRecord
    from specchat.stats import Stats

    asked = []

    class Runner:
        def __init__(self, name):
            self.name = name

        def start(self, record, system):
            pass

        def turn(self, prompt):
            if len(asked) == 5:
                raise KeyboardInterrupt
            asked.append((prompt, self.name))
            return Turn(text="ok", stats=Stats(new_tokens=1, seconds=0.1), tokens=[1])

    records = [PromptRecord(id=str(i), category=None, turns=[f"q{i}"]) for i in range(3)]
    kept = []
    with pytest.raises(KeyboardInterrupt):
        kept.extend(run_interleaved({"a": Runner("a"), "b": Runner("b")}, records, None, 1, 0, lambda result: None))
    assert asked == [("q0", "a"), ("q0", "b"), ("q1", "a"), ("q1", "b"), ("q2", "a")]
    assert [(r.question, r.method) for r in kept] == [("0", "a"), ("0", "b"), ("1", "a"), ("1", "b"), ("2", "a")]


def _bench(args, capsys):
    code, _, err = invoke(["bench", *args, "--dtype", "float32", "--max-new-tokens", "4", "--warmup", "0"], capsys)
    return code, err


def test_draft_goes_to_every_method_that_drafts_and_a_misfit_is_skipped(qwen_dir, tmp_path, capsys):
    from drafters import save_head

    head = tmp_path / "head"
    save_head(random_head("eagle", load_tiny_target(qwen_dir)), head)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": ["hi"]}) + "\n")
    # A small model as --draft: sps drafts with it.
    code, err = _bench([str(prompts), "--model", str(qwen_dir), "--methods", "sps", "--draft", str(qwen_dir),
                        "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    assert data["meta"]["drafts"]["sps"] == str(qwen_dir) and data["summary"]["sps"]["overall"]["identical"] == 1.0
    # A head as --draft: eagle2 drafts with it; sps cannot load it as a model and is skipped, said.
    code, err = _bench([str(prompts), "--model", str(qwen_dir), "--methods", "eagle2,sps", "--draft", str(head),
                        "-o", str(tmp_path / "b")], capsys)
    assert code == 0, err
    assert "skipping sps" in err
    assert set(json.loads((tmp_path / "b" / "results.json").read_text())["summary"]) == {"vanilla", "eagle2"}


def test_divergences_are_located_with_vanilla_margins_in_the_same_conversation():
    def answered(method, question, turn_index, ids, margins=()):
        result = turn(method, question, turn_index, len(ids), 1.0, 4)
        result.tokens, result.margins = list(ids), list(margins)
        return result

    margins = [3.0, 0.2, 4.0, 5.0]
    results = [
        answered("vanilla", 1, 0, [1, 2, 3, 4], margins), answered("vanilla", 1, 1, [5, 6, 7, 8], margins),
        answered("vanilla", 2, 0, [1, 2, 3, 4], margins),
        answered("eagle2", 1, 0, [1, 9, 3, 4]),  # differs at a near-tie (0.2)
        answered("eagle2", 1, 1, [5, 6, 7, 8]),  # its conversation already differed: not compared
        answered("eagle2", 2, 0, [1, 2, 3, 9]),  # differs at a clear margin (5.0): a bug
    ]
    overall = summarize(results, greedy=True)["eagle2"]["overall"]
    assert overall["compared"] == 2 and overall["diverged"] == 2 and overall["identical"] == 0.0
    assert overall["near_tie_share"] == 0.5
    assert (results[3].divergence.position, results[3].divergence.margin, results[3].divergence.near_tie) == (1, 0.2, True)
    assert results[4].divergence is None and not results[4].compared
    assert results[5].divergence.position == 3 and not results[5].divergence.near_tie


def test_decode_rate_leaves_each_turns_prefill_out():
    results = [turn("vanilla", 1, 0, 11, 2.0, 11, prefill_seconds=1.0),  # 10 tokens in 1 s after the first
               turn("pld", 1, 0, 11, 1.5, 5, prefill_seconds=1.0)]  # 10 tokens in 0.5 s
    summary = summarize(results, greedy=False)
    assert summary["vanilla"]["overall"]["decode_tokens_per_s"] == 10.0
    assert summary["pld"]["overall"]["decode_tokens_per_s"] == 20.0 and summary["pld"]["overall"]["decode_speedup"] == 2.0


def test_llamacpp_peer_is_skipped_in_one_line_without_its_package_or_a_gguf(qwen_dir, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    code, err = _bench([str(prompts), "--model", str(qwen_dir), "--methods", "llamacpp", "-o", str(tmp_path / "a")], capsys)
    assert code == 0 and "skipping llamacpp: needs llama-cpp-python" in err and "-mno-amx-tile" in err
    assert "pip install 'specchat[peers]'" in err
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    if real_find_spec("llama_cpp") is not None:  # installed: the tiny model is a folder, not a GGUF file
        code, err = _bench([str(prompts), "--model", str(qwen_dir), "--methods", "llamacpp-lookup", "-o",
                            str(tmp_path / "b")], capsys)
        assert code == 0 and "has no GGUF file" in err


METHODS_SHOWN = ["vanilla", "deagle", "deagle+lookup=off", "pld", "llamacpp", "llamacpp-lookup", "hf-assisted"]


def realistic_summary():
    """Two categories of two questions; speeds, τ, acceptance, divergences and memory like a real run's."""
    plain = [1, 2, 3, 4, 5, 6, 7, 8]
    margins = [3.0, 0.2, 4.0, 5.0, 2.0, 2.0, 2.0, 2.0]
    speed = {"vanilla": 18.3, "deagle": 41.27, "deagle+lookup=off": 38.02, "pld": 24.6, "llamacpp": 23.11,
             "llamacpp-lookup": 29.45, "hf-assisted": 12.4}
    tau = {"vanilla": 1.0, "deagle": 3.4, "deagle+lookup=off": 3.1, "pld": 1.6, "llamacpp": 1.0, "llamacpp-lookup": 1.5,
           "hf-assisted": 2.0}
    results = []
    for method in METHODS_SHOWN:
        for question, category in ((1, "writing"), (2, "coding"), (3, "writing"), (4, "coding")):
            tokens = list(plain)
            if method == "hf-assisted" and question < 3:
                tokens[2 * question - 1] = 9  # question 1 at the near-tie, question 2 at a clear margin
            if method == "deagle+lookup=off" and question == 1:
                tokens[1] = 9
            seconds = len(tokens) / speed[method] * (1 + question / 20)
            drafted = {} if tau[method] == 1.0 else {"draft_tokens": 40, "accepted_tokens": round(8 - 8 / tau[method])}
            forwards = round(len(tokens) / tau[method])
            result = turn(method, question, 0, len(tokens), seconds, forwards, category=category, prefill_seconds=0.05,
                          **drafted)
            result.tokens, result.margins = tokens, (margins if method == "vanilla" else [])
            results.append(result)
    summary = summarize(results, greedy=True)
    for method, categories in summary.items():
        for numbers in categories.values():
            numbers["peak_memory_mib"] = 1530.4 + 170 * METHODS_SHOWN.index(method)
    return summary


def rendered(width):
    import io

    from rich.console import Console

    from specchat.bench.run import result_tables

    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    console.print(result_tables(realistic_summary(), "Qwen/Qwen2.5-7B-Instruct · T=0.0 · 256 tokens"))
    return console.file.getvalue()


@pytest.mark.parametrize("width", [80, 120, 60])
def test_result_tables_are_readable_at_the_width_of_the_terminal_or_pipe(width):
    out = rendered(width)
    print(out)  # pytest -s shows the tables
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= width
    for category in ("writing", "coding", "overall"):
        assert out.count(f"{category} · Qwen/Qwen2.5-7B-Instruct") == 1
    assert out.index("writing ·") < out.index("overall ·")  # overall last
    names = re.findall(r"^(\S+)  +[\d–]", out, re.M)  # the first cell of every row, whole
    tables = 3 if width >= 80 else 6  # narrower than the whole table: two tables per category
    assert names == METHODS_SHOWN * tables
    headers = [line.split() for line in out.splitlines() if line.startswith("method ")]
    assert len(headers) == tables
    if width >= 80:
        assert headers[0] == ["method", "tok/s", "×", "tok/s", "×", "τ", "acc", "same", "ties", "MiB"]
    else:
        assert headers[:2] == [["method", "tok/s", "×", "tok/s", "×", "MiB"], ["method", "τ", "acc", "same", "ties"]]
    assert "50% of 2" in out and "100% of 1" in out  # hf-assisted overall; deagle+lookup=off, writing
    legend = " ".join(out.split())
    assert legend.count("×: speedup over vanilla") == 1
    assert "ties: differing answers that first differ at a near-tie" in legend


def test_each_method_gets_its_draft_as_chat_would_unless_draft_for_says():
    """bench's drafts: --draft-for by label or method, else `methods.effective_draft` (--draft, else the
    method's default for the model); a variant may name its own draft; plain decoding always runs."""
    from specchat.bench.run import method_settings
    from specchat.settings import Settings

    settings = Settings(model="some/model", draft="given-head")
    runs, skipped = method_settings(["eagle2", "deagle+draft=variant-head", "sps", "pld"], {"sps": "small-model"},
                                    settings)
    assert list(runs) == ["vanilla", "eagle2", "deagle+draft=variant-head", "sps", "pld"]
    assert [run.draft for run in runs.values()] == [None, "given-head", "variant-head", "small-model", None]
    assert [run.method for run in runs.values()] == ["vanilla", "eagle2", "deagle", "sps", "pld"]
    runs, skipped = method_settings(["eagle2"], {}, Settings(model="some/model"))  # no head for this model
    assert list(runs) == ["vanilla"] and "--draft-for eagle2=PATH" in skipped["eagle2"]
    with pytest.raises(UsageError, match="--draft-for jakiro=...: jakiro is not one of the methods run"):
        method_settings(["eagle2"], {"jakiro": "head"}, settings)  # a draft for no method run is said, not dropped


def test_draft_for_items_are_method_and_path():
    from specchat.cli import draft_paths

    assert draft_paths(("sps=small", "deagle+lookup=off=heads/h")) == {"sps": "small", "deagle+lookup=off": "heads/h"}
    for wrong in ("sps", "=path", "sps="):
        with pytest.raises(UsageError, match="expected METHOD=PATH"):
            draft_paths((wrong,))


def test_a_cycles_breakdown_adds_up_to_the_cycle_and_is_drawn(qwen_dir, tmp_path, capsys):
    """--breakdown on the quantized tiny model: per method, the parts of a decoding cycle (products
    and attention timed inside the fused forward) add up to the cycle's time; peers have none."""
    from specchat.decode.runtime import woq_kernel

    if woq_kernel.unavailable_reason() is not None:
        pytest.skip("the quantized kernel needs an x86 CPU with AVX2 and a C++ compiler")
    prompts = tmp_path / "q.txt"
    prompts.write_text("hi\nmore\n")
    out = tmp_path / "bench"
    code, _, err = invoke(["bench", str(prompts), "--model", str(qwen_dir), "--quantize", "int5", "--max-new-tokens", "8",
                           "--methods", "pld,hf-pld", "--warmup", "0", "--breakdown", "--output", str(out)], capsys)
    assert code == 0, err
    summary = json.loads((out / "results.json").read_text())["summary"]
    for method in ("vanilla", "pld"):
        parts = summary[method]["overall"]["breakdown"]
        assert parts["products"] > 0 and parts["attention"] > 0 and parts["cycles"] > 0
        total = sum(parts[name] for name in ("products", "attention", "forward_rest", "drafting", "bookkeeping"))
        assert total == pytest.approx(parts["cycle_ms"], abs=0.01)
    assert summary["hf-pld"]["overall"]["breakdown"] is None  # transformers' generate: not timed
    assert (out / "breakdown.png").stat().st_size > 1000


def test_bench_without_methods_measures_what_chat_would_run_for_the_model(qwen_dir, tmp_path, capsys):
    """The default profile's method has no draft for a --model of the user's: chat would draft with
    prompt lookup alone (`drafted_for_model`), and bench without --methods measures that, not a
    method that cannot run."""
    prompts = tmp_path / "q.txt"
    prompts.write_text("hi\n")
    out = tmp_path / "bench"
    code, err = _bench([str(prompts), "--model", str(qwen_dir), "--output", str(out)], capsys)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["methods"] == ["vanilla", "pld"] and not results["meta"]["skipped"]
