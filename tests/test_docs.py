"""The README documents what the code does: every setting and every CLI command."""

from __future__ import annotations

import re
from pathlib import Path

from typer.main import get_command

from reflow.cli import app
from reflow.settings import Settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = set(re.findall(r"^\| `(REFLOW_[A-Z_]+)` \|", README, flags=re.MULTILINE))
    expected = {f"REFLOW_{name.upper()}" for name in Settings.model_fields} | {"REFLOW_CONFIG"}
    assert documented == expected


def test_every_command_is_documented() -> None:
    group = get_command(app)
    commands = []
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        subcommands = getattr(command, "commands", None)
        commands += [f"reflow {name} {sub}" for sub in subcommands] if subcommands else [f"reflow {name}"]
    missing = [c for c in commands if f"`{c}" not in README]
    assert not missing, f"README lacks {missing}"
