"""`reflow up` as a user runs it: endpoints.json, a streamed completion, a clean stop, a cached restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reflow.client import Client
from reflow.v1 import inference_pb2

pytestmark = pytest.mark.slow


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
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Up:
    """A `reflow up` process in a temp data dir."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None):
        """`reflow up` with a tiny, quickly trained base model and two workers, unless `args`
        (e.g. `--workers 1 --demo`) and `env` say otherwise."""
        self.data_dir = data_dir
        self.log = data_dir.parent / f"up-{time.monotonic_ns()}.log"
        env = {
            **os.environ,
            "REFLOW_MODEL_PRESET": "tiny",
            "REFLOW_BOOTSTRAP_STEPS": "5",
            "REFLOW_DEVICE": "cpu",
            "REFLOW_API_KEY": "rf_test_key_0123456789",
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "reflow", "up", "--data-dir", str(data_dir), "--port", "0",
                 *(args or ("--workers", "2"))],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def endpoints(self, timeout_s: float = 240) -> dict:
        path = self.data_dir / "endpoints.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            if path.is_file():
                return json.loads(path.read_text())
            time.sleep(0.5)
        raise AssertionError(f"no endpoints.json after {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(90)


def reflow(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A `reflow` command against the `reflow up` running in `data_dir`."""
    env = {**os.environ, "REFLOW_DATA_DIR": str(data_dir), "REFLOW_FINETUNE_STEPS": "10"}
    return subprocess.run(
        [sys.executable, "-m", "reflow", *args], env=env, capture_output=True, text=True, timeout=300
    )


def wait_for_stats(data_dir: Path, ready: Callable[[dict], bool], timeout_s: float = 60) -> dict:
    """`reflow feedback stats --json` once `ready` holds for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = json.loads(
            subprocess.run(
                [sys.executable, "-m", "reflow", "feedback", "stats", "--json"],
                env={**os.environ, "REFLOW_DATA_DIR": str(data_dir)}, capture_output=True, check=True,
                timeout=60,
            ).stdout
        )  # fmt: skip
        if ready(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"


def test_up_serves_and_stops_cleanly_then_restarts_from_the_registry(data_dir: Path) -> None:
    up = Up(data_dir)
    try:
        endpoints = up.endpoints()
        assert {"gateway", "mlflow", "database", "api_key_file", "workers"} <= set(endpoints)
        assert len(endpoints["workers"]) == 2
        assert sorted(endpoints["metrics"]) == ["gateway", "worker-0", "worker-1"]
        assert Path(endpoints["api_key_file"]).read_text().strip() == "rf_test_key_0123456789"
        assert oct(Path(endpoints["api_key_file"]).stat().st_mode & 0o777) == "0o600"
        with Client(endpoints["gateway"], "rf_test_key_0123456789") as client:
            sampling = inference_pb2.SamplingParams(max_tokens=5)
            messages = list(client.generate("47+38=", sampling=sampling))
            served = [(m.name, [v.version for v in m.versions]) for m in client.list_models().models]
            ack = client.submit_feedback(
                [inference_pb2.Feedback(request_id=messages[0].request_id, rating=1)]
            )
        assert messages[0].model_version == "1" and messages[-1].usage.completion_tokens == 5
        assert served == [("arith", ["1"])]
        assert (ack.accepted, ack.rejected) == (1, 0)
        stats = wait_for_stats(data_dir, lambda s: s["joined_feedback"] == 1)
        assert stats["inferences"] == 1 and stats["dlq_messages"] == 0
        with urllib.request.urlopen(f"{endpoints['mlflow']}/health", timeout=10) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(endpoints["metrics"]["gateway"], timeout=10) as reply:
            assert b'reflow_gateway_requests_total{code="OK",method="Generate"} 1.0' in reply.read()
        cli = subprocess.run(
            [sys.executable, "-m", "reflow", "generate", "47+38=", "--max-tokens", "3"],
            env={**os.environ, "REFLOW_DATA_DIR": str(data_dir)}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert "3 completion tokens" in cli.stderr
        simulated = reflow(data_dir, "simulate", "--rate", "20", "--duration", "1", "--seed", "3")
        assert simulated.returncode == 0, simulated.stderr
        assert "requests 20," in simulated.stdout and "rated 20" in simulated.stdout
        finetuned = reflow(data_dir, "finetune", "run")  # 21 ratings: enough for `run`, which doesn't wait
        assert finetuned.returncode == 0, finetuned.stderr
        assert "held_out_accuracy" in finetuned.stdout
        children = descendants(up.process.pid)
        assert len(children) >= 7  # kafka, consumer, scheduler, mlflow, two workers, gateway
    finally:
        code = up.stop()
    assert code == 0, up.output()
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)], "children outlived `reflow up`"
    assert not (data_dir / "endpoints.json").exists()
    assert "training base model" in up.output()

    again = Up(data_dir)
    try:
        again.endpoints()
        # what was served and rated before the stop was stored, not lost: 1 + 1 (`reflow
        # generate`) + 20 (`reflow simulate`) completions, 1 + 20 ratings
        assert wait_for_stats(data_dir, lambda s: s["inferences"] == 22)["joined_feedback"] == 21
    finally:
        assert again.stop() == 0
    assert "training base model" not in again.output()  # the registered champion is reused
