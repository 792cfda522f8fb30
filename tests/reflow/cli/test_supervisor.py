"""Why a child of `reflow up` stopped, as `reflow up` reports it: the one line a reflow command
prints when it cannot start, else the end of its log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from reflow.cli.supervisor import ChildFailed, Supervisor
from reflow.settings import Settings


def exited(tmp_path: Path, code: str) -> str:
    """What `check_alive` says of a child that ran `code` (Python) and exited."""
    supervisor = Supervisor(Settings(data_dir=tmp_path))
    child = supervisor.spawn("gateway", [sys.executable, "-c", code], {}, ready=False)
    child.process.wait(30)
    with pytest.raises(ChildFailed) as failed:
        supervisor.check_alive()
    return str(failed.value)


def test_a_child_that_could_not_start_is_reported_by_its_own_line(tmp_path: Path) -> None:
    line = "error: cannot bind the gRPC port 127.0.0.1:50051: set REFLOW_GATEWAY_PORT"
    code = (
        f"import sys; print('INFO starting', file=sys.stderr); print({line!r}, file=sys.stderr); sys.exit(2)"
    )
    assert exited(tmp_path, code) == (
        "gateway exited with status 2: cannot bind the gRPC port 127.0.0.1:50051: set REFLOW_GATEWAY_PORT "
        f"(log: {tmp_path / 'logs' / 'gateway.log'})"
    )


def test_a_child_that_crashed_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    said = exited(tmp_path, "raise KeyError('a bug')")
    assert said.startswith(
        f"gateway exited with status 1; its log ({tmp_path / 'logs' / 'gateway.log'}) ends:\n"
    )
    assert said.endswith("KeyError: 'a bug'")
