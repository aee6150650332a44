"""Project invariants: CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    blocks = ROOT.joinpath("README.md").read_text().split("```sh\n")[1:3]
    return [block.split("\n```")[0].strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    setup, test = readme_commands()
    assert "specchat chat" in setup and "pytest" in test
    ci_lines = [line.strip() for line in ROOT.joinpath(".ci/run").read_text().splitlines()]
    assert test in ci_lines
