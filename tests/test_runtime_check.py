"""`specchat runtime-check` in its smallest form: it runs on a CPU, the oracle is accepted exactly as
deep as scripted on both layouts, and the report holds what the GPU run will be judged by."""

import json
import re

import torch

from conftest import invoke
from specchat import runtime_check
from specchat.decode.engine.engine import Engine
from test_man import MAN, option_sections


def test_the_runtime_check_runs_and_reports_efficiency(tmp_path, capsys):
    output = tmp_path / "runtime.json"
    code, out, _ = invoke(["runtime-check", "--shape", "tiny", "--device", "cpu", "--nodes", "3", "7", "--depths", "1",
                           "3", "--tokens", "16", "--prompt", "8", "--repeats", "1", "--head",
                           "--trace", str(tmp_path / "trace"), "-o", str(output)], capsys)
    assert code == 0 and "efficiency" in out
    results = json.loads(output.read_text())
    assert results["runs"].keys() == {"fixed", "growing"} and results["command"].startswith("specchat runtime-check")
    for run in results["runs"].values():
        assert run["plain_ms"] > 0 and {row["tau"] for row in run["oracle"]} == {2, 4}
        assert all(row["exact"] and row["efficiency"] > 0 for row in run["oracle"])
        assert run["head"]["draft_ms"] > 0 and run["head"]["verify_ms"] > 0
    assert "fixed-shape steps (eager)" in results["runs"]["fixed"]["runtime"]
    assert (tmp_path / "trace" / "fixed-summary.txt").is_file()


def test_the_seeds_scale_is_llama_3_1_8b_as_published():
    """The 8B shape's config builds Llama 3.1 8B (8,030,261,248 parameters, Llama 3's rotary scaling;
    on the meta device: no memory), and the Llama path runs end to end at a tiny size."""
    family, fields = runtime_check.SHAPES["llama-3.1-8b"]
    config_class, model_class = runtime_check.FAMILIES[family]
    with torch.device("meta"):
        model = model_class(config_class(**fields))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.rope_parameters["rope_theta"] == 500000.0
    results = runtime_check.main(["--shape", "tiny-llama", "--device", "cpu", "--nodes", "7", "--depths", "1", "4",
                                  "--tokens", "16", "--prompt", "8", "--repeats", "1", "--head"])
    for run in results["runs"].values():
        assert {row["tau"] for row in run["oracle"]} == {2, 5} and all(row["exact"] for row in run["oracle"])
        assert run["head"]["draft_ms"] > 0


def test_a_wrong_option_is_one_line_and_every_option_is_in_the_manual(capsys):
    code, _, err = invoke(["runtime-check", "--shape", "nonesuch"], capsys)
    assert code == 2 and err.count("\n") == 1 and "runtime-check: argument --shape" in err
    code, out, _ = invoke(["runtime-check", "--help"], capsys)
    assert code == 0 and "--nodes" in out
    documented = option_sections("specchat-runtime-check.1")
    missing = [option for option in re.findall(r"(?<![\w-])(--?[\w-]+)", out) if option not in documented]
    assert (MAN / "specchat-runtime-check.1").is_file() and not missing, missing


def test_compile_asks_for_the_compiled_forward_on_either_layout():
    args = runtime_check.parser().parse_args(["--compile", "--runtime", "fixed"])
    assert args.compile
    for runtime in ("fixed", "growing"):
        compiled = runtime_check.build_target("tiny", 1, "cpu", torch.float32, runtime, compile=True)
        assert compiled.compiled and "compiled forward" in compiled.runtime  # compiling waits for the first run
        assert not runtime_check.build_target("tiny", 1, "cpu", torch.float32, runtime).compiled


def test_slots_time_regenerations_step_alone(tmp_path, capsys):
    """`--slots` with `--runtime none`: the slot decoder's step at each slot count, span and share
    sampling, every slot busy; the layouts left out."""
    output = tmp_path / "slots.json"
    code, out, _ = invoke(["runtime-check", "--shape", "tiny", "--device", "cpu", "--runtime", "none", "--slots", "2",
                           "4", "--spans", "128", "--repeats", "1", "--trace", str(tmp_path / "trace"), "-o", str(output)],
                          capsys)
    assert code == 0 and "regeneration steps" in out
    results = json.loads(output.read_text())
    assert results["runs"] == {}
    assert [(row["slots"], row["sampling"]) for row in results["slots"]] == [(2, 0), (2, 1), (4, 0), (4, 2)]
    assert all(0 < row["span"] <= 128 and row["tok_s"] > 0 for row in results["slots"])
    # the slots spread down to an eighth of the deepest; a CPU has no flash attention to read own spans with
    assert all(row["own"] < row["span"] and row["attention"] == "span" for row in results["slots"])
    assert (tmp_path / "trace" / "slots-summary.txt").is_file()


def test_an_oracle_whose_script_parted_from_the_target_is_settled_on_what_the_target_takes():
    """In bfloat16 a verify forward rounds apart from a plain step, and on a random target the oracle's
    script (the plain answer) and the target's choices can part (the 8B shape on an H200: no cycle
    accepted its chain). A script wrong from its sixth token stands in for that here: in float32 the
    target's own answer is the plain one, and the script is settled on it."""
    target = runtime_check.build_target("tiny", None, "cpu", torch.float32, "growing")
    prompt = list(range(1, 9))
    plain, _ = runtime_check.run(Engine(target), prompt, 16)
    parted = plain[:5] + [(token + 1) % target.vocab_size for token in plain[5:]]
    oracle = runtime_check.ScriptedTree(prompt + parted, target, 7, 3)
    engine = Engine(target, oracle)
    assert runtime_check.agree(engine, oracle, prompt, parted, 16) == plain
    answer, cycles = runtime_check.run(engine, prompt, 16)
    assert answer == plain and all(len(cycle.tokens) == 4 for cycle in cycles[1:-1])  # every whole cycle takes τ = 4
