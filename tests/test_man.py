"""Manual pages: every command has one, every option of every command is in it, every setting is
described with its profile key and environment variable, and every page renders cleanly."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest

from specchat.cli import cli
from specchat.repl import COMMANDS
from specchat.settings import FIELDS, env_name

MAN = Path(__file__).resolve().parent.parent / "man"
SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "ENVIRONMENT", "FILES", "EXAMPLES",
            "SEE ALSO")


def documented_commands():
    """(page, command line, click command): the top level, each command, and a group's subcommands on its page."""
    found = [("specchat.1", "specchat", cli)]
    for name, command in cli.commands.items():
        found.append((f"specchat-{name}.1", f"specchat {name}", command))
        if isinstance(command, click.Group):
            found += [(f"specchat-{name}.1", f"specchat {name} {sub}", c) for sub, c in command.commands.items()]
    return found


def option_names(command: click.Command) -> list[str]:
    names = [name for p in command.params if isinstance(p, click.Option) for name in p.opts + p.secondary_opts]
    help_option = command.get_help_option(click.Context(command, info_name="specchat"))
    return names + (help_option.opts if help_option else [])


def page_text(page: str) -> str:
    """The page's source with roff's escapes for minus signs, fonts and hyphenation removed."""
    text = (MAN / page).read_text(encoding="utf-8")
    return re.sub(r"\\f[BIRP]", " ", text).replace("\\-", "-").replace("\\%", "")


def option_sections(page: str) -> str:
    """The OPTIONS (and SETTINGS) sections of a page, where options must be listed."""
    parts = re.split(r"^\.SH ", page_text(page), flags=re.M)
    return "\n".join(part for part in parts if part.startswith(("OPTIONS", "SETTINGS")))


def mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@pytest.mark.parametrize("page,command_line,command", documented_commands(), ids=lambda value: str(value))
def test_every_option_is_in_its_commands_page(page, command_line, command):
    assert (MAN / page).is_file(), f"{command_line} has no manual page man/{page}"
    text = option_sections(page)
    missing = [option for option in option_names(command) if not mentions(text, option)]
    assert not missing, f"man/{page} OPTIONS does not list these options of `{command_line}`: {', '.join(missing)}"


def test_every_setting_is_described_with_its_profile_key_and_environment_variable():
    entries = page_text("specchat.1").split(".SH SETTINGS")[1].split(".SH ")[0].split(".TP")
    for name, setting in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        entry = next((e for e in entries if mentions(e.strip().splitlines()[0] if e.strip() else "", flag)), None)
        assert entry is not None, f"specchat.1 SETTINGS has no entry for {flag}"
        key = f"{setting.metadata['section']}.{setting.metadata['key']}"
        assert key in entry and env_name(name) in entry, f"the {flag} entry must name {key} and {env_name(name)}"


def test_every_chat_command_is_documented():
    text = page_text("specchat-chat.1")
    missing = [f"/{name}" for name, _, _ in COMMANDS if not re.search(rf"\.B[IR]? /{name}\b", text)]
    assert not missing, f"specchat-chat.1 COMMANDS lacks {', '.join(missing)}"


@pytest.mark.parametrize("page", sorted(p.name for p in MAN.glob("*.1")))
def test_pages_have_the_standard_sections_in_order(page):
    text = (MAN / page).read_text(encoding="utf-8")
    title = page[:-2].upper().replace("-", "\\-")
    assert text.startswith(f".TH {title} 1 "), f"{page} must start with .TH {title} 1"
    headings = re.findall(r"^\.SH (.+)$", text, flags=re.M)
    present = [h.strip('"') for h in headings if h.strip('"') in SECTIONS]
    assert present == list(SECTIONS), f"{page}: sections {present}, expected {list(SECTIONS)}"


@pytest.mark.parametrize("page", sorted(p.name for p in MAN.glob("*.1")))
def test_pages_render_without_warnings(page):
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed (Debian: apt-get install groff-base), so the pages cannot be rendered")
    path = MAN / page
    checked = subprocess.run(["groff", "-man", "-ww", "-z", "-k", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr
    if shutil.which("man"):
        shown = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True, text=True,
                               env={**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"})
        assert shown.returncode == 0 and shown.stderr == "", shown.stderr
        assert "SYNOPSIS" in shown.stdout
