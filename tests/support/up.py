"""`reflow up` as a process of a test: started in a temp data dir with a tiny base model, read
through its endpoints.json and `reflow feedback stats`, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cli import reflow, spawn
from tests.support.waiting import wait_for


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


API_KEY = "rf_test_key_0123456789"  # the tenant key `reflow up` is given


class Up:
    """A `reflow up` process in a temp data dir."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None):
        """`reflow up` with a tiny, quickly trained base model and two workers, unless `args`
        (e.g. `--workers 1 --demo`) and `env` say otherwise."""
        self.data_dir = data_dir
        self.log = data_dir.parent / f"up-{time.monotonic_ns()}.log"
        env = {
            "REFLOW_MODEL_PRESET": "tiny",
            "REFLOW_BOOTSTRAP_STEPS": "5",
            "REFLOW_DEVICE": "cpu",
            "REFLOW_DTYPE": "float32",  # not `auto`, which measures the machine (as tests/conftest.py)
            "REFLOW_API_KEY": API_KEY,
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.process = spawn(
                "up", "--data-dir", str(data_dir), "--port", "0", "--http-port", "0",
                *(args or ("--workers", "2")),
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def endpoints(self, timeout_s: float = 240) -> dict[str, Any]:
        """What it wrote to endpoints.json once up; fails with its output if it died or took too long."""
        path = self.data_dir / "endpoints.json"

        def written() -> dict[str, Any] | None:
            assert self.process.poll() is None, self.output()
            return json.loads(path.read_text()) if path.is_file() else None

        try:
            return wait_for(written, timeout_s, what="endpoints.json", interval_s=0.5)
        except AssertionError as error:
            raise AssertionError(f"{error}:\n{self.output()}") from None

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def log_tail(self, process: str, lines: int = 40, unless: str = "\0") -> str:
        """The last `lines` lines of a child's log (`scheduler`, `gateway`, ...) that do not contain
        `unless`, for a failure message."""
        path = self.data_dir / "logs" / f"{process}.log"
        text = path.read_text(errors="replace").splitlines() if path.is_file() else ["(no log)"]
        return "\n".join([line for line in text if unless not in line][-lines:])

    def stop(self) -> int:
        """SIGTERM, then its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(90)


def feedback_stats(
    data_dir: Path, ready: Callable[[dict[str, Any]], bool], timeout_s: float = 60
) -> dict[str, Any]:
    """`reflow feedback stats --json` once `ready` holds for it (the last reading when it never does)."""
    last: dict[str, Any] = {}

    def read() -> bool:
        result = reflow("feedback", "stats", "--json", env={"REFLOW_DATA_DIR": str(data_dir)}, timeout_s=60)
        if result.returncode != 0:  # not a timeout, which the caller's assertion reports
            raise RuntimeError(f"`reflow feedback stats` failed:\n{result.stderr}")
        last.update(json.loads(result.stdout))
        return ready(last)

    with contextlib.suppress(AssertionError):  # the caller's assertion on the numbers says what is wrong
        wait_for(read, timeout_s=timeout_s, what="the feedback stats", interval_s=0.5)
    return last
