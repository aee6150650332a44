"""Project invariants: CI runs exactly the README's test command; the walls between the wings hold."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    blocks = ROOT.joinpath("README.md").read_text().split("```sh\n")[1:3]
    return [block.split("\n```")[0].strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    setup, test = readme_commands()
    assert "specchat chat" in setup and "pytest" in test
    ci_lines = [line.strip() for line in ROOT.joinpath(".ci/run").read_text().splitlines()]
    assert test in ci_lines


# ---------------------------------------------------------------------------------------------
# The package's layout: no import cycles, each method named once


def project_modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted([*(ROOT / "specchat").rglob("*.py"), *(ROOT / "drafters").rglob("*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), str(path))
    return modules


def imported_modules(tree: ast.Module, name: str, known: set[str]) -> set[str]:
    """Every project module `name` imports, at module level or inside functions alike."""
    package = name if (ROOT / name.replace(".", "/") / "__init__.py").is_file() else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {module for module in found if module in known and module != name}


def test_no_import_cycles_among_the_project_modules():
    modules = project_modules()
    graph = {name: imported_modules(tree, name, set(modules)) for name, tree in modules.items()}
    assert graph["specchat.cli"] and graph["specchat.app"], "the walk must see real imports"
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def all_imports(tree: ast.Module) -> set[str]:
    """Every module named by an absolute import, at module level or inside functions alike."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
    return found


def test_drafters_is_a_leaf_that_needs_torch_and_safetensors_only():
    modules = {name: tree for name, tree in project_modules().items() if name.split(".")[0] == "drafters"}
    assert "drafters.eagle3" in modules
    allowed = set(sys.stdlib_module_names) | {"torch", "safetensors", "drafters"}
    for name, tree in modules.items():
        outside = {module for module in all_imports(tree) if module.split(".")[0] not in allowed}
        assert not outside, f"{name} imports {sorted(outside)}: drafters imports torch, safetensors and the standard library only"
    code = "import sys, drafters; print(sorted(m for m in sys.modules if m.split('.')[0] in ('specchat', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_decoding_core_imports_only_itself_drafters_and_the_errors():
    core = {name: tree for name, tree in project_modules().items() if name.startswith("specchat.decode")}
    assert "specchat.decode.engine" in core
    for name, tree in core.items():
        ours = {module for module in all_imports(tree) if module.split(".")[0] == "specchat"}
        outside = {module for module in ours if not module.startswith("specchat.decode") and module != "specchat.errors"}
        assert not outside, f"{name} imports {sorted(outside)}; the core knows nothing of the layers above it"


def test_outside_code_reaches_the_core_through_its_face():
    """`specchat.decode`'s FACE names what the layers above use; only its BUILDERS import below it
    (tests may: they test the parts)."""
    import specchat.decode as face

    below = [(name, module) for name, tree in project_modules().items()
             if name.startswith("specchat.") and not name.startswith("specchat.decode")
             and not name.startswith(face.BUILDERS)
             for module in all_imports(tree) if module.startswith("specchat.decode.")]
    assert not below, f"imports below the core's face (add the name to specchat.decode.FACE): {below}"
    for name, where in face.FACE.items():  # each name is where the face says
        assert getattr(face, name) is not None, where
    code = "import sys; from specchat.decode import options, deagle, lookup; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # the face loads what is asked, and the command line's defaults need no torch


def test_the_target_runtime_sits_below_drafting_and_the_engine():
    """`specchat.decode.runtime` (the target: loading, forward, cache, kernel, fixed shapes) is what the
    engine and the drafters run on; it imports neither, nor acceptance."""
    above = ("specchat.decode.engine", "specchat.decode.drafting", "specchat.decode.acceptance")
    runtime = {name: tree for name, tree in project_modules().items() if name.startswith("specchat.decode.runtime")}
    assert "specchat.decode.runtime.target" in runtime
    for name, tree in runtime.items():
        wrong = sorted(module for module in all_imports(tree) if module.startswith(above))
        assert not wrong, f"{name} imports {wrong}; the runtime knows nothing of drafting or the cycle"


def test_the_core_and_the_heads_print_nothing():
    """The decoding core and drafters report through `logging`, which the command line shows: no print."""
    for name, tree in project_modules().items():
        if name.startswith(("specchat.decode", "drafters")):
            prints = [node.lineno for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
            assert not prints, f"{name} prints (lines {prints}); log instead"


def test_each_method_name_is_written_once_outside_the_registry():
    from drafters import FORMATS, LAYOUTS
    from specchat.methods import HEAD_FORMATS, HEAD_LAYOUTS, METHODS

    assert tuple(FORMATS) == HEAD_FORMATS  # head formats: the registry's list, each architecture file's KIND
    assert LAYOUTS == HEAD_LAYOUTS  # export layouts: the torch-free copy the command line offers
    assert {layout for module in FORMATS.values() for layout in module.LAYOUTS} == set(LAYOUTS)
    names = set(METHODS) - set(HEAD_FORMATS)  # "eagle" and "jakiro" also name the head formats
    for name, tree in project_modules().items():
        if name == "specchat.methods":
            continue
        literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not literals & names, f"{name} names methods {sorted(literals & names)}; read them from specchat.methods"


def test_every_method_is_built_by_one_entry_of_the_builder_tables():
    """The tables are explicit (no builder registers itself by being imported): specchat's methods in
    `proposers.BUILDERS`, other tools' in `bench.run.RUNNERS`, each method in exactly one."""
    from specchat.methods import METHODS
    from specchat.bench.run import RUNNERS
    from specchat.proposers import BUILDERS

    assert set(BUILDERS).isdisjoint(RUNNERS) and set(BUILDERS) | set(RUNNERS) == set(METHODS.values())
    assert all(entry.peer for entry in RUNNERS) and not any(entry.peer for entry in BUILDERS)


def test_no_module_is_imported_for_its_side_effects_alone():
    """An import whose name goes unused (flake8's F401, silenced) is one made for what importing does."""
    for path in [*(ROOT / "specchat").rglob("*.py"), *(ROOT / "drafters").rglob("*.py")]:
        silenced = [number for number, line in enumerate(path.read_text().splitlines(), start=1)
                    if "import" in line and "F401" in line]
        assert not silenced, f"{path.relative_to(ROOT)} lines {silenced} import a module only for its side effects"


def test_the_top_level_is_the_design_cards():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: what is tracked is not known")
    tracked = listed.stdout.split()
    assert {name.split("/")[0] for name in tracked if not name.startswith(".")} <= {
        "pyproject.toml", "setup.py", "specchat", "drafters", "profiles", "tests", "man", "README.md", "docs"}


def test_the_command_line_starts_without_torch():
    """--help, profiles and the chat prompt come up before torch and transformers load."""
    code = "import sys, specchat.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_foreign_drafters_package_is_named_not_used(tmp_path):
    """PyPI's unrelated `drafters` (0.0.1: a few protocol classes) ahead of ours on the path is refused in one line."""
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / "__init__.py").write_text('__version__ = "0.0.1"\n\nclass Draft:\n    pass\n')
    run = subprocess.run([sys.executable, "-c", "import specchat"], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode != 0
    assert "shadowed by another package of that name" in run.stderr and "pip uninstall drafters" in run.stderr


@pytest.fixture(scope="module")
def cache_a_module_fixture_sees():
    return os.environ.get("SPECCHAT_CACHE_DIR")


def test_module_fixtures_write_into_the_runs_folders_not_the_users_cache(cache_a_module_fixture_sees, tmp_path_factory):
    """A module-scoped fixture is set up before a test's own folders are: test_serve's chat, opened
    once for the module, measured its verify-cost curve into ~/.cache/specchat on every run."""
    if os.environ.get("SPECCHAT_TEST_REAL_CACHE") is not None:
        pytest.skip("the real cache was asked for")
    assert cache_a_module_fixture_sees is not None
    assert Path(cache_a_module_fixture_sees).is_relative_to(tmp_path_factory.getbasetemp())
