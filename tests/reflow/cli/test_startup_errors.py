"""A process that cannot start says why in one line, `error: ...` naming what to change, with exit
status 2 and no traceback: a port another process holds, a store or a registry out of reach."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from reflow.serving import free_port
from reflow.store.database import migrate, open_db
from tests.support.cli import reflow
from tests.support.kafka import Broker
from tests.support.registry import RegistryFixture


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a process that could not start ended with, once it is sure there is only that:
    exit status 2, no traceback (plain or rich), no other `error:` line."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "╭" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    return errors[0]


def gateway_env(data_dir: Path, kafka: Broker) -> dict[str, str]:
    """A gateway's settings in `data_dir`, its store migrated, in front of a worker nobody runs."""
    migrate(open_db(f"sqlite:///{data_dir / 'reflow.db'}"))
    return {
        "REFLOW_DATA_DIR": str(data_dir), "REFLOW_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "REFLOW_WORKERS": "127.0.0.1:1", "REFLOW_ISOLATION": "none",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("face", "setting"),
    [("--port", "REFLOW_GATEWAY_PORT (--port)"), ("--http-port", "REFLOW_HTTP_PORT (--http-port)")],
)
def test_a_gateway_on_a_taken_port_names_the_setting_that_moves_it(
    face: str, setting: str, taken: int, tmp_path: Path, kafka: Broker
) -> None:
    ports = {"--port": "0", "--http-port": "0", face: str(taken)}
    args = [arg for option, port in ports.items() for arg in (option, port)]
    result = reflow("gateway", *args, env=gateway_env(tmp_path, kafka), timeout_s=120)
    what = "the gRPC port" if face == "--port" else "the HTTP port"
    line = refusal(result)
    assert line.startswith(f"error: cannot bind {what} 127.0.0.1:{taken}"), line
    assert line.endswith(f"is another process using it? set {setting} to a free port"), line


@pytest.mark.slow  # the worker loads its model before it binds
def test_a_worker_on_a_taken_port_names_the_setting_that_moves_it(
    taken: int, tmp_path: Path, mlflow_store: RegistryFixture
) -> None:
    env = {
        "REFLOW_DATA_DIR": str(tmp_path), "REFLOW_MLFLOW_TRACKING_URI": mlflow_store.tracking_uri,
        "REFLOW_MLFLOW_ARTIFACT_ROOT": mlflow_store.artifact_root, "REFLOW_DEVICE": "cpu",
        "REFLOW_ISOLATION": "none",
    }  # fmt: skip
    result = reflow("worker", "--port", str(taken), env=env, timeout_s=120)
    assert refusal(result) == (
        f"error: cannot bind the gRPC port 127.0.0.1:{taken}: is another process using it? "
        "set REFLOW_WORKER_PORT (--port) to a free port"
    )


def test_a_worker_whose_registry_does_not_answer_says_so_at_once(tmp_path: Path) -> None:
    registry = f"http://127.0.0.1:{free_port()}"
    env = {
        "REFLOW_DATA_DIR": str(tmp_path),
        "REFLOW_MLFLOW_TRACKING_URI": registry,
        "REFLOW_ISOLATION": "none",
    }
    result = reflow("worker", env=env, timeout_s=60)  # not after MLflow's minutes of retries
    assert refusal(result) == (
        f"error: cannot reach the MLflow registry at {registry} (Connection refused); start it, or set "
        "REFLOW_MLFLOW_TRACKING_URI"
    )


@pytest.mark.parametrize("command", [("scheduler",), ("feedback", "consume"), ("tenants", "list")])
def test_a_store_out_of_reach_is_one_line_without_its_password(
    command: tuple[str, ...], tmp_path: Path
) -> None:
    url = f"postgresql://reflow:secret@127.0.0.1:{free_port()}/reflow"
    result = reflow(
        *command, env={"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_DATABASE_URL": url}, timeout_s=60
    )
    line = refusal(result)
    assert line.startswith("error: cannot reach the store at postgresql+psycopg://reflow:***@127.0.0.1:"), (
        line
    )
    assert line.endswith("start it, or set REFLOW_DATABASE_URL") and "secret" not in result.stderr, line


@pytest.mark.slow  # a worker process loading MLflow
def test_a_worker_told_to_serve_a_model_nobody_registered_says_how_to_name_one(
    tmp_path: Path, mlflow_store: RegistryFixture
) -> None:
    env = {
        "REFLOW_DATA_DIR": str(tmp_path), "REFLOW_MLFLOW_TRACKING_URI": mlflow_store.tracking_uri,
        "REFLOW_MLFLOW_ARTIFACT_ROOT": mlflow_store.artifact_root, "REFLOW_DEVICE": "cpu",
        "REFLOW_ISOLATION": "none", "REFLOW_MODEL_NAME": "typo",
    }  # fmt: skip
    line = refusal(reflow("worker", env=env, timeout_s=120))
    assert line.startswith(
        "error: model 'typo' has no alias @champion in the registry; set REFLOW_MODEL_NAME"
    ), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
def test_a_worker_on_a_device_torch_cannot_see_says_which_to_use(tmp_path: Path) -> None:
    env = {"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_DEVICE": "cuda", "REFLOW_ISOLATION": "none"}
    line = refusal(reflow("worker", env=env, timeout_s=60))
    assert line == "error: REFLOW_DEVICE=cuda but torch sees no CUDA device; use cpu or auto"
