"""docs/scripts/cpu_targets.py's verdicts: the drafts and start-up issues' figures read from what
`specchat bench`, `run --compare` and the start's timing wrote (its running part is `specchat` itself)."""

import copy
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
spec = importlib.util.spec_from_file_location("cpu_targets", DOCS / "scripts" / "cpu_targets.py")
targets = sys.modules["cpu_targets"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up there)
spec.loader.exec_module(targets)

MEASURED = DOCS / "bench-cpu-drafts" / "xeon-avx512"  # the README's AVX-512 table: every set of the list


@pytest.fixture
def out(tmp_path):
    for prompt_set in targets.SETS:
        (tmp_path / f"b-{prompt_set.name}").mkdir()
        shutil.copy(MEASURED / prompt_set.name / "results.json", tmp_path / f"b-{prompt_set.name}" / "results.json")
    return tmp_path


def by_target(verdicts):
    return {verdict.target: verdict for verdict in verdicts}


def test_the_readmes_avx512_runs_meet_every_done_when_figure_and_say_the_drafting_share(out):
    verdicts = by_target(targets.evaluate(out))
    assert all(verdict.met for verdict in verdicts.values() if verdict.done_when)
    assert verdicts["general10: default over plain"].measured == "1.39x"
    assert verdicts["general10: default over plain"].needed == ">= 1.3x (avx512)"
    drafting = verdicts["general10: a head cycle's drafting, of a plain step"]
    assert drafting.measured == "8.7%" and drafting.met and not drafting.done_when
    assert not verdicts["edit10: a head cycle's drafting, of a plain step"].met  # lookup's long runs: the head catches up


def test_a_category_below_plain_or_a_differing_answer_fails_its_row(out):
    path = out / "b-cpu10" / "results.json"
    results = json.loads(path.read_text())
    changed = copy.deepcopy(results)
    category = next(name for name in changed["summary"]["deagle"] if name != "overall")
    changed["summary"]["deagle"][category]["decode_speedup"] = 0.9  # (bench's decode rate over plain decoding's)
    changed["summary"]["deagle"]["overall"]["identical"] = 0.9
    path.write_text(json.dumps(changed))
    verdicts = by_target(targets.evaluate(out))
    below = verdicts["cpu10: no category below plain"]
    assert not below.met and below.measured == f"{category} 0.90x"
    assert not verdicts["cpu10: answers identical to plain decoding's"].met


def test_a_sampled_set_is_judged_whole_and_its_categories_are_listed(out):
    """Sampled answers differ by method in length and text: a category's one or few answers are the
    scope's figure, the set's over plain decoding the issue's."""
    path = out / "b-cpu10-t1" / "results.json"
    results = json.loads(path.read_text())
    summary = results["summary"]["deagle"]
    category = next(name for name in summary if name != "overall")
    summary[category]["decode_speedup"] = 0.92
    path.write_text(json.dumps(results))
    verdicts = by_target(targets.evaluate(out))
    below = verdicts["cpu10-t1: no category below plain (1 sampled answer a prompt)"]
    assert not below.met and not below.done_when and below.measured == f"{category} 0.92x"
    whole = verdicts["cpu10-t1: default over plain (T=1)"]
    assert whole.met and whole.done_when and whole.measured == f"{summary['overall']['decode_speedup']:.2f}x"
    summary["overall"]["decode_speedup"] = 0.98
    results["meta"]["repeat"] = 3
    path.write_text(json.dumps(results))
    verdicts = by_target(targets.evaluate(out))
    assert not verdicts["cpu10-t1: default over plain (T=1)"].met
    assert "cpu10-t1: no category below plain (3 sampled answers a prompt)" in verdicts


def test_the_class_is_the_kernel_path_the_benches_ran_and_one_for_all(out):
    assert targets.cpu_class("int5 weights, avx2 (forced) kernel, bfloat16 activations") == "avx2"
    assert targets.cpu_class("int5 weights, avx512 kernel, bfloat16 activations") == "avx512"
    with pytest.raises(ValueError, match="not specchat's CPU kernel"):
        targets.cpu_class("bfloat16 weights, torch")
    path = out / "b-general10" / "results.json"
    results = json.loads(path.read_text())
    results["meta"]["runtime"] = "int5 weights, avx2 kernel, bfloat16 activations"
    path.write_text(json.dumps(results))
    with pytest.raises(ValueError, match="different kernel paths"):
        targets.evaluate(out)


def test_the_estimate_and_the_start(out):
    turns = [{"estimated_speedup": 1.30, "speedup": 1.25}, {"estimated_speedup": 0.70, "speedup": 0.97}]
    (out / "est-general10.jsonl").write_text("\n".join(json.dumps({"turns": [turn]}) for turn in turns) + "\n")
    (out / "start.json").write_text(json.dumps({"first": 61.0, "warm": [9.0, 2.9, 3.1, 2.8]}))
    verdicts = by_target(targets.evaluate(out))
    estimate = verdicts["general10: each reply's estimate within 10% of the measured ratio"]
    assert not estimate.met and estimate.measured == "1 of 2 (worst 28% off)"
    assert verdicts["warm start to the first token (median of the last 3)"].measured == "2.90 s"
    assert verdicts["warm start to the first token (median of the last 3)"].met
    assert not verdicts["first start from empty caches, kernel compile included"].met
