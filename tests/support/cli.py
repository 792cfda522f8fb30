"""Running `reflow` as its users do: a child process on this interpreter, with settings in its
environment on top of the test's own; a server among them read through its ready file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_for

REFLOW = (sys.executable, "-m", "reflow")  # the command, for a child the test starts itself
READY_TIMEOUT_S = 120


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


@dataclass
class Process:
    """A `reflow` child process and what it wrote to its ready file."""

    process: subprocess.Popen[bytes]
    log: Path
    ready: dict[str, str]

    @property
    def address(self) -> str:
        return self.ready["address"]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends `sig`; a SIGTERM must end in a drain and a clean exit."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            code = self.process.wait(60)
            assert sig != signal.SIGTERM or code == 0, f"exit {code}:\n{self.log.read_text()[-2000:]}"


def start(
    root: Path, name: str, args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()
) -> Process:
    """`reflow ARGS` with `env` (run under `prefix`: on another host, `ip netns exec NAME`), once it
    wrote its ready file; its output goes to `root`/NAME.log."""
    ready_file, log = root / f"{name}.json", root / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*prefix, *REFLOW, *args, "--ready-file", str(ready_file)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
        )  # fmt: skip
    try:
        started_or_gone = lambda: ready_file.is_file() or process.poll() is not None  # noqa: E731
        wait_for(started_or_gone, READY_TIMEOUT_S, what=f"{name} to start", interval_s=0.1)
        assert process.poll() is None, f"{name} exited with {process.returncode}"
    except AssertionError as error:
        process.kill()
        raise AssertionError(
            f"{name} did not start ({error}):\n{log.read_text(errors='replace')[-3000:]}"
        ) from None
    return Process(process, log, json.loads(ready_file.read_text()))
