"""benchmarks/gpu_runtime.py in its smallest form: it runs on a CPU, the oracle is accepted exactly as
deep as scripted on both runtimes, and the report holds what the GPU run will be judged by."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_runtime  # noqa: E402


def test_the_runtime_benchmark_runs_and_reports_efficiency(tmp_path, capsys):
    output = tmp_path / "runtime.json"
    results = gpu_runtime.main(["--shape", "tiny", "--device", "cpu", "--nodes", "3", "7", "--depths", "1", "3",
                                "--tokens", "16", "--prompt", "8", "--repeats", "1", "--head",
                                "--trace", str(tmp_path / "trace"), "-o", str(output)])
    assert json.loads(output.read_text())["runs"].keys() == {"fixed", "host"}
    for run in results["runs"].values():
        assert run["plain_ms"] > 0 and {row["tau"] for row in run["oracle"]} == {2, 4}
        assert all(row["exact"] and row["efficiency"] > 0 for row in run["oracle"])
        assert run["head"]["draft_ms"] > 0 and run["head"]["verify_ms"] > 0
    assert "fixed-shape steps (eager)" in results["runs"]["fixed"]["runtime"]
    assert (tmp_path / "trace" / "fixed-summary.txt").is_file()
    assert "efficiency" in capsys.readouterr().out
