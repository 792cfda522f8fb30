"""mTLS between gateway and worker, with test certificates: the gateway's pool and reflow's control
calls get in with a certificate the CA signed; no certificate, or one from another CA, does not."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from feedback.experiments.promotion import push_to_workers
from gateway.routing import WorkerPool
from reflow.mtls import TlsFiles, channel_credentials, server_credentials
from reflow.settings import Settings
from reflow.v1 import worker_pb2, worker_pb2_grpc
from reflow.worker_calls import WorkerTargets, call_workers
from tests.support.stack import start_worker


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None
) -> x509.Certificate:
    """A certificate for `name` (valid for 127.0.0.1) signed by `issuer`, or a self-signed CA."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def tls_files(directory: Path, ca_name: str) -> dict[str, tuple[Path, Path]]:
    """A CA and two leaf certificates it signed ("worker", "gateway"): name -> (cert, key) files;
    "ca" -> (cert, key) of the CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    files = {}
    for name in ("ca", "worker", "gateway"):
        key = ca_key if name == "ca" else _key()
        certificate = _certificate(
            ca_name if name == "ca" else name, key, None if name == "ca" else (ca_name, ca_key)
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        files[name] = (cert_path, key_path)
    return files


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
