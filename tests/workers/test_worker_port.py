"""What the worker port trusts: off loopback, only callers with a certificate the CA signed (a worker
without mTLS refuses to bind there); a token id past the model's vocabulary is the caller's error,
and the worker keeps serving; the metrics endpoint stays on REFLOW_METRICS_HOST."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest

from reflow.addresses import is_loopback
from reflow.settings import Settings
from reflow.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.support.certificates import tls_files
from tests.support.cli import reflow, spawn
from tests.support.registry import RegistryFixture
from tests.support.stack import start_worker
from tests.support.waiting import wait_for


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("worker-1.internal", False)],
)  # fmt: skip
def test_only_loopback_addresses_keep_a_port_on_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_worker_without_mtls_refuses_to_bind_beyond_loopback(tmp_path: Path) -> None:
    env = {"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_WORKER_HOST": "0.0.0.0", "REFLOW_ISOLATION": "none"}
    result = reflow("worker", env=env, timeout_s=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: REFLOW_WORKER_HOST=0.0.0.0 lets other hosts reach the worker")
    assert "set REFLOW_TLS_CA_FILE, REFLOW_TLS_CERT_FILE and REFLOW_TLS_KEY_FILE" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_with_mtls_a_worker_binds_beyond_loopback_and_its_metrics_stay_on_loopback(
    tmp_path: Path, mlflow_store: RegistryFixture
) -> None:
    files = tls_files(tmp_path / "tls", "reflow test CA")
    ready = tmp_path / "ready.json"
    env = {
        "REFLOW_DATA_DIR": str(tmp_path / "data"),
        "REFLOW_MLFLOW_TRACKING_URI": mlflow_store.tracking_uri,
        "REFLOW_MLFLOW_ARTIFACT_ROOT": mlflow_store.artifact_root,
        "REFLOW_DEVICE": "cpu",
        "REFLOW_ISOLATION": "none",
        "REFLOW_WORKER_HOST": "0.0.0.0",
        "REFLOW_TLS_CA_FILE": str(files["ca"][0]),
        "REFLOW_TLS_CERT_FILE": str(files["worker"][0]),
        "REFLOW_TLS_KEY_FILE": str(files["worker"][1]),
    }
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = spawn("worker", "--ready-file", str(ready), env=env, stdout=out, stderr=subprocess.STDOUT)

    def serving() -> dict[str, str] | None:
        assert worker.poll() is None, log.read_text()
        return json.loads(ready.read_text()) if ready.is_file() else None

    try:
        started = wait_for(serving, timeout_s=120, what="the worker's ready file")
        assert started["address"].startswith("0.0.0.0:")
        assert started["metrics"].startswith("http://127.0.0.1:")  # REFLOW_METRICS_HOST's default
        with urllib.request.urlopen(started["metrics"], timeout=30) as reply:
            assert b"reflow_worker_generated_tokens_total" in reply.read()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


async def test_a_token_id_past_the_vocabulary_is_an_invalid_argument_naming_it(
    tmp_path: Path, mlflow_store: RegistryFixture
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        mlflow_tracking_uri=mlflow_store.tracking_uri,
        mlflow_artifact_root=mlflow_store.artifact_root,
        device="cpu",
    )
    worker = await start_worker(settings)
    vocab_size = worker.engine.get("arith", "1").model.vocab_size
    sampling = inference_pb2.SamplingParams(max_tokens=4)
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            past = worker_pb2.WorkerGenerateRequest(
                model="arith", version="1", prompt_token_ids=[1, 20, vocab_size], sampling=sampling
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [m async for m in stub.Generate(past)]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == (
                f"prompt_token_ids holds {vocab_size}, past the vocabulary of arith/1 "
                f"(ids 0 to {vocab_size - 1})"
            )
            within = worker_pb2.WorkerGenerateRequest(
                model="arith", version="1", prompt_token_ids=[1, 20, vocab_size - 1], sampling=sampling
            )
            answer = [m async for m in stub.Generate(within)]  # the worker serves on
            assert answer[-1].finish_reason and answer[-1].prompt_tokens == 3
    finally:
        await worker.server.stop(0)
        worker.engine.close()
