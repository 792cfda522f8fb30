"""uvicorn serving the HTTP face on the gateway's running event loop, beside the gRPC server, so
both faces share one process, one worker pool and one set of quotas; its connections bounded in
number (REFLOW_MAX_CONCURRENT_REQUESTS) and in the time and size of their headers."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from gateway.edge import EdgeLimits
from gateway.http.protocol import GuardedHttp
from reflow.gateway_tls import GatewayTls
from reflow.serving import port_taken


class _InLoopServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway's own handler drains both faces."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """An ASGI app served on host:port (0 = a free one) until `stop`, within `limits`, over HTTPS
    with `tls`."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        grace_s: float,
        limits: EdgeLimits,
        tls: GatewayTls | None = None,
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets of that protocol, and
        # without it Nagle holds a response's second write for the client's delayed ACK (~40 ms)
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(socket.SOMAXCONN)
        except OSError as error:
            self.socket.close()
            raise port_taken(
                "the HTTP port", host, port, "REFLOW_HTTP_PORT (--http-port)", error.strerror or str(error)
            ) from None
        self.port: int = self.socket.getsockname()[1]
        self.scheme = "http" if tls is None else "https"
        config = uvicorn.Config(
            app,
            # uvicorn wraps the sockets it is handed in TLS too (its ssl context is the Config's)
            ssl_certfile=None if tls is None else tls.cert,
            ssl_keyfile=None if tls is None else tls.key,
            lifespan="off",
            log_config=None,  # reflow's logging, as configured
            access_log=False,  # the relay logs every completion
            timeout_graceful_shutdown=math.ceil(grace_s),
            http=GuardedHttp.with_timeout(limits.header_timeout_s),
            # 503 once this many connections are open (uvicorn counts the one asking among them)
            limit_concurrency=limits.max_concurrent_requests + 1,
        )
        self._server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serves in the background once this returns."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stops accepting, lets open streams finish within the grace time, then returns once every
        request has ended (uvicorn cancels those still open after the grace time, and returns
        before they have cleaned up)."""
        if self._task is None:
            self.socket.close()
            return
        self._server.should_exit = True
        await self._task
        await asyncio.gather(*list(self._server.server_state.tasks), return_exceptions=True)
