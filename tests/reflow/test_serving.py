"""The start-up failures every server shares, each a ReflowError whose one line says what to change:
a gRPC or metrics port another process holds, an MLflow server that does not answer; and the stop
signal a server listens for before it says it serves."""

from __future__ import annotations

import os
import signal

import pytest
from prometheus_client import CollectorRegistry

from reflow.errors import ReflowError
from reflow.serving import bind, check_registry, free_port, new_server, start_metrics_server, stop_signal


async def test_a_taken_grpc_port_names_the_setting_that_moves_it(taken: int) -> None:
    server, _ = new_server([])
    with pytest.raises(ReflowError) as refused:
        bind(server, "127.0.0.1", taken, setting="REFLOW_WORKER_PORT (--port)")
    assert str(refused.value) == (
        f"cannot bind the gRPC port 127.0.0.1:{taken}: is another process using it? "
        "set REFLOW_WORKER_PORT (--port) to a free port"
    )
    assert bind(server, "127.0.0.1", 0) > 0  # the server is still good for another port


def test_a_taken_metrics_port_names_the_setting_that_moves_it(taken: int) -> None:
    with pytest.raises(ReflowError) as refused:
        start_metrics_server(CollectorRegistry(), "127.0.0.1", taken, setting="REFLOW_GATEWAY_METRICS_PORT")
    assert str(refused.value) == (
        f"cannot bind the metrics port 127.0.0.1:{taken} (Address already in use): is another process "
        "using it? set REFLOW_GATEWAY_METRICS_PORT to a free port"
    )


def test_an_mlflow_server_that_does_not_answer_is_refused_without_its_credentials() -> None:
    url = f"http://token@127.0.0.1:{free_port()}"
    with pytest.raises(ReflowError) as refused:
        check_registry(url, timeout_s=2)
    assert str(refused.value) == (
        f"cannot reach the MLflow registry at {url.replace('token', '***')} (Connection refused); start "
        "it, or set REFLOW_MLFLOW_TRACKING_URI"
    )


@pytest.mark.parametrize("uri", ["sqlite:////tmp/nowhere/mlflow.db", "file:///tmp/nowhere", "databricks"])
def test_a_registry_that_is_no_server_is_not_probed(uri: str) -> None:
    check_registry(uri)


async def test_a_stop_signal_sent_once_the_server_listens_for_it_is_received_not_fatal() -> None:
    stopped = stop_signal()  # what a server calls before it writes its ready file
    os.kill(os.getpid(), signal.SIGTERM)  # a supervisor that stops it at once
    os.kill(os.getpid(), signal.SIGINT)
    assert await stopped == signal.SIGTERM  # the first one; this test process lives on
