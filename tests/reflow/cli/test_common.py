"""The one place a command's start-up failure becomes one line: any ReflowError out of a `reflow`
command ends it as `error: ...`, exit status 2; anything else is a bug, and keeps its traceback."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from reflow.cli.common import Commands
from reflow.errors import NotFound, ReflowError

app = typer.Typer(cls=Commands)


@app.command()
def refused() -> None:
    raise NotFound("model 'typo' has no alias @champion in the registry; set REFLOW_MODEL_NAME")


@app.command()
def broken() -> None:
    raise KeyError("a bug")


def test_a_reflow_error_out_of_any_command_is_one_line_and_exit_status_2() -> None:
    result = CliRunner().invoke(app, ["refused"])
    assert result.exit_code == 2
    assert (
        result.stderr == "error: model 'typo' has no alias @champion in the registry; set REFLOW_MODEL_NAME\n"
    )
    assert result.stdout == ""


def test_any_other_error_is_left_to_show_its_traceback() -> None:
    result = CliRunner().invoke(app, ["broken"])
    assert isinstance(result.exception, KeyError) and not isinstance(result.exception, ReflowError)
    assert "error:" not in result.stderr
