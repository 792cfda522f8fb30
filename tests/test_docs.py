"""The docs document what the code does: the generated configuration page is fresh, every CLI
command is documented, and the README's links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from typer.main import get_command

from reflow import configdoc
from reflow.cli import app
from reflow.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def cli_commands() -> list[str]:
    """Every command of the `reflow` app: `reflow NAME` or `reflow GROUP NAME`."""
    group = get_command(app)
    commands = []
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        commands += [f"reflow {name} {sub}" for sub in subcommands] if subcommands else [f"reflow {name}"]
    return commands


def test_configuration_reference_is_not_stale() -> None:
    page = configdoc.DOC_PATH
    assert page == DOCS / "configuration.md"
    assert page.is_file(), f"{page} is missing: run `make reference`"
    assert page.read_text() == configdoc.render(), f"{page} is stale: run `make reference`"


def test_every_setting_says_what_it_means() -> None:
    undescribed = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not undescribed, f"settings without a description (the reference's only text): {undescribed}"


def test_every_command_is_documented() -> None:
    text = "\n".join(path.read_text() for path in [README, *sorted(DOCS.glob("*.md"))])
    missing = [c for c in cli_commands() if not re.search(rf"`{re.escape(c)}[ `]", text)]
    assert not missing, f"neither README.md nor docs/*.md documents {missing}"


def test_readme_links_point_at_files() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    assert targets, "README.md links to no docs page"
    broken = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"
