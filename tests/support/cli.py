"""Running `reflow` as its users do: a child process on this interpreter, with settings in its
environment on top of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

REFLOW = (sys.executable, "-m", "reflow")  # the command, for a child the test starts itself


def reflow(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """`reflow ARGS` run to its end, its output captured as text."""
    return subprocess.run(
        [*REFLOW, *args], env={**os.environ, **(env or {})}, input=stdin, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip


def spawn(*args: str, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[bytes]:
    """`reflow ARGS` started in the background (a server, or `reflow up`)."""
    return subprocess.Popen([*REFLOW, *args], env={**os.environ, **(env or {})}, **popen)
