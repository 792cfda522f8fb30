"""What every reflow gRPC server shares: health, reflection, error mapping, ready files, signals,
the Prometheus endpoint beside it (bounded to 16 connections), and the start-up failures they
share (a port taken, a service out of reach), each a ReflowError whose one line says what to do."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, make_wsgi_app

from reflow.errors import ErrorInterceptor, OnDone, ReflowError
from reflow.redaction import redact_url

logger = logging.getLogger(__name__)


# The pings reflow's channels send while a call is open (reflow.mtls.KEEPALIVE, every 10 s) are
# welcome also when the server has sent no data for a while (a long prefill): gRPC's default
# takes a ping within 5 minutes of the last data as abuse and, at the third, closes the connection.
PING_POLICY = (("grpc.http2.min_ping_interval_without_data_ms", 5_000),)


def new_server(
    service_names: Iterable[str],
    on_done: OnDone | None = None,
    *,
    gates: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, int]] = (),
    max_concurrent_rpcs: int | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with the error interceptor, health checking and reflection for `service_names`.
    `gates` run before the error interceptor, around the handlers it makes (so that what they
    refuse is mapped and counted there); `options` are grpc channel arguments (e.g.
    `grpc.max_receive_message_length`); a call past `max_concurrent_rpcs` at once is refused
    RESOURCE_EXHAUSTED (no limit when None)."""
    server = grpc.aio.server(
        interceptors=[*gates, ErrorInterceptor(on_done)],
        options=[("grpc.so_reuseport", 0), *PING_POLICY, *options],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
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
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    *,
    setting: str = "",
) -> int:
    """Binds a port, with TLS when `credentials` are given; returns the port actually bound
    (useful with port 0). A port it cannot bind is a ReflowError naming `setting`, which moves it."""
    address = host_port(host, port)
    try:
        bound = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # grpc says no more than "Failed to bind"
        bound = 0
    if bound == 0:  # what older grpc returns instead
        raise port_taken("the gRPC port", host, port, setting)
    return bound


def port_taken(what: str, host: str, port: int, setting: str, reason: str = "") -> ReflowError:
    """The start-up failure of a port this process cannot bind, in one line naming the setting
    that moves it."""
    why = f" ({reason})" if reason else ""
    move = f"set {setting} to a free port" if setting else "choose a free port"
    return ReflowError(
        f"cannot bind {what} {host_port(host, port)}{why}: is another process using it? {move}"
    )


def unreachable(what: str, url: str, setting: str, reason: object) -> ReflowError:
    """The start-up failure of a service this process cannot reach, in one line naming the setting
    that says where it is (credentials in `url` are not shown)."""
    return ReflowError(f"cannot reach {what} at {redact_url(url)} ({reason}); start it, or set {setting}")


def check_registry(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Refuses, as `unreachable`, an MLflow server that accepts no connection within `timeout_s`:
    its client would retry for minutes, then report the model missing. A local store passes."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        reason = error.strerror or error
        raise unreachable("the MLflow registry", tracking_uri, "REFLOW_MLFLOW_TRACKING_URI", reason) from None


MAX_METRICS_CONNECTIONS = 16  # a scrape takes one; more at once are closed as they come
METRICS_IDLE_TIMEOUT_S = 30.0  # a connection that sends no request for this long is closed


class _MetricsRequestHandler(WSGIRequestHandler):
    """One connection to a metrics server: silent, and closed once idle for METRICS_IDLE_TIMEOUT_S."""

    timeout = METRICS_IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's threaded WSGI server with a bound: a thread per connection, at most
    MAX_METRICS_CONNECTIONS of them; a connection beyond them is closed at once, so a flood of
    connections costs neither threads nor memory."""

    daemon_threads = True
    block_on_close = False  # stopping never waits for a connection that sends nothing

    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or 6
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        super().__init__((host, port), _MetricsRequestHandler)
        self.set_app(make_wsgi_app(registry))

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Takes a slot for the connection; none free closes it."""
        return self._slots.acquire(blocking=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (timed out idle, reset) is closed without a traceback."""
        logger.debug("metrics connection from %s failed", client_address, exc_info=True)


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int, *, setting: str = ""
) -> tuple[WSGIServer, str]:
    """Serves `registry` for Prometheus on host:port (0 = free) in a thread of its own, to at most
    MAX_METRICS_CONNECTIONS connections at once; returns the server and its URL. A port it cannot
    bind is a ReflowError naming `setting`."""
    try:
        server = MetricsServer(host, port, registry)
    except OSError as error:
        raise port_taken("the metrics port", host, port, setting, error.strerror or str(error)) from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server, f"http://{host_port(host, server.server_port)}/metrics"


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


def stop_signal() -> asyncio.Future[int]:
    """From now on SIGINT and SIGTERM no longer end the process: the first received resolves the
    returned future. Call it before telling anyone the process serves (its ready file), so a
    supervisor that stops it at once gets a drain, not a death that leaves its cgroup behind."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def receive(signum: int) -> None:
        if not received.done():
            received.set_result(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, receive, sig)
    return received
