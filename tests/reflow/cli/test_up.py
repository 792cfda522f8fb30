"""`reflow up` as a user runs it: endpoints.json, a streamed completion, a clean stop, a cached restart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from reflow.client import Client
from reflow.v1 import inference_pb2
from tests.support.cli import reflow
from tests.support.up import Up, alive, descendants, feedback_stats
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def reflow_in(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A `reflow` command against the `reflow up` running in `data_dir`."""
    return reflow(*args, env={"REFLOW_DATA_DIR": str(data_dir), "REFLOW_FINETUNE_STEPS": "10"})


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"


@pytest.mark.timeout(900)  # two starts of `reflow up`, a simulation and a fine-tune run
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
        stats = feedback_stats(data_dir, lambda s: s["joined_feedback"] == 1)
        assert stats["inferences"] == 1 and stats["dlq_messages"] == 0
        with urllib.request.urlopen(f"{endpoints['mlflow']}/health", timeout=10) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(endpoints["metrics"]["gateway"], timeout=10) as reply:
            assert b'reflow_gateway_requests_total{code="OK",method="Generate"} 1.0' in reply.read()
        cli = reflow(
            "generate", "47+38=", "--max-tokens", "3", env={"REFLOW_DATA_DIR": str(data_dir)}, timeout_s=60
        )
        assert cli.returncode == 0, cli.stderr
        assert "3 completion tokens" in cli.stderr
        simulated = reflow_in(
            data_dir, "simulate", "--task", "arith", "--rate", "20", "--duration", "1", "--seed", "3"
        )
        assert simulated.returncode == 0, simulated.stderr
        assert "requests 20," in simulated.stdout and "rated 20" in simulated.stdout
        finetuned = reflow_in(data_dir, "finetune", "run")  # 21 ratings: enough for `run`, which doesn't wait
        assert finetuned.returncode == 0, finetuned.stderr
        (run,) = [
            json.loads(line) for line in reflow_in(data_dir, "finetune", "runs", "--json").stdout.splitlines()
        ]
        assert run["status"] in ("registered", "rejected") and run["samples"] == 21, run
        assert run["message"] in finetuned.stderr.replace("\n", " ")  # the gate's verdict, both places
        tenants = reflow_in(data_dir, "tenants", "list")
        # one local user: no quota of its own (the queues still push back)
        assert tenants.stdout.split("\t")[2:5] == ["0 streams", "0 rpm", "0 tpm"], tenants.stdout
        assert "trains shared" in tenants.stdout  # one team serving its users learns with no setting
        children = descendants(up.process.pid)
        assert len(children) >= 7  # kafka, consumer, scheduler, mlflow, two workers, gateway
    finally:
        code = up.stop()
    assert code == 0, up.output()
    wait_for(lambda: not [pid for pid in children if alive(pid)], 10, what="`reflow up`'s children to exit")
    assert not (data_dir / "endpoints.json").exists()
    assert "training base model" in up.output()

    limits = ("--max-streams", "3", "--rpm", "100", "--tpm", "5000")
    again = Up(data_dir, "--workers", "1", "--gateways", "2", *limits)
    try:
        endpoints = again.endpoints()
        # what was served and rated before the stop was stored, not lost: 1 + 1 (`reflow
        # generate`) + 20 (`reflow simulate`) completions, 1 + 20 ratings
        assert feedback_stats(data_dir, lambda s: s["inferences"] == 22)["joined_feedback"] == 21
        first, second = endpoints["gateways"]
        assert (first["address"], first["http"]) == (endpoints["gateway"], endpoints["http"])
        assert second["address"] != first["address"]
        for replica in endpoints["gateways"]:  # both serve
            with Client(replica["address"], "rf_test_key_0123456789") as client:
                assert [m.name for m in client.list_models().models] == ["arith"]
        tenants = reflow_in(data_dir, "tenants", "list")
        assert tenants.stdout.split("\t")[2:5] == ["3 streams", "100 rpm", "5000 tpm"], tenants.stdout

        # a worker that crashes is started again on its address, and serves again
        (worker,) = [pid for pid in descendants(again.process.pid) if b"worker-0.json" in cmdline(pid)]
        os.kill(worker, signal.SIGKILL)
        with Client(endpoints["gateway"], "rf_test_key_0123456789") as client:
            wait_for(
                lambda: served_by_a_new_worker(client, worker, again.process.pid), 120, what="the restart"
            )
        assert "worker-0 exited with status -9; starting it again" in again.output()
    finally:
        assert again.stop() == 0
    assert "training base model" not in again.output()  # the registered champion is reused
    assert "2 gateways without REFLOW_REDIS_URL: each has its own quotas" in again.output()


def cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def served_by_a_new_worker(client: Client, old_pid: int, up_pid: int) -> bool:
    """Whether a worker other than `old_pid` runs under `reflow up` and a completion goes through."""
    if not [pid for pid in descendants(up_pid) if b"worker-0.json" in cmdline(pid) and pid != old_pid]:
        return False
    try:
        return bool(list(client.generate("1+1=", sampling=inference_pb2.SamplingParams(max_tokens=2))))
    except grpc.RpcError:
        return False
