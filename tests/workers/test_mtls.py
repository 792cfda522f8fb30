"""mTLS between gateway and worker, with test certificates: the gateway's pool and reflow's control
calls get in with a certificate the CA signed; no certificate, or one from another CA, does not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from feedback.experiments.promotion import push_to_workers
from gateway.routing import WorkerPool
from reflow.mtls import TlsFiles, channel_credentials, server_credentials
from reflow.settings import Settings
from reflow.v1 import worker_pb2, worker_pb2_grpc
from reflow.worker_calls import WorkerTargets, call_workers
from tests.support.certificates import tls_files
from tests.support.stack import start_worker


def as_settings(base: Settings, files: dict[str, tuple[Path, Path]], role: str) -> Settings:
    cert, key = files[role]
    return base.model_copy(
        update={"tls_ca_file": str(files["ca"][0]), "tls_cert_file": str(cert), "tls_key_file": str(key)}
    )


async def test_mtls_admits_certificates_the_ca_signed_and_nothing_else(
    settings: Settings, tmp_path: Path
) -> None:
    ours, theirs = tls_files(tmp_path / "ours", "reflow test CA"), tls_files(tmp_path / "theirs", "other CA")
    worker_settings = as_settings(settings, ours, "worker")
    gateway_settings = as_settings(settings, ours, "gateway")
    worker = await start_worker(
        worker_settings, credentials=server_credentials(TlsFiles.from_settings(worker_settings))
    )
    pool = WorkerPool(
        [worker.address], poll_s=60, credentials=channel_credentials(TlsFiles.from_settings(gateway_settings))
    )
    try:
        await pool.refresh()
        [handle] = pool.workers
        assert handle.healthy and [v.version for v in handle.loaded] == ["1"]  # the gateway gets in

        async def status(channel: grpc.aio.Channel) -> None:
            await worker_pb2_grpc.WorkerStub(channel).Status(worker_pb2.WorkerStatusRequest(), timeout=5)

        for channel in (
            grpc.aio.insecure_channel(worker.address),  # plaintext
            grpc.aio.secure_channel(  # TLS without a client certificate
                worker.address, grpc.ssl_channel_credentials(root_certificates=ours["ca"][0].read_bytes())
            ),
            grpc.aio.secure_channel(  # a client certificate from another CA
                worker.address,
                channel_credentials(
                    TlsFiles.from_settings(as_settings(settings, {**theirs, "ca": ours["ca"]}, "gateway"))
                ),
            ),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await status(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        control = gateway_settings.model_copy(update={"workers": [worker.address]})
        status = worker_pb2.WorkerStatusRequest()  # how `reflow workers status` calls a worker
        [answer] = (
            await asyncio.to_thread(call_workers, WorkerTargets.from_settings(control), "Status", status, 5)
        ).values()
        assert answer.isolation == "none"
        pushed = await asyncio.to_thread(push_to_workers, WorkerTargets.from_settings(control))
        assert pushed[worker.address].startswith("FAILED_PRECONDITION")  # in, but follows no alias
        without_certificate = settings.model_copy(update={"workers": [worker.address]})
        refused = await asyncio.to_thread(push_to_workers, WorkerTargets.from_settings(without_certificate))
        assert refused[worker.address].startswith("UNAVAILABLE")
    finally:
        await pool.close()
        await worker.server.stop(0)
        worker.engine.close()
