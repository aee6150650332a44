"""The package as a user installs it: the extras that messages name exist, and a wheel built from
the source tree holds every package, kernel source, profile and bundled head, and answers a prompt
when installed into a fresh environment (not the editable install the tests otherwise run against).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from specchat.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOTS = ("specchat", "drafters")
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", *PACKAGE_ROOTS, "profiles")
KERNELS = ROOT / "specchat/decode/runtime/kernels"


def declared_extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def named_extras() -> dict[str, set[str]]:
    """Every extra a message or an install command names, with where it is named."""
    named: dict[str, set[str]] = {}

    def add(extras: str, where: str) -> None:
        for extra in extras.split(","):
            named.setdefault(extra.strip(), set()).add(where)

    for model in EMBEDDED_MODELS.values():
        add(model.extra, f"specchat.embedded ({model.name})")
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "man").glob("*.1"),
             *(ROOT / "profiles").glob("*.toml"), *(ROOT / "specchat").rglob("*.py")]
    for path in texts:
        text = path.read_text().replace("\\-", "-").replace("\\%", "")  # (man pages' escapes)
        for pattern in (r"specchat\[([^\]]+)\]", r"'\.\[([^\]]+)\]'"):
            for extras in re.findall(pattern, text):
                if "{" not in extras:  # (a message's f-string: specchat.embedded's, checked above)
                    add(extras, str(path.relative_to(ROOT)))
    return named


def test_the_extras_that_messages_name_exist_and_every_pip_resolves_them():
    declared, named = declared_extras(), named_extras()
    assert {"demo", "demo-1-5b", "test"} <= set(named), "the search must see the README's and the table's extras"
    missing = {extra: sorted(where) for extra, where in named.items() if extra not in declared}
    assert not missing, f"extras named but not in pyproject.toml: {missing}"
    # setuptools writes a dotted extra with dashes, and a pip older than 23.3 then does not find it by its
    # written name (pip 23.2, Python 3.11's venv pip, warned and installed nothing for the 1.5B's extra when it had a dot).
    unresolvable = [extra for extra in declared if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", extra)]
    assert not unresolvable, f"extras not in the normalized form every pip resolves: {unresolvable}"


# ---------------------------------------------------------------------------------------------
# The wheel


def _setuptools_builds_wheels_here() -> bool:
    """Whether this environment's setuptools builds a wheel without fetching anything (bdist_wheel is
    setuptools' own from 70.1; before that it needs the `wheel` package)."""
    try:
        version = tuple(int(part) for part in re.findall(r"\d+", metadata.version("setuptools"))[:2])
    except metadata.PackageNotFoundError:
        return False
    return version >= (70, 1) or (version >= (68, 0) and importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the source tree (so that no build/ or egg-info of an earlier build
    in the checkout leaks in, and the checkout gets none)."""
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "checkpoint"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    # Offline when this environment has the build backend (it has, after the README's install on
    # Python 3.11); else pip fetches it into an isolated build environment, as `pip install -e` did.
    isolation = ["--no-build-isolation"] if _setuptools_builds_wheels_here() else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out),
                            str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    [found] = out.glob("specchat-*.whl")
    return found


def expected_in_wheel() -> set[str]:
    expected = set()
    for root in PACKAGE_ROOTS:
        for init in (ROOT / root).rglob("__init__.py"):
            package = init.parent
            expected |= {str(module.relative_to(ROOT)) for module in package.glob("*.py")}
    expected |= {str(source.relative_to(ROOT)) for source in KERNELS.iterdir() if source.suffix in (".cpp", ".h")}
    expected |= {f"specchat/profiles/{profile.name}" for profile in (ROOT / "profiles").glob("*.toml")}
    expected.add("specchat/profiles/__init__.py")
    for head in (ROOT / "specchat/heads").iterdir():
        if (head / "config.json").is_file():
            expected |= {str(part.relative_to(ROOT)) for part in head.iterdir() if part.is_file()}
    return expected


def test_the_wheel_holds_every_package_kernel_source_profile_and_head(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = expected_in_wheel()
    assert {"specchat/decode/engine/__init__.py", "specchat/decode/runtime/kernels/layers.cpp",
            "specchat/profiles/default.toml"} <= expected, "the walk of the source tree must see them"
    assert not sorted(expected - names), f"missing from the wheel: {sorted(expected - names)}"
    tops = {name.split("/")[0] for name in names}
    assert tops == {*PACKAGE_ROOTS, wheel.name.split("-py3")[0] + ".dist-info"}, "no tests/, docs/ or profiles/ of its own"


def test_the_wheels_metadata_provides_the_extras(wheel):
    archive = zipfile.ZipFile(wheel)
    [meta] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    provided = set(re.findall(r"^Provides-Extra: (.+)$", archive.read(meta).decode(), re.MULTILINE))
    assert provided == set(declared_extras())  # written as named: none renamed on the way


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(EMBEDDED_MODELS[DEFAULT_MODEL].packages[0]) is None,
                    reason="the demo extra (embedded model chunks) is not installed")
def test_the_wheel_installed_in_a_fresh_venv_answers_from_outside_the_checkout(wheel, tmp_path, tmp_path_factory):
    """pip installs the wheel alone into a new venv; the dependencies (torch, transformers, the model's
    chunks) come from this environment's site-packages, appended after the venv's own, without its
    editable specchat (whose finder is a .pth that a plain path entry does not run)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()
    here = sysconfig.get_paths()
    Path(site, "specchat-test-dependencies.pth").write_text("\n".join(dict.fromkeys([here["purelib"], here["platlib"]])) + "\n")

    imported = subprocess.run([python, "-c", "import specchat, specchat.cli, specchat.decode.engine, specchat.decode.drafting, "
                               "specchat.decode.acceptance, specchat.decode.runtime, drafters; print(specchat.__file__)"],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(venv), imported.stdout

    if os.environ.get("SPECCHAT_TEST_REAL_CACHE") is None:  # the real-model tests' cache: one conversion a run
        env["SPECCHAT_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "real-model-cache")
    # The kernel compiles from the wheel's sources into a folder of its own: the user's build (keyed by
    # its sources' paths) is not replaced by this one and rebuilt by the next run from the checkout.
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.getbasetemp() / "torch-extensions")
    env["HF_HUB_OFFLINE"] = "1"
    answered = subprocess.run([venv / "bin" / "specchat", "chat", "--max-new-tokens", "4"], input="Say hi\n",
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert answered.stdout.strip(), answered.stderr[-3000:]
