"""What every reflow gRPC server shares: health, reflection, error mapping, ready files, signals."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import Iterable
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from reflow.errors import ErrorInterceptor, OnDone

logger = logging.getLogger(__name__)


def new_server(
    service_names: Iterable[str], on_done: OnDone | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with the error interceptor, health checking and reflection for `service_names`."""
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(on_done)],
        options=[("grpc.so_reuseport", 0)],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, services: Iterable[str], up: bool) -> None:
    """Marks the server and each of `services` SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *services):
        await health_servicer.set(name, status)


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Binds a port, with TLS when `credentials` are given; returns the port actually bound
    (useful with port 0)."""
    address = host_port(host, port)
    bound = (
        server.add_insecure_port(address)
        if credentials is None
        else server.add_secure_port(address, credentials)
    )
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}: is another process using it?")
    return bound


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[WSGIServer, str]:
    """Serves `registry` for Prometheus on host:port (0 = free); returns the server and its URL."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, f"http://{host}:{server.server_port}/metrics"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for children that cannot report their own)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_json_atomically(path: Path, data: object) -> None:
    """Writes `data` as JSON so that readers see the old file or the whole new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_ready_file(path: Path | None, **fields: object) -> None:
    """Tells a supervisor where a child listens, once it serves."""
    if path is not None:
        write_json_atomically(path, fields)


async def wait_for_signal() -> int:
    """Returns the first SIGINT or SIGTERM received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def receive(signum: int) -> None:
        if not received.done():
            received.set_result(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, receive, sig)
    return await received
